"""What the checkpoint manager (trainers.checkpoint.sharded.Checkpointer) is handed: named parts, each with
state_dict() and load_state_dict() (torch's own objects, an LR scheduler or a GradScaler, already are), and where
each part's state is kept in a step folder. The trainer names its parts once; the manager saves and loads them by
name without knowing what they are (torchtitan's CheckpointManager(states=...) follows the same pattern).

Where a part goes is its `place` (SHARED when it has none):
  - SHARDED: its tensors are written by torch's Distributed Checkpoint under the part's name (each rank the shards
    it holds); its entries named in `small_entries` (no tensors) go to shared.pt instead, under the name given there;
  - SHARED: shared.pt under the part's name, rank 0's copy (every rank holds the same);
  - OWN: rank-R.pt under the part's name, each rank its own (not read back after a reshard: other ranks).
The names are the keys in the files, so a part's name is part of the on-disk layout: renaming one is a new layout.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Place(enum.Enum):
    SHARDED = "sharded"
    SHARED = "shared"
    OWN = "own"


def place_of(part: Stateful) -> Place:
    return getattr(part, "place", Place.SHARED)


def small_entries(part: Stateful) -> Mapping[str, str]:
    """A SHARDED part's entries kept in shared.pt: {its state-dict key: the key in shared.pt}."""
    return getattr(part, "small_entries", {})


def forward_changes(part: Stateful) -> frozenset[str]:
    """Keys of a SHARDED part's state that a forward may change: an asynchronous save copies them before it returns;
    the rest only changes in the optimizer's step, and is copied while the next forward and backward run."""
    return getattr(part, "forward_changes", frozenset())


@dataclass
class Parts:
    """One checkpoint's content, by where it goes (stateful.Place)."""

    tensors: dict[str, Any]
    """The SHARDED parts' tensors (DTensor shards under FSDP), by part name: DCP files."""
    shared: dict[str, Any]
    """Small states every rank has the same copy of: shared.pt, written by rank 0."""
    own: dict[str, Any]
    """This rank's states (its RNG streams): rank-R.pt."""
    now: dict[str, frozenset[str]] = field(default_factory=dict)
    """Per SHARDED part, the keys that a forward may change (stateful.forward_changes): an asynchronous save copies
    them at once. Everything else only changes in the optimizer's step."""


def gather(states: Mapping[str, Stateful]) -> Parts:
    """Every part's state, by where it goes."""
    parts = Parts({}, {}, {})
    for name, part in states.items():
        state, place = part.state_dict(), place_of(part)
        if place is Place.SHARDED:
            for key, kept_as in small_entries(part).items():
                parts.shared[kept_as] = state.pop(key)
            parts.tensors[name], parts.now[name] = state, forward_changes(part)
        else:
            (parts.own if place is Place.OWN else parts.shared)[name] = state
    return parts


WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")
"""Parts of module names that state-dict keys leave out (activation checkpointing's wrapper, torch.compile's)."""


class ModelState:
    """A model's tensors as torch.distributed.checkpoint.state_dict gives them: DTensor shards under FSDP, the live
    tensors (a load fills them in place), keys without the wrappers' names."""

    place = Place.SHARDED

    def __init__(self, model: nn.Module, options: StateDictOptions | None = None) -> None:
        self.model, self.options = model, options
        self.forward_changes = frozenset(".".join(p for p in name.split(".") if p not in WRAPPER_NAMES)
                                         for name, _ in model.named_buffers())  # running statistics, DDP's broadcast

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=self.options)


class OptimizerState:
    """An optimizer's state keyed by parameter names (as torch.distributed.checkpoint.state_dict gives it): its
    tensors sharded like the parameters; its param groups (learning rates, betas: small) in shared.pt as
    "optimizer_groups", the key the sharded layout has always used."""

    place = Place.SHARDED
    small_entries = {"param_groups": "optimizer_groups"}

    def __init__(self, model: nn.Module, optimizer: Optimizer, options: StateDictOptions | None = None) -> None:
        self.model, self.optimizer, self.options = model, optimizer, options

    def state_dict(self) -> dict[str, Any]:
        return dict(get_optimizer_state_dict(self.model, self.optimizer, options=self.options))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self.options)
