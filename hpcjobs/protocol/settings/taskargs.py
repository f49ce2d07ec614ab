"""A task's own flags (trainers.task re-exports these for task modules): argparse that raises one line instead of a
usage block per rank. Torch-free and in the shared layer: the launcher refuses a bad task flag before torch is
imported, and `hpcjobs submit` refuses one of a bundled task (hpcjobs.protocol.settings.taskflags) before anything is
queued."""

from __future__ import annotations

import argparse
import difflib
from typing import Any, NoReturn

from hpcjobs.protocol.settings.helpflags import HELP_FLAGS
from hpcjobs.protocol.settings.trainflags import trainer_flag_names


class TaskArgError(ValueError):
    """A task flag that cannot be used, as one line, in the trainer flags' pattern
    (hpcjobs.protocol.settings.trainflags.ConfigError): what was given; valid: what would be. HINT: what to do."""


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
            trainer = trainer_flag_names()  # a typo of a trainer flag reaches the task: it is a candidate too
            close = difflib.get_close_matches(unknown[0].split("=")[0], [*flags, *trainer], n=1)
            if close:
                whose = "a trainer flag" if close[0] in trainer and close[0] not in flags else "a task flag"
                hint = f"did you mean {close[0]} ({whose})? {hint}"
            return (f"{self.prog}: {' '.join(unknown)} is not a flag of this task or of the trainer; valid task "
                    f"flags: {' '.join(flags) or 'none'}; trainer flags: {_compact(trainer)}. HINT: {hint}")
        return f"{self.prog}: {message}; valid task flags: {' '.join(flags) or 'none'}. HINT: {hint}"


def _compact(flags: list[str]) -> str:
    """Flags as a list to read: a switch and its `--no-` form as one `--[no-]name`."""
    return " ".join(f"--[no-]{f[2:]}" if f"--no-{f[2:]}" in flags else f for f in flags
                    if not (f.startswith("--no-") and f"--{f[5:]}" in flags))


class Number:
    """A task flag's number with its valid range, as argparse's `type=`: `Number(int, low=1)` refuses
    `--seq-len -1` with the range instead of letting torch fail on it later. `high` is inclusive; `above` makes
    `low` exclusive (a dropout below 1, a learning rate above 0)."""

    def __init__(self, kind: type[int] | type[float], low: float | None = None, high: float | None = None,
                 above: bool = False, below: bool = False) -> None:
        self.kind, self.low, self.high, self.above, self.below = kind, low, high, above, below
        self.__name__ = kind.__name__  # argparse names the type in "invalid int value"

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'a whole number' if self.kind is int else 'a number'}"
                                              ) from None
        if not self.holds(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range")
        return value

    def holds(self, value: float) -> bool:
        if value != value or value in (float("inf"), float("-inf")):
            return False
        low_ok = self.low is None or (value > self.low if self.above else value >= self.low)
        high_ok = self.high is None or (value < self.high if self.below else value <= self.high)
        return low_ok and high_ok

    def describe(self) -> str:
        letter = "N" if self.kind is int else "X"
        if self.high is None:
            return letter if self.low is None else f"{letter} with {letter} {'>' if self.above else '≥'} {self.low:g}"
        left = "" if self.low is None else f"{self.low:g} {'<' if self.above else '≤'} "
        return f"{letter} with {left}{letter} {'<' if self.below else '≤'} {self.high:g}"


def _valid_task_flag(action: argparse.Action) -> str:
    flag = action.option_strings[0] if action.option_strings else action.dest
    if action.choices is not None:
        return f"{flag} {'|'.join(str(c) for c in action.choices)}"
    if isinstance(action.type, Number):
        return f"{flag} {action.type.describe()}"
    kind = {int: "N (a whole number)", float: "X (a number)"}.get(action.type, "VALUE")  # type: ignore[call-overload]
    return f"{flag} {kind}" if action.nargs != 0 else f"{flag} alone"
