"""`hpcjobs doctor`: the exact request checked against the cluster before it queues. Scheduler-neutral: a check is
a row (what was checked, pass/fail/skip, what was found, the fix); each backend says which checks it makes
(`Backend.doctor`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class Result(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    """Not checked, and why (no accounting to ask, nothing to check on this scheduler)."""

    def __str__(self) -> str:
        return self.value


MARKS = {Result.PASS: "✓", Result.FAIL: "✗", Result.SKIP: "–"}


@dataclass(frozen=True)
class Check:
    name: str
    result: Result
    found: str
    fix: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "result": str(self.result)}


def table(checks: list[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{MARKS[c.result]} {c.name:<{width}}  {c.found}")
        if c.fix and c.result == Result.FAIL:
            lines.append(f"  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def exit_code(checks: list[Check]) -> int:
    """0 only when nothing failed (1 otherwise; 2 stays a bad input's)."""
    return 1 if any(c.result == Result.FAIL for c in checks) else 0
