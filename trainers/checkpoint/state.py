"""What a run's position is, beyond its weights: the step, where the data stands, and each rank's RNG streams.
Saved in every checkpoint as parts named by the trainer (the position in shared.pt, the RNG states in each rank's
rank-R.pt)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from trainers.checkpoint.stateful import Place


@dataclass
class Position:
    """Where training stands: optimizer steps done, and the next micro-batch of which epoch to read."""

    step: int = 0
    epoch: int = 0
    micro: int = 0
    """Micro-batches this rank has read of the epoch. The same count at any world size means the same samples
    consumed, since a --reshard keeps the global batch (trainers.checkpoint.resume.check_layout)."""

    def state_dict(self) -> dict[str, Any]:
        return vars(self).copy()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """In place: the data iterator reads this very object (trainers.data.micro_batches)."""
        vars(self).update(vars(Position(**state_dict)))  # a key that is no field raises, as a new Position would


class RngState:
    """This rank's RNG streams, as a part that is every rank's own (rank-R.pt)."""

    place = Place.OWN

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return rng_state(self.device)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_rng_state(state_dict, self.device)


def rng_state(device: torch.device) -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = cast("tuple[Any, ...]", np.random.get_state())  # the legacy tuple
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    # The rank's own GPU only (a resume may see other GPUs, one per task), and none for a rank on the CPU: asking
    # CUDA there (HPCJOBS_BACKEND=gloo on a GPU node) would open a context on GPU 0 in every rank.
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def reseed(seed: int, rank: int, step: int) -> None:
    """Fresh RNG streams for a rank that has no saved ones (a resharded resume): distinct per rank and per step."""
    seed_all(int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]))


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
