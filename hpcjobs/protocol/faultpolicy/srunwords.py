"""srun's words about the tasks of a step that ended badly (`srun: error: node2: task 3: Killed`): a rank killed by a
signal writes nothing itself, so these name it. Read by the submit side's status (hpcjobs/backends/slurm/slurm.py, from
the job's log files) and by the node side's recovery (trainers/recover.py, from its own output, where srun writes
them), so both name the same rank. Torch-free."""

from __future__ import annotations

import re

from hpcjobs.protocol.faultpolicy.diagnosis import Failure

SRUN_TASK = re.compile(r"^srun: error: (?P<host>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+)$", re.M)


def task_ids(spec: str) -> list[int]:
    """srun's task list: `3`, `0-1`, `0,2-3`."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def srun_failures(text: str) -> list[Failure]:
    """srun's lines about tasks that ended badly, in the order srun saw them. A task's number is its global rank
    (one srun task per rank)."""
    return [Failure(rank, m["host"], m["what"].strip(), "srun") for m in SRUN_TASK.finditer(text)
            for rank in task_ids(m["tasks"])]
