"""How long each checkpoint save held the training loop: one line per save in RUN/saves.jsonl (rank 0), read by
`hpcjobs goodput` for its checkpoint bucket, the time a resumed step was first reached (rework), and the measured
save cost behind its checkpoint-interval advice. Torch-free."""

from __future__ import annotations

import math
import time

from hpcjobs.protocol.runfolder import RunFolder, append_jsonl
from trainers.distenv import DistEnv

WAIT_ADVICE_S = 1.0
"""A background save that waited longer than this for the one before it says so, once a start."""


def record(run: RunFolder, env: DistEnv, step: int, began: float, background: bool, waited_s: float = 0.0) -> None:
    """Rank 0, once the save returned to the loop: a foreground save's whole write and commit (every rank waits at
    its barrier), a background one's staging of the buffers (plus the wait for the save before it, if still in
    flight: `waited_s`, part of `blocking_s`). `time` is when the loop reached the save: when step `step` was
    done."""
    if env.rank == 0:
        line = {"job_id": env.job_id, "restart": env.restart, "step": step, "time": began,
                "blocking_s": round(time.time() - began, 4), "background": background}
        append_jsonl(run.saves, {**line, "waited_s": round(waited_s, 4)} if waited_s else line)


def wait_advice(step: int, before: int, gap_s: float, waited_s: float) -> str:
    """The line for a background save of step `step` that waited `waited_s` for step `before`'s, begun `gap_s`
    earlier, to be written: saves come faster than one is written, and the loop stops for the difference each
    time (seen on an H200: 1b state, 14.6 GB, ~13 s to write; saves every 20 steps of 0.28 s: 9.6 s a save)."""
    write_s = gap_s + waited_s
    every = step - before
    enough = math.ceil(2 * write_s * every / gap_s) if gap_s > 0 else 2 * every
    return (f"hpcjobs: checkpoint step-{step} waited {waited_s:.1f} s for step-{before} to be written (~{write_s:.1f} "
            f"s a save here, saves every {every} steps, ~{gap_s:.1f} s): training stops for the difference at every "
            f"save. HINT: --ckpt-every {enough} or more (twice a save's write), or a faster checkpoint folder")
