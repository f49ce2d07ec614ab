"""Each fault of a run, one line: how long it took to notice, where the next start resumed from (which checkpoint
tier), how long from the fault to the first step trained again, and what was trained in vain.

The buckets (hpcjobs.goodput.buckets) say how much of the wall time went to detection, recovery, start-up and rework
in all; a person who asks "what did that fault cost, and did the local tier help?" needs it per fault (issue 40: the
fault → first resumed step time and the steps redone, per fault kind, with the tier and without). Pure: the starts
come from hpcjobs.goodput.records.

A fault is a start that ended failed or without a word (killed), followed by a start that resumed. Its instant is
the hung rank's last progress when a watchdog recorded one (`fault_at`), else the start's last record: a killed
rank is noticed at once (the launcher or srun sees the process end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hpcjobs.goodput.buckets import Start
from hpcjobs.protocol.runfolder import FIRST_STEP

FAULTS = frozenset({"failed", "lost"})


@dataclass(frozen=True)
class Incident:
    job_id: str
    restart: int
    """The start that failed."""
    hang: bool
    """A watchdog found it hung (else: a rank or node died, or an error ended it)."""
    noticed_s: float
    """The fault → the start's end (its failure record): the time to notice it."""
    last_step: int | None
    """The newest step the failed start recorded."""
    resumed_step: int | None
    """Where the next start began (None: no start came after it)."""
    tier: str | None
    """Which checkpoint tier the next start resumed from (trainers.localtier's words), where it said."""
    to_first_step_s: float | None
    """The fault → the next start's first step done: what the fault cost in wall time before training went on."""
    redone_s: float | None
    """Training time in vain: from the commit of the checkpoint the next start resumed from to the fault."""

    def line(self) -> str:
        what = f"{self.job_id} start {self.restart}: {'hang' if self.hang else 'fault'}"
        at = f" after step {self.last_step}" if self.last_step is not None else ""
        noticed = f"noticed after {self.noticed_s:.1f} s" if self.noticed_s >= 0.05 else "noticed at once"
        if self.resumed_step is None:
            return f"{what}{at}, {noticed}; not resumed (yet)"
        tier = f" ({self.tier})" if self.tier else ""
        first = f", training again {self.to_first_step_s:.1f} s after the fault" \
            if self.to_first_step_s is not None else ""
        redone = f", {self.redone_s:.1f} s of training done again" if self.redone_s is not None else ""
        return f"{what}{at}, {noticed}; resumed from step {self.resumed_step}{tier}{first}{redone}"

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def incidents(starts: Sequence[tuple[str, Start]]) -> list[Incident]:
    """The faults among `starts` (in order, as hpcjobs.goodput.records.read_starts gives them)."""
    out = []
    for i, (job, start) in enumerate(starts):
        if start.ended not in FAULTS or start.end is None:
            continue
        fault = start.fault_at if start.fault_at is not None else start.end
        nxt = starts[i + 1][1] if i + 1 < len(starts) else None
        resumed = nxt.start_step if nxt is not None else None
        first = nxt.marks.get(FIRST_STEP) if nxt is not None else None
        commit = next((s.time + s.blocking_s for s in start.saves if s.step == resumed), None)
        again = resumed is not None and start.start_step is not None and resumed <= start.start_step
        trained_from = commit if commit is not None else start.marks.get(FIRST_STEP) if again else None
        out.append(Incident(job, start.restart, start.fault_at is not None, max(0.0, start.end - fault),
                            start.end_step, resumed, nxt.tier if nxt is not None else None,
                            max(0.0, first - fault) if first is not None else None,
                            max(0.0, fault - trained_from) if trained_from is not None else None))
    return out
