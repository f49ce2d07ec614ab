"""GPU-only paths shown on the CPU (issue 11): what a GPU node would hit, simulated where this machine can."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from trainers.dist import RendezvousError, rank_gpu
from trainers.distenv import DistEnv


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


def test_each_rank_gets_a_gpu_of_its_own_or_a_clear_error() -> None:
    """The device was local_rank % visible GPUs: with 1 < visible < ranks per node two ranks shared one."""
    def env(local: int, per_node: int = 8) -> DistEnv:
        return DistEnv(rank=8 + local, local_rank=local, world_size=16, local_world_size=per_node,
                       master_addr="n1", master_port=1, job_id="1", restart=0, source="slurm")

    assert [rank_gpu(env(r), 8) for r in range(8)] == list(range(8))  # every rank sees every GPU
    assert [rank_gpu(env(r), 1) for r in range(8)] == [0] * 8  # one GPU per task (--gpus-per-task)
    with pytest.raises(RendezvousError, match="sees 4 GPUs: valid: 1 per rank, or at least 8"):
        rank_gpu(env(5), 4)
