"""`save_checkpoint`: one call that saves a users' own script's state through the folder protocol (shared.pt from
rank 0, rank-R.pt from each rank); `load_checkpoint` and `latest` read it back (trainers/examples/own_script.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainers.checkpoint.files import write_files
from trainers.checkpoint.folder import begin, commit
from trainers.faults import maybe_die


def save_checkpoint(root: Path, step: int, shared: dict[str, Any] | None, per_rank: dict[str, Any], *,
                    rank: int = 0, world_size: int = 1, barrier: Callable[[], None] = lambda: None,
                    keep: int = 2, meta: dict[str, Any] | None = None) -> Path:
    """Save atomically; call on every rank with the same step. `shared` is only read on rank 0."""
    tmp = begin(root, step, rank, barrier, keep)
    write_files(root, tmp, step, rank, shared, per_rank)
    maybe_die("save-written", step)
    barrier()
    if rank == 0:
        commit(root, tmp, step, {"world_size": world_size, **(meta or {})}, keep)
    barrier()
    return root / f"step-{step}"
