"""How the model is spread over the ranks: `ddp` (every rank holds all of it; gradients all-reduced) or `fsdp`
(FSDP2's `fully_shard`: each rank holds 1/world of the parameters, gradients and optimizer state; the blocks'
parameters are gathered just before they run). One class per strategy, same four methods: the loop never asks which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from trainers.config import ConfigError, TrainConfig
from trainers.dist import DistContext

ShardHook = Callable[[nn.Module, Any], None]
"""A task's own sharding: parallelize(model, mesh) calls fully_shard on the modules it wants as units (the root is
sharded by the trainer afterwards)."""


class Strategy(Protocol):
    name: str
    net: nn.Module
    """What the loop calls: the model as wrapped (DDP) or sharded in place (FSDP2), compiled if asked."""
    mixed_precision: bool
    """True when the strategy itself casts (FSDP2's MixedPrecisionPolicy): the loop then runs without autocast."""

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Around one micro-batch's forward and backward: gradients are reduced on the last one only."""

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over all ranks' shards) to max_norm; returns the norm before clipping."""


def units(model: nn.Module) -> list[nn.Module]:
    """The modules to checkpoint activations of and to shard one by one: the entries of the ModuleList (or
    Sequential) that holds the most parameters, e.g. a transformer's blocks; the top-level children otherwise."""
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=model)
    return [c for c in biggest.children() if any(True for _ in c.parameters())]


def checkpoint_activations(model: nn.Module) -> int:
    """Wrap each unit (see `units`) so its activations are recomputed in the backward instead of kept; returns how
    many. Non-reentrant checkpointing replays the RNG state, so dropout masks are the same in the recomputation."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    targets = {id(u) for u in units(model)}
    wrapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                parent.register_module(name, checkpoint_wrapper(child, preserve_rng_state=True))
                wrapped += 1
    return wrapped


class Ddp:
    name, mixed_precision = "ddp", False

    def __init__(self, model: nn.Module, ctx: DistContext, cfg: TrainConfig) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = model
        device = ctx.device
        # Gradients as views into DDP's buckets: no copy into the buckets and no second copy of the gradients.
        self.ddp = (DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        gradient_as_bucket_view=True) if ctx.world_size > 1 else None)
        net: nn.Module = self.ddp or model
        self.net: nn.Module = cast(nn.Module, torch.compile(net)) if cfg.compile else net

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()

    def clip(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


class Fsdp:
    name = "fsdp"

    def __init__(self, model: nn.Module, ctx: DistContext, cfg: TrainConfig, precision: str,
                 hook: ShardHook | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.model = model
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        # Parameters cast to bf16/fp16 for the forward and backward; gradients reduced and kept in fp32.
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        self.mixed_precision = low is not None
        offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
        if hook is not None:
            hook(model, mesh)
        else:
            for unit in units(model):
                if cfg.compile:
                    unit.compile()
                fully_shard(unit, mesh=mesh, mp_policy=policy, offload_policy=offload)
        # The root's outputs in fp32, as autocast leaves a loss: the loss and its softmax never run in bf16/fp16.
        root = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32)
        fully_shard(model, mesh=mesh, mp_policy=root, offload_policy=offload)
        self.net = model

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return _gradient_sync(self.model, last)

    def clip(self, max_norm: float) -> torch.Tensor:
        # The parameters are DTensors: the norm is computed over every rank's shard, then the same scale applies.
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@contextlib.contextmanager
def _gradient_sync(model: nn.Module, last: bool) -> Iterator[None]:
    """Reduce-scatter only on the last micro-batch; the others accumulate unsharded gradients locally."""
    model.set_requires_gradient_sync(last)  # type: ignore[operator]
    yield


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot work on this rank (None: it can): its default backend, inductor, builds C++ kernels
    for the CPU with the compiler $CXX names (g++ by default) and Triton kernels for GPUs."""
    import importlib.util
    import os
    import shutil

    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "the triton package is not installed"
    cxx = os.environ.get("CXX") or "g++"
    return None if shutil.which(cxx) else f"no C++ compiler {cxx!r} on PATH (inductor builds CPU kernels with it)"


def make(model: nn.Module, ctx: DistContext, cfg: TrainConfig, precision: str,
         hook: ShardHook | None = None) -> Strategy:
    """The model wrapped by cfg.strategy (after activation checkpointing, if asked). Raises ConfigError for a
    combination this machine or this torch cannot run."""
    if cfg.cpu_offload and cfg.strategy != "fsdp":
        raise ConfigError("--cpu-offload with --strategy ddp; valid: --cpu-offload with --strategy fsdp. HINT: FSDP2 "
                          "offloads the sharded parameters and optimizer state, DDP has nothing to offload")
    if cfg.cpu_offload and ctx.device.type != "cuda":
        raise ConfigError("--cpu-offload on a rank without a GPU; valid: --cpu-offload on GPU ranks. HINT: on the "
                          "CPU everything is already in host memory: drop --cpu-offload")
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    if cfg.strategy == "ddp":
        return Ddp(model, ctx, cfg)
    if not dist.is_initialized():
        raise ConfigError("--strategy fsdp without a process group. HINT: start the rank through hpcjobs or torchrun")
    return Fsdp(model, ctx, cfg, precision, hook)
