"""The node-local checkpoint tier's host memory per node (`--local-ckpt-every N`, issue 40; trainers/localtier.py),
before anything is queued: torch-free arithmetic the submit side checks against the node's memory.

What the tier holds: each rank keeps up to two steps of its own part of the training state (the newest step every rank
completed and the one being written) and two replicas of a peer's (on one node, its own replica beside its file), all
in node-local memory (/dev/shm, or HPCJOBS_LOCAL_CKPT_DIR): 4 copies a rank. A copy is what the Checkpointer saves:
the fp32 weights (the trainer keeps its parameters in fp32 under every precision: they are the master copy) and
AdamW's two fp32 moments, 12 bytes a parameter, 1/ranks of them under fsdp; the RNG streams and the position are a
few KB. /dev/shm is tmpfs: its pages are the node's memory and, under Slurm, are charged to the job's cgroup
(`--mem`/`--mem-per-gpu`), so a tier larger than the request ends the job by the OOM killer, not with a line.
An explicit interval that does not fit is refused; `auto` (the default) that does not fit leaves the tier off, said in
one line by `submit --dry-run` and by rank 0 (which checks its tier folder's free space at its first save).
"""

from __future__ import annotations

from dataclasses import dataclass

COPIES = 4
"""Files a rank keeps in the tier at most: two steps of its own state and two of a peer's replica."""
STATE_BYTES_PER_PARAM = 4 + 8
"""fp32 weights (the master copy) + AdamW's two fp32 moments."""


@dataclass(frozen=True)
class TierPlan:
    """The tier's host memory on one node: `ranks_per_node` ranks × COPIES × `state` bytes."""

    every: int | str
    """The interval, or "auto" (trainers.localtier_auto: measured; off where the copies do not fit)."""
    state: int
    """One rank's state in bytes (weights + AdamW moments; 1/ranks under fsdp)."""
    ranks_per_node: int

    @property
    def per_node(self) -> int:
        return self.ranks_per_node * COPIES * self.state

    def text(self) -> str:
        return (f"--local-ckpt-every {self.every}: {self.ranks_per_node} rank{'s' * (self.ranks_per_node != 1)} "
                f"× {COPIES} copies × {gib(self.state)} (weights + AdamW moments, fp32) = {gib(self.per_node)} "
                "of host memory a node")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def state_bytes(params: int, strategy: str, ranks: int) -> int:
    """One rank's part of the training state the tier copies (see the module's docstring)."""
    shard = ranks if strategy == "fsdp" else 1
    return STATE_BYTES_PER_PARAM * params // shard


def tier_plan(every: int | str, params: int, strategy: str, ranks: int, ranks_per_node: int) -> TierPlan | None:
    """The tier's plan, None when it is off (every 0)."""
    if every != "auto" and int(every) <= 0:
        return None
    return TierPlan(every, state_bytes(params, strategy, ranks), ranks_per_node)
