"""How long each checkpoint save held the training loop: one line per save in RUN/saves.jsonl (rank 0), read by
`hpcjobs goodput` for its checkpoint bucket, the time a resumed step was first reached (rework), and the measured
save cost behind its checkpoint-interval advice. Torch-free."""

from __future__ import annotations

import time

from hpcjobs.protocol.runfolder import RunFolder, append_jsonl
from trainers.distenv import DistEnv


def record(run: RunFolder, env: DistEnv, step: int, began: float, background: bool) -> None:
    """Rank 0, once the save returned to the loop: a foreground save's whole write and commit (every rank waits at
    its barrier), a background one's staging of the buffers (plus the wait for the save before it, if still in
    flight). `time` is when the loop reached the save: when step `step` was done."""
    if env.rank == 0:
        append_jsonl(run.saves, {"job_id": env.job_id, "restart": env.restart, "step": step, "time": began,
                                 "blocking_s": round(time.time() - began, 4), "background": background})
