"""The project's own errors. Each renders as one line: what was given, what is valid, and a HINT."""

from __future__ import annotations


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


class RuntimeFailure(HpcjobsError):
    """Something outside hpcjobs refused: sbatch, scancel, the filesystem."""

    exit_code = 1
