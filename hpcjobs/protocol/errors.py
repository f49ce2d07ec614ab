"""The project's own errors. Each renders as one line: what was given, what is valid, and a HINT."""

from __future__ import annotations

import reprlib


class HpcjobsError(Exception):
    """Base of every error hpcjobs reports to a user; `exit_code` is what the CLI exits with."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = " ".join(self.message.split())  # never more than one line, whatever was interpolated
        return f"{text} HINT: {' '.join(self.hint.split())}" if self.hint else text


class UsageError(HpcjobsError):
    """Bad input: a malformed profile, an impossible request, a missing entry point. Nothing was submitted."""

    exit_code = 2


class ProfileError(UsageError):
    """A cluster profile that cannot be found or does not validate."""


class StartRefused(Exception):
    """Base of every refusal of a rank's start (a node-side usage error): a contract or job environment that cannot
    be read, a torch below the floor, a trainer or task flag that cannot be used, a resume under other settings, a run
    folder another job holds or that cannot be written (trainers.runlock; launch's claim_run_folder says those). The
    launcher (trainers.launch) says it in one line and exits REFUSED_EXIT (2, hpcjobs.protocol.faultpolicy.recoverable):
    never recovered, nothing recorded as the run's end. Each keeps its own standard base (ValueError, RuntimeError)
    beside this one, so code that caught those still does."""


class RuntimeFailure(HpcjobsError):
    """Something outside hpcjobs refused: sbatch, scancel, the filesystem."""

    exit_code = 1


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel = 2
_BRIEF.maxlist = _BRIEF.maxtuple = _BRIEF.maxset = _BRIEF.maxfrozenset = _BRIEF.maxdict = 4
_BRIEF.maxstring = _BRIEF.maxother = 40


def shown(value: object) -> str:
    """A value as an error message quotes it: long ones cut, so the message stays one readable line. A container
    shows its first items only, never its whole repr: a YAML alias nested in itself makes a 342-byte profile a list
    whose repr has 680 million characters (25 s and 1.3 GB, to be cut to 60)."""
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        text = _BRIEF.repr(value)
        return text if len(text) <= 80 else f"{text[:60]}..."
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"
