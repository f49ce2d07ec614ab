"""The flags that ask for help, in one place for both sides: the CLI (`hpcjobs submit ... ENTRY --help`) and the
node side (`python -m trainers TASK --help`, a task's flags). Imports nothing, so neither side's start-up pays."""

from __future__ import annotations

from collections.abc import Sequence

HELP_FLAGS = ("-h", "--help")
"""The flags that ask an entry (or the shared trainer) for its help instead of running it."""


def asks_help(args: Sequence[str]) -> bool:
    """Whether the entry's arguments ask for its help (before a `--`, after which they are the entry's own)."""
    args = list(args)
    return any(a in HELP_FLAGS for a in (args[:args.index("--")] if "--" in args else args))
