"""Parallel strategies: allocation records, the allocation grammar, the rules every path checks degrees with."""
