"""The one knob of the stop checks' spacing that a job's environment carries, and what it may hold.

`HPCJOBS_STOP_CHECK_EVERY` spaces the ranks' stop checks in a user's script (trainers/integrations/checks.py); the
submit side refuses a bad value before anything is queued, and the node side again on every rank, where a rendered
script or plain torchrun may have set it. Torch-free and import-free: trainers.integrations reads it at every start.
"""

from __future__ import annotations

CHECK_EVERY = "HPCJOBS_STOP_CHECK_EVERY"
"""Step ends between the ranks' stop checks (the trainer's --stop-check-every); unset or 0: about once a second of
training, from the measured step time (trainers/integrations/checks.py)."""


def parse(raw: str | None) -> int | None:
    """The value as a number of step ends (0 when unset or empty); None when it is not a whole number."""
    text = (raw or "").strip() or "0"
    return int(text) if text.isascii() and text.isdigit() else None


def refusal(raw: str) -> tuple[str, str]:
    """The one line's message and hint for a value `parse` refused."""
    return (f"{CHECK_EVERY}={raw.strip()!r}: valid: a whole number of step ends between stop checks, 0 (the default) "
            f"for about once a second.", f"e.g. --env {CHECK_EVERY}=0, or leave it unset")
