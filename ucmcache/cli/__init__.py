"""The ``ucmcache`` command: see inside a live segment from the shell, and operate it.

``ucmcache COMMAND --help`` for each command.  The manual (commands, status words, exit codes,
the ``inspect --json`` and ``ls --json`` schemas) is docs/operations.md.

The package: _facts gathers from a segment (the dicts of the --json forms), _render turns them
into the human forms, _commands runs the commands (argument parsing and main).
"""
from ._commands import build_parser, main
from ._facts import CliError, inspect_facts, ls_row

__all__ = ["main", "build_parser", "CliError", "inspect_facts", "ls_row"]
