"""The sharding function FSDP's units go through, the trainer's own and a task's `parallelize(model, shard)` hook's
alike: `shard(module)` compiles the module if --compile asks (as a wrapper registered in its parent's place), then
calls FSDP2's `fully_shard` on it with the run's mesh, mixed-precision policy and offload policy. So a hook written
as documented computes in bf16 like the default units, and --compile applies to what it builds.

The order is torchtitan's (torchtitan/models/llama3/infra/parallelize.py): activation checkpointing (done before the
hook, trainers.strategy.make) → compile → shard. Sharding the compiled wrapper keeps FSDP's pre- and post-forward
hooks outside the compiled frame, which then holds the block's body only; compiling the block in place
(`module.compile()`) put the hooks inside it: a graph break at each of them, and one frame shared by every block."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hpcjobs.protocol.settings.trainflags import ConfigError


def compile_in_place(root: nn.Module, module: nn.Module) -> nn.Module:
    """`torch.compile(module)` registered wherever `root` holds `module` (every parent, if shared); returns the
    compiled wrapper. The root itself (no parent to register in) is returned as it was: the trainer compiles blocks,
    not the whole model, as torchtitan does."""
    compiled: nn.Module | None = None
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if child is module:
                compiled = compiled or torch.compile(module)  # type: ignore[assignment]
                parent.register_module(name, compiled)
    return compiled if compiled is not None else module


class Sharding:
    """`shard(module)`: compile (if asked) and `fully_shard` one unit; returns the module the model now holds in its
    place (the compiled wrapper under --compile). `shard.mesh` is the device mesh and `shard.kwargs` the keywords
    `fully_shard` gets (mesh, mp_policy, offload_policy, reshard_after_forward), for a hook that groups several
    modules into one unit: `fully_shard([model.norm, model.out], **shard.kwargs)`."""

    def __init__(self, root: nn.Module, kwargs: dict[str, Any], compile: bool) -> None:
        self.root, self.kwargs, self.compile = root, kwargs, compile
        self.mesh = kwargs["mesh"]

    def __call__(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        if self.compile:
            module = compile_in_place(self.root, module)
        fully_shard(module, **self.kwargs)
        return module

    def __getattr__(self, name: str) -> Any:
        """A hook written for the old signature, parallelize(model, mesh), passes this where a mesh goes: one line,
        not an AttributeError from deep inside fully_shard."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise ConfigError(f"parallelize(model, mesh): the hook used its second argument as a device mesh "
                          f"(.{name}); valid: parallelize(model, shard) calling shard(module) on each unit. HINT: "
                          "replace fully_shard(m, mesh=mesh) with shard(m): it carries the mesh, mixed precision, "
                          "offload and --compile")
