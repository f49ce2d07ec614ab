"""GPU-only paths shown on the CPU (issue 11): what a GPU node would hit, simulated where this machine can."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch.multiprocessing as mp


def _guard_on_a_group_without_cpu_backend(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from hpcjobs.contract import LaunchContract
    from trainers import preemption

    # "cuda:gloo" registers a backend for CUDA tensors only, as NCCL does: the default group has no CPU backend.
    dist.init_process_group("cuda:gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    guard = preemption.StopGuard(contract=LaunchContract(run_dir=""))
    answers = [guard.should_stop()]
    if rank == 1:
        preemption.request_stop(signal.SIGTERM)
    answers.append(guard.should_stop())
    Path(f"{out}-{rank}").write_text(repr(answers))
    dist.destroy_process_group()


def test_stop_guard_works_when_the_default_group_has_no_cpu_backend(tmp_path: Path) -> None:
    """StopGuard all-reduced a CPU tensor on the default group: under init_process_group("nccl") (the README's
    own-script example on GPUs) the first should_stop() raised."""
    out = str(tmp_path / "answers")
    mp.spawn(_guard_on_a_group_without_cpu_backend, args=(str(tmp_path / "store"), out), nprocs=2)
    assert [Path(f"{out}-{r}").read_text() for r in (0, 1)] == ["[False, True]", "[False, True]"]
    assert not os.path.exists(tmp_path / "run")
