"""A task's own flags (trainers.task re-exports these for task modules): argparse that raises one line instead of a
usage block per rank. Torch-free: the launcher refuses a bad task flag before torch is imported."""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn

from hpcjobs.protocol.helpflags import HELP_FLAGS


class TaskArgError(ValueError):
    """A task flag that cannot be used, as one line, in the trainer flags' pattern
    (hpcjobs.protocol.trainflags.ConfigError): what was given; valid: what would be. HINT: what to do."""


class TaskArgParser(argparse.ArgumentParser):
    """argparse for a task's own flags, raising TaskArgError instead of printing a usage block and exiting: every
    rank parses the same flags, and a mistake must read as one line, not as a SystemExit traceback per rank. Long
    options match exactly (a prefix of a trainer flag would otherwise be taken). `--help` prints and exits as usual
    (`python -m trainers help TASK` shows it)."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        super().__init__(prog=prog, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise TaskArgError(self.explain(message)) from None  # argparse's own exception adds nothing to the log

    def explain(self, message: str) -> str:
        """argparse's message with what is valid and what to do."""
        flags = sorted(o for a in self._actions for o in a.option_strings if o not in HELP_FLAGS)
        hint = f"`python -m trainers help {self.prog}` lists them"
        if message.startswith("argument "):
            names, _, why = message[len("argument "):].partition(": ")
            why = why.split(" (choose from ")[0]  # `valid:` lists them
            action = next((a for a in self._actions if set(a.option_strings) & set(names.split("/"))), None)
            valid = _valid_task_flag(action) if action is not None else " ".join(flags)
            return f"{self.prog}: {names}: {why}; valid: {valid}. HINT: {hint}"
        unknown = message.removeprefix("unrecognized arguments: ").split()
        if message.startswith("unrecognized arguments: ") and unknown:
            close = difflib.get_close_matches(unknown[0].split("=")[0], flags, n=1)
            hint = f"did you mean {close[0]}? {hint}" if close else hint
            return (f"{self.prog}: {' '.join(unknown)} is not a flag of this task or of the trainer; valid task "
                    f"flags: {' '.join(flags) or 'none'}. HINT: {hint}")
        return f"{self.prog}: {message}; valid task flags: {' '.join(flags) or 'none'}. HINT: {hint}"


def _valid_task_flag(action: argparse.Action) -> str:
    flag = action.option_strings[0] if action.option_strings else action.dest
    if action.choices is not None:
        return f"{flag} {'|'.join(str(c) for c in action.choices)}"
    kind = {int: "N (a whole number)", float: "X (a number)"}.get(action.type, "VALUE")  # type: ignore[call-overload]
    return f"{flag} {kind}" if action.nargs != 0 else f"{flag} alone"
