"""``python -m bench.gpu``: see :mod:`bench.gpu.driver`."""

import sys

from bench.gpu.driver import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
