"""Issue 28, FSDP the torchtitan way, on CPU ranks (gloo), written for 2 × 8 H100s: a task's parallelize(model,
shard) hook gets a sharding function carrying the mesh, bf16 mixed precision and --compile; per-block compile
wraps each block before it is sharded (activation checkpointing → compile → shard), one graph per block body with no
recompile limit hit, and the same weights as eager to bf16 rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError
from trainers import strategy
from trainers.dist import DistContext, release_groups
from trainers.distenv import DistEnv

BLOCKS = 10
"""More blocks than dynamo's recompile limit (8): one frame shared by every block would hit it."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = nn.Linear(16, 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def documented_hook(model: nn.Module, shard: Any) -> None:
    """A task's parallelize() as trainers/task.py documents it."""
    for block in model.blocks:  # type: ignore[union-attr]
        shard(block)


def old_hook(model: nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)


def _train(rank: int, store: str, out: str, hook: str, compile: bool, ac: bool) -> None:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = DistContext(DistEnv(rank, rank, 2, 2, "localhost", 0, "test", 0, "single"), torch.device("cpu"), "gloo")
    cfg = TrainConfig(strategy="fsdp", compile=compile, activation_checkpointing=ac)
    torch.manual_seed(0)
    model = strategy.build_model(Net, cfg, ctx)
    got: dict[str, Any] = {}
    try:
        made = strategy.make(model, ctx, cfg, "bf16", {"documented": documented_hook, "old": old_hook,
                                                      "none": None}[hook])
    except ConfigError as e:
        got["error"] = str(e)
    else:
        seen: list[torch.dtype] = []
        model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))  # type: ignore[index]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1 + rank)
        for _ in range(3):
            x = torch.randint(0, 11, (4, 8))
            loss = nn.functional.cross_entropy(made.net(x).flatten(0, 1), x.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        got["block_dtype"] = seen[0]
        got["loss_dtype"] = loss.dtype
        got["compiled"] = [type(b).__name__ for b in model.blocks]  # type: ignore[attr-defined]
        got["weights"] = {n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""): p.full_tensor()
                          for n, p in model.named_parameters()}  # type: ignore[attr-defined]
        got["counters"] = {k: dict(v) for k, v in counters.items()}
    torch.save(got, f"{out}-{rank}")
    release_groups()
    dist.destroy_process_group()


def spawn(tmp_path: Path, hook: str, compile: bool = False, ac: bool = False) -> dict[str, Any]:
    out = str(tmp_path / f"{hook}-{compile}-{ac}")
    mp.spawn(_train, args=(str(tmp_path / f"store-{hook}-{compile}-{ac}"), out, hook, compile, ac), nprocs=2)
    got: dict[str, Any] = torch.load(f"{out}-0")
    return got


@pytest.mark.train
def test_a_hook_written_as_documented_trains_in_bf16_and_an_old_one_is_told_how_in_one_line(tmp_path: Path) -> None:
    got = spawn(tmp_path, "documented")
    assert got.get("error") is None and got["block_dtype"] == torch.bfloat16 and got["loss_dtype"] == torch.float32
    assert all(torch.isfinite(w).all() for w in got["weights"].values())
    error = spawn(tmp_path, "old")["error"]
    assert "\n" not in error and "valid: parallelize(model, shard)" in error and "HINT: replace fully_shard" in error


@pytest.mark.train
def test_per_block_compile_of_the_hooks_units_makes_one_graph_per_block_and_matches_eager(tmp_path: Path) -> None:
    """Activation checkpointing → compile → shard with inductor's CPU backend: every block's body is one graph
    (no graph break at FSDP's hooks), no recompile limit is hit though there are more blocks than the limit, and
    the weights after 3 steps are eager's to bf16 rounding (compute in bf16, state in fp32)."""
    eager = spawn(tmp_path, "none", ac=True)
    compiled = spawn(tmp_path, "documented", compile=True, ac=True)  # the default units go through the same shard()
    stats = compiled["counters"]
    assert compiled["compiled"] == ["FSDPOptimizedModule"] * BLOCKS
    assert not stats.get("graph_break"), stats.get("graph_break")
    assert not stats.get("recompile_limit_hit") and not any("limit" in k for k in stats.get("frames", {}))
    # One graph for the blocks' shared body (they differ only in their parameters, inputs to it), measured: 10
    # blocks, 1 frame, 1 graph. The old in-place compile broke the graph at FSDP's hooks inside the frame.
    assert stats["stats"]["unique_graphs"] == 1 and stats["frames"]["total"] == 1, stats
    a, b = eager["weights"], compiled["weights"]
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=2e-2, atol=2e-3) for k in a), \
        max((a[k] - b[k]).abs().max().item() for k in a)


def _offloaded_optimizer(rank: int, store: str, out: str) -> None:
    """What --cpu-offload's ranks hold: sharded parameters (DTensors) in host memory; the default optimizer for them."""
    import torch.distributed as dist

    from trainers.trainer import default_optimizer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ctx = DistContext(DistEnv(rank, rank, 2, 2, "localhost", 0, "test", 0, "single"), torch.device("cpu"), "gloo")
    model = Net()
    strategy.make(model, ctx, TrainConfig(strategy="fsdp"), "fp32")
    calls = []
    fused_kernel = torch._fused_adamw_

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(args[0]))
        return fused_kernel(*args, **kwargs)

    torch._fused_adamw_ = counted
    optimizer = default_optimizer(model, 1e-2, TrainConfig(strategy="fsdp", cpu_offload=True))
    before = [p.full_tensor().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    model(torch.randint(0, 11, (2, 4))).sum().backward()
    optimizer.step()
    after = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    torch.save({"fused": optimizer.defaults["fused"], "calls": calls,
                "moved": all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))}, f"{out}-{rank}")
    release_groups()
    dist.destroy_process_group()


@pytest.mark.train
def test_the_optimizer_of_offloaded_parameters_is_adamws_fused_cpu_kernel(tmp_path: Path) -> None:
    """--cpu-offload (issue 28): torch's default for CPU tensors is a per-parameter Python loop; the default
    optimizer asks for the fused kernel, which updates the host-memory shards (CPU DTensors) group by group."""
    out = str(tmp_path / "offload")
    mp.spawn(_offloaded_optimizer, args=(str(tmp_path / "store"), out), nprocs=2)
    got = torch.load(f"{out}-0")
    assert got["fused"] is True and got["calls"] == [2 * BLOCKS + 2, 2 * BLOCKS + 1] and got["moved"], got
