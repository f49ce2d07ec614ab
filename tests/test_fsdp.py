"""--strategy fsdp's options on CPU (gloo): activation checkpointing changes memory, not results; --compile falls back
to eager with one line where the compiler is missing; options a rank cannot honour are refused in one line; only
rank 0 builds the model (the others on the meta device), with the same weights as when every rank builds it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from conftest import REPO, hpcjobs
from trainers import checkpoint, strategy
from trainers.checkpointer import model_weights
from trainers.config import TrainConfig
from trainers.dist import DistContext, release_groups
from trainers.distenv import DistEnv

ARGS = ["trainers.tasks.lm", "--size", "tiny", "--dropout", "0.1", "--steps", "6", "--log-every", "2",
        "--ckpt-every", "3", "--batch-size", "4", "--grad-accum", "2", "--seed", "5"]


def train(run: Path, *extra: str, env: dict[str, str] | None = None) -> str:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), *ARGS, "--strategy", "fsdp",
                  *extra, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return (run / "logs" / "restart-0" / "rank-0.log").read_text()


def weights(run: Path) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None and ref.step == 6
    return model_weights(ref)


def test_activation_checkpointing_gives_the_same_weights_and_compile_falls_back(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    train(plain)
    log = train(tmp_path / "ac", "--activation-checkpointing", "--compile", env={"CXX": "/nonexistent/g++"})
    assert "2 rank(s), fsdp," in log and "activation checkpointing" in log
    assert "--compile: no C++ compiler '/nonexistent/g++' on PATH" in log and "running eager" in log
    a, b = weights(plain), weights(tmp_path / "ac")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # recomputed, dropout masks replayed


def test_cpu_offload_on_a_cpu_rank_is_refused_in_one_line(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(tmp_path / "run"), *ARGS,
                  "--strategy", "fsdp", "--cpu-offload", cwd=REPO, timeout=300)
    assert out.returncode == 2
    log = (tmp_path / "run" / "logs" / "restart-0" / "rank-0.log").read_text()
    said = [line for line in log.splitlines() if line.startswith("hpcjobs: --cpu-offload")]
    assert len(said) == 1 and "valid: --cpu-offload on GPU ranks" in said[0] and "HINT:" in said[0], log


def test_the_default_units_are_the_blocks_and_activation_checkpointing_wraps_each_once() -> None:
    from trainers.tasks.lm import make_task

    model = make_task(["--size", "small"]).model()
    assert [id(u) for u in strategy.units(model)] == [id(b) for b in model.blocks]  # type: ignore[union-attr]
    assert strategy.checkpoint_activations(model) == len(model.blocks)  # type: ignore[arg-type]
    flat = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    assert strategy.units(flat) == [flat[0], flat[2]]  # its own entries that hold parameters


class Masked(nn.Module):
    """Two blocks of 5 rows (uneven shards over 2 ranks) and buffers, one of them non-persistent (no state dict holds
    it, rank 0 must send it anyway) and bool (gloo has no bool)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 5) for _ in range(2))
        self.register_buffer("mask", torch.rand(7) > 0.5, persistent=False)
        self.register_buffer("scale", torch.randn(5))
        self.built_on = torch.empty(0).device.type  # the default device model() ran under


def _shard_masked(rank: int, store: str, out: str, meta_init: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = DistContext(DistEnv(rank, rank, 2, 2, "localhost", 0, "test", 0, "single"), torch.device("cpu"), "gloo")
    cfg = TrainConfig(strategy="fsdp", meta_init=meta_init)
    torch.manual_seed(3 + rank)  # each rank draws other weights: only rank 0's may survive
    model = strategy.build_model(Masked, cfg, ctx)
    built_on = model.built_on
    strategy.make(model, ctx, cfg, "fp32")
    params = {n: p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[operator]
    torch.save({"built_on": built_on, "params": params, "buffers": dict(model.named_buffers())}, f"{out}-{rank}")
    del model, params
    release_groups()
    dist.destroy_process_group()


@pytest.mark.parametrize("meta_init", [True, False])
def test_only_rank_0_builds_the_model_and_every_rank_gets_its_weights_and_buffers(tmp_path: Path,
                                                                                   meta_init: bool) -> None:
    out = str(tmp_path / "model")
    mp.spawn(_shard_masked, args=(str(tmp_path / "store"), out, meta_init), nprocs=2)
    torch.manual_seed(3)
    reference = Masked()
    got = [torch.load(f"{out}-{rank}") for rank in (0, 1)]
    assert [g["built_on"] for g in got] == ["cpu", "meta" if meta_init else "cpu"]
    same = [all(torch.equal(g["params"][n], p) for n, p in reference.named_parameters()) for g in got]
    assert same == ([True, True] if meta_init else [False, False])  # --no-meta-init: rank 1's own draws in its shards
    if meta_init:
        for g in got:
            assert all(torch.equal(g["buffers"][n], b) for n, b in reference.named_buffers())


def test_the_model_built_on_rank_0_only_trains_to_the_same_weights(tmp_path: Path) -> None:
    log = train(tmp_path / "meta")
    assert "model built on rank 0" in log
    assert "model built on rank 0" not in train(tmp_path / "every", "--no-meta-init")
    a, b = weights(tmp_path / "meta"), weights(tmp_path / "every")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
