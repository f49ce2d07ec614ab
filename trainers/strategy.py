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

from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError
from trainers import fp8
from trainers.dist import DistContext
from trainers.mesh import device_mesh
from trainers.sharding import Sharding

ShardHook = Callable[[nn.Module, Sharding], None]
"""A task's own sharding: parallelize(model, shard) calls shard(module) on the modules it wants as units
(trainers.sharding: the mesh, mixed precision, offload and --compile come with it); the trainer shards the root
afterwards."""


class Strategy(Protocol):
    name: str
    net: nn.Module
    """What the loop calls: the model as wrapped (DDP) or sharded in place (FSDP2), compiled if asked."""
    mixed_precision: bool
    """True when the strategy itself casts (FSDP2's MixedPrecisionPolicy): the loop then runs without autocast."""

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Around one micro-batch's forward and backward: gradients are reduced on the last one only."""

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm (over all ranks' shards) to max_norm; returns the norm before clipping, as
        computed (under fsdp a DTensor: its full_tensor() is the number)."""


def units(model: nn.Module) -> list[nn.Module]:
    """The modules to checkpoint activations of and to shard one by one: the entries of the ModuleList (or
    Sequential) that holds the most parameters, e.g. a transformer's blocks; the top-level children otherwise."""
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=model)
    return [c for c in biggest.children() if any(True for _ in c.parameters())]


def checkpoint_activations(model: nn.Module, mode: str = "full", every: int = 1) -> int:
    """Wrap every `every`-th unit (see `units`; the 1st, (every+1)-th, ...) so its activations are recomputed in the
    backward instead of kept, whole (mode full) or all but the matmuls' and attention's outputs (selective,
    trainers.activations); returns how many. Non-reentrant checkpointing replays the RNG state, so dropout masks
    are the same in the recomputation."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from trainers.activations import checkpoint_kwargs

    no_kv_cache(model)
    targets = {id(u) for i, u in enumerate(units(model)) if i % every == 0}
    wrapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                parent.register_module(name, checkpoint_wrapper(child, preserve_rng_state=True,
                                                                **checkpoint_kwargs(mode)))
                wrapped += 1
    return wrapped


def no_kv_cache(model: nn.Module) -> None:
    """A Hugging Face model (or one inside the task's model) trained with its config's `use_cache` on keeps a KV
    cache its blocks write during the forward: under selective activation checkpointing the recomputation in the
    backward then meets other ops than the forward saved (llama and gpt2 at 2 layers: "aten.slice.Tensor ...
    encountered during backward but not found in storage"). Training never reads the cache: turned off first, as
    HF's models do under their own gradient checkpointing."""
    for module in model.modules():
        config: Any = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False


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
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.model = model
        self.reduce_each = cfg.reduce_each_micro_batch
        mesh = device_mesh(ctx, cfg)
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        # Parameters cast to bf16/fp16 for the forward and backward; gradients reduced and kept in fp32.
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        self.mixed_precision = low is not None
        offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
        spread = from_rank0(cfg, ctx.world_size)
        # Rank 0's full tensors, kept alive while its shards are cut from them: the source of the other ranks'.
        # Keyed by the module that holds each, not by its name, which a task's hook may change (a wrapper).
        full = ({(id(m), n): p.detach() for _, m, n, p in _registrations(model, "parameters")}
                if spread and ctx.rank == 0 else None)
        # Every unit, the task hook's too, through one sharding function: compiled (if asked) before it is sharded.
        self.sharding = Sharding(model, {"mesh": mesh, "mp_policy": policy, "offload_policy": offload,
                                         "reshard_after_forward": cfg.reshard_after_forward}, cfg.compile)
        if hook is not None:
            hook(model, self.sharding)
        else:
            for unit in units(model):
                self.sharding(unit)
        # The root's outputs in fp32, as autocast leaves a loss: the loss and its softmax never run in bf16/fp16.
        root = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32)
        fully_shard(model, mesh=mesh, mp_policy=root, offload_policy=offload)
        if spread:
            _from_rank0(model, full, ctx, cfg.cpu_offload)
        self.net = model

    def accumulate(self, last: bool) -> contextlib.AbstractContextManager[None]:
        return _gradient_sync(self.model, last or self.reduce_each)

    def clip(self, max_norm: float) -> torch.Tensor:
        # The parameters are DTensors: the norm is computed over every rank's shard, then the same scale applies.
        # Returned as computed (a DTensor): reducing it to a number costs an all-reduce, which the Meter does only
        # at log steps (it had been one more all-reduce every step).
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


def layout_words(cfg: TrainConfig, world: int) -> str:
    """The start line's words for how fsdp lays the model out ("" for the defaults)."""
    words = ["model built on rank 0" * from_rank0(cfg, world)]
    if cfg.strategy == "fsdp" and cfg.replicate_degree > 1:
        words.append(f"hybrid sharding: {cfg.replicate_degree} replicas × {world // cfg.replicate_degree} shards")
    if cfg.strategy == "fsdp" and not cfg.reshard_after_forward:
        words.append("gathered blocks kept from forward to backward")
    return ", ".join(w for w in words if w)


def from_rank0(cfg: TrainConfig, world_size: int) -> bool:
    """Whether only rank 0 builds the model and gives the others their shards (--meta-init under fsdp, more than one
    rank); the others build it on the meta device (`build_model`)."""
    return cfg.strategy == "fsdp" and cfg.meta_init and world_size > 1


def builds_on_meta(cfg: TrainConfig, ctx: DistContext) -> bool:
    return from_rank0(cfg, ctx.world_size) and ctx.rank != 0


def build_model(factory: Callable[[], nn.Module], cfg: TrainConfig, ctx: DistContext) -> nn.Module:
    """The task's model, on the meta device where `builds_on_meta` (its factory calls allocate nothing there)."""
    with torch.device("meta") if builds_on_meta(cfg, ctx) else contextlib.nullcontext():
        return factory()


Registration = tuple[str, nn.Module, str, torch.Tensor]
"""A parameter or buffer as one module holds it: (qualified name, module, its name there, the tensor). A tensor that
several modules share (a tied weight, a table every block uses) is one registration per module."""


def _registrations(model: nn.Module, kind: str) -> list[Registration]:
    """Every registration of the model's "parameters" or "buffers", in the model's order, shared ones included: the
    same list on every rank whatever each rank's tensors alias, so the collectives over it pair up."""
    return [(f"{prefix}.{name}".lstrip("."), module, name, t) for prefix, module in model.named_modules()
            for name, t in getattr(module, f"named_{kind}")(recurse=False)]


def _signature(states: list[Registration]) -> list[tuple[str, tuple[int, ...], str, int]]:
    """What must agree across ranks before rank 0 sends anything: names, shapes, dtypes, and which registrations
    share a tensor (the index of the first one holding it)."""
    first: dict[int, int] = {}
    return [(q, tuple(t.shape), str(t.dtype), first.setdefault(id(t), i)) for i, (q, _, _, t) in enumerate(states)]


def _check_same_model(params: list[Registration], buffers: list[Registration],
                      full: dict[tuple[int, str], torch.Tensor] | None, group: Any) -> None:
    """Raise ConfigError on every rank (never a hang on some) when the ranks' models differ or rank 0 lost track of
    a parameter (a hook that replaced a module). One small CPU collective on `group`."""
    mine = (_signature(params), _signature(buffers),
            [q for q, m, n, _ in params if full is not None and (id(m), n) not in full])
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    rank0 = every[0]
    differ = [(r, what) for r, theirs in enumerate(every) for what, a, b in
              (("parameters", theirs[0], rank0[0]), ("buffers", theirs[1], rank0[1])) if a != b]
    if differ or rank0[2]:
        found = (f"rank {differ[0][0]}'s {differ[0][1]} differ from rank 0's" if differ else
                 f"rank 0 no longer holds {rank0[2][0]!r} after the sharding hook replaced its module")
        raise ConfigError(f"--meta-init: {found}; valid: every rank's model() builds the same modules, and a "
                          "parallelize() hook that wraps modules rather than replacing them. HINT: --no-meta-init "
                          "builds the model on every rank")


def _materialise(model: nn.Module, device: torch.device, offload: bool) -> None:
    """Storage for a model built on the meta device and sharded: parameters where FSDP2 keeps them, buffers where it
    put rank 0's (with the compute), a buffer several modules share still one tensor (to_empty makes one per module)."""
    shared = [(m, n, id(b)) for _, m, n, b in _registrations(model, "buffers")]
    model.to_empty(device="cpu" if offload else device)  # offloaded shards live in host memory
    made: dict[int, torch.Tensor] = {}
    for module, name, was in shared:
        setattr(module, name, made.setdefault(was, getattr(module, name).to(device)))


def _from_rank0(model: nn.Module, full: dict[tuple[int, str], torch.Tensor] | None, ctx: DistContext,
                offload: bool) -> None:
    """After sharding: the ranks that built on the meta device (`full` None) get storage, then every rank takes its
    shard of each parameter and each buffer (the non-persistent ones too, which no state dict holds) from rank 0's
    `full`, one tensor at a time, so no rank holds more than one whole parameter beyond its shards."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    device = ctx.device
    if full is None:
        _materialise(model, device, offload)
    params, buffers = _registrations(model, "parameters"), _registrations(model, "buffers")
    _check_same_model(params, buffers, full, ctx.control_group)
    done: set[int] = set()
    with torch.no_grad():
        for _, module, name, param in params:
            if id(param) in done:  # a tied weight: sent with its first holder (the signatures agree on which)
                continue
            done.add(id(param))
            whole = (full.pop((id(module), name)).to(device) if full is not None
                     else torch.empty(param.shape, dtype=param.dtype, device=device))
            # A broadcast (a ring or tree on NCCL), then each rank cuts its own shard: distribute_tensor's own
            # scatter from rank 0 is point-to-point, which on NCCL opens a connection from rank 0 to every rank.
            dist.broadcast(whole, src=0)
            if full is None and isinstance(param, DTensor):
                shard = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
                del shard
            elif full is None:
                param.copy_(whole)
            del whole  # before the next one is allocated: at most one whole parameter at a time
        once: dict[int, torch.Tensor] = {}  # each tensor once, where it is first held: the signatures agree on which
        for _, _, _, b in buffers:
            once.setdefault(id(b), b)
        for buf in once.values():
            dist.broadcast(buf.view(torch.uint8) if buf.dtype == torch.bool else buf, src=0)  # gloo has no bool


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
    if cfg.fp8:  # first: activation checkpointing, compile and sharding then wrap the float8 layers
        why = fp8.unavailable(ctx.device)
        if why:
            raise ConfigError(fp8.refusal(why))
        fp8.convert(model, cfg)
    if cfg.activation_checkpointing:
        checkpoint_activations(model, cfg.ac_mode, cfg.ac_every)
    if cfg.strategy == "ddp":
        return Ddp(model, ctx, cfg)
    if not dist.is_initialized():
        raise ConfigError("--strategy fsdp without a process group. HINT: start the rank through hpcjobs or torchrun")
    return Fsdp(model, ctx, cfg, precision, hook)
