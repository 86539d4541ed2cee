"""What the ``areal-fn`` subcommands do (``areal_fn.cli`` parses the arguments and calls
these): ``plan`` and ``plan --suggest``, ``convert``, ``checkpoint inspect --json``.

Every command prints through :func:`~areal_fn.runtime.console.text_console`; with
``--json`` it prints one JSON document on stdout instead (keys in docs/cli.md), and
progress, where there is any, goes to stderr.
"""
