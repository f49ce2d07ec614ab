"""--strategy fsdp's options on CPU (gloo): activation checkpointing changes memory, not results; --compile falls back
to eager with one line where the compiler is missing; options a rank cannot honour are refused in one line; only
rank 0 builds the model (the others on the meta device), with the same weights as when every rank builds it, what it
shares still shared, and ranks whose models differ refusing together."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from conftest import REPO, hpcjobs, newest_log
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError
from trainers import checkpoint, strategy
from trainers.checkpoint.dcp_files import model_weights
from trainers.dist import DistContext, release_groups
from trainers.distenv import DistEnv

ARGS = ["trainers.tasks.lm", "--size", "tiny", "--dropout", "0.1", "--steps", "6", "--log-every", "2",
        "--ckpt-every", "3", "--batch-size", "4", "--grad-accum", "2", "--seed", "5"]


def train(run: Path, *extra: str, env: dict[str, str] | None = None) -> str:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), *ARGS, "--strategy", "fsdp",
                  *extra, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return newest_log(run)


def weights(run: Path) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None and ref.step == 6
    return model_weights(ref)


@pytest.mark.train
def test_activation_checkpointing_gives_the_same_weights_and_compile_falls_back(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    train(plain)
    log = train(tmp_path / "ac", "--activation-checkpointing", "--compile", env={"CXX": "/nonexistent/g++"})
    assert "2 rank(s), fsdp," in log and "activation checkpointing" in log
    assert "--compile: no C++ compiler '/nonexistent/g++' on PATH" in log and "running eager" in log
    a, b = weights(plain), weights(tmp_path / "ac")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # recomputed, dropout masks replayed


@pytest.mark.train
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


class Shared(nn.Module):
    """What the ranks' models alias must survive the meta device: a table every block shares (as a RoPE cache) and
    an output layer tied to the embedding. `wrapping_hook` renames every block parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        table = torch.randn(4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        for block in self.blocks:
            block.register_buffer("table", table)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.embed.weight
        self.built_on = torch.empty(0).device.type


class Uneven(nn.Module):
    """A model() that builds other shapes on other ranks."""

    def __init__(self) -> None:
        import torch.distributed as dist

        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4 + dist.get_rank()) for _ in range(2))


def wrapping_hook(model: nn.Module, shard: Any) -> None:
    """A task's parallelize(): checkpoint-wraps each block (its parameters' names change), then shards it."""
    assert strategy.checkpoint_activations(model) == 3
    for block in model.blocks:  # type: ignore[union-attr]
        shard(block)


def _plain(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def _shard(rank: int, store: str, out: str, meta_init: bool, which: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = DistContext(DistEnv(rank, rank, 2, 2, "localhost", 0, "test", 0, "single"), torch.device("cpu"), "gloo")
    cfg = TrainConfig(strategy="fsdp", meta_init=meta_init)
    torch.manual_seed(3 + rank)  # each rank draws other weights: only rank 0's may survive
    factory = {"masked": Masked, "shared": Shared, "uneven": Uneven}[which]
    import torch.distributed.tensor._collective_utils as collectives

    def point_to_point(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("rank 0 scattered point-to-point: on NCCL, a connection to every rank")

    collectives.scatter = point_to_point  # type: ignore[assignment]
    model = strategy.build_model(factory, cfg, ctx)
    got: dict[str, object] = {"built_on": getattr(model, "built_on", None)}
    try:
        strategy.make(model, ctx, cfg, "fp32", wrapping_hook if which == "shared" else None)
    except ConfigError as e:
        got["error"] = str(e)
    else:
        got["params"] = {_plain(n): p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
        got["buffers"] = {_plain(n): b for n, b in model.named_buffers(remove_duplicate=False)}
        got["aliases"] = len({id(b) for b in model.buffers()}), len({id(p) for p in model.parameters()})
    torch.save(got, f"{out}-{rank}")
    del model
    release_groups()
    dist.destroy_process_group()
    # The result is on disk; the worker's interpreter shutdown is not under test, and a gloo thread that outlives it
    # can abort the process (SIGABRT, "terminate called without an active exception": a CI run of the refusing case)
    os._exit(0)


def _spawn(tmp_path: Path, meta_init: bool, which: str) -> list[dict[str, object]]:
    out = str(tmp_path / "model")
    mp.spawn(_shard, args=(str(tmp_path / "store"), out, meta_init, which), nprocs=2)
    return [torch.load(f"{out}-{rank}") for rank in (0, 1)]


def _same(got: dict[str, object], reference: nn.Module) -> bool:
    mine = cast(dict[str, torch.Tensor], got["params"])
    return all(torch.equal(mine[n], p) for n, p in reference.named_parameters())


@pytest.mark.train
@pytest.mark.parametrize("meta_init", [True, False])
def test_only_rank_0_builds_the_model_and_every_rank_gets_its_weights_and_buffers(tmp_path: Path,
                                                                                   meta_init: bool) -> None:
    got = _spawn(tmp_path, meta_init, "masked")
    torch.manual_seed(3)
    reference = Masked()
    assert [g["built_on"] for g in got] == ["cpu", "meta" if meta_init else "cpu"]
    # --no-meta-init: rank 1's own draws in its shards
    assert [_same(g, reference) for g in got] == ([True, True] if meta_init else [False, False])
    if meta_init:
        for g in got:
            mine = cast(dict[str, torch.Tensor], g["buffers"])
            assert all(torch.equal(mine[n], b) for n, b in reference.named_buffers())


@pytest.mark.train
def test_a_shared_buffer_a_tied_weight_and_a_hook_that_renames_arrive_as_rank_0_built_them(tmp_path: Path) -> None:
    got = _spawn(tmp_path, True, "shared")
    torch.manual_seed(3)
    reference = Shared()
    assert [g["built_on"] for g in got] == ["cpu", "meta"]
    for g in got:
        assert _same(g, reference)
        tables = cast(dict[str, torch.Tensor], g["buffers"])
        assert sorted(tables) == [f"blocks.{i}.table" for i in range(3)]
        assert all(torch.equal(t, cast(torch.Tensor, reference.blocks[0].table)) for t in tables.values())
        assert g["aliases"] == (1, 1 + 3 * 2)  # one table; the tied weight once, each block's weight and bias


@pytest.mark.train
def test_ranks_whose_models_differ_all_refuse_in_one_line_instead_of_hanging(tmp_path: Path) -> None:
    got = _spawn(tmp_path, True, "uneven")
    errors = [cast(str, g.get("error")) for g in got]
    assert all(e and e.startswith("--meta-init: rank 1's parameters differ from rank 0's") for e in errors), errors
    assert all("\n" not in e and "HINT: --no-meta-init" in e for e in errors)


@pytest.mark.train
def test_the_model_built_on_rank_0_only_trains_to_the_same_weights(tmp_path: Path) -> None:
    log = train(tmp_path / "meta")
    assert "model built on rank 0" in log
    assert "model built on rank 0" not in train(tmp_path / "every", "--no-meta-init")
    a, b = weights(tmp_path / "meta"), weights(tmp_path / "every")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.train
def test_reducing_each_micro_batch_trains_the_same_model_up_to_rounding(tmp_path: Path) -> None:
    """Reducing after each micro-batch (the default since issue 28: each rank keeps only its shard of the gradients
    between micro-batches) sums the same gradients in another order than --no-reduce-each-micro-batch: the same
    model to rounding, and not bit for bit, which shows the default took effect."""
    train(tmp_path / "once", "--no-reduce-each-micro-batch")
    train(tmp_path / "each")
    a, b = weights(tmp_path / "once"), weights(tmp_path / "each")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)
    assert any(not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.train
def test_the_gradient_norm_is_in_the_metrics_at_each_log_step(tmp_path: Path) -> None:
    """Issue 28: the norm before clipping, reduced over the shards at log steps only; with --grad-clip 0 it is
    computed at those steps alone (nothing else needs it)."""
    import json
    import math

    for name, extra in (("clipped", ()), ("unclipped", ("--grad-clip", "0"))):
        train(tmp_path / name, *extra)
        recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        norms = {r["step"]: r.get("grad_norm") for r in recs if "loss" in r}
        assert list(norms) == [2, 4, 6] and all(n is not None and math.isfinite(n) and n > 0 for n in norms.values()), \
            (name, norms)
