"""The oldest torch the node side runs on, checked when a rank starts: an older one would otherwise fail at the first
checkpoint save, which may be the one a preemption asks for.

Torch-free at import (it reads the installed version's metadata). The floor itself is hpcjobs.protocol.versions's:
the job script's check names this module by text.
"""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata

from hpcjobs.protocol.errors import StartRefused
from hpcjobs.protocol.versions import FLOOR_TEXT, TORCH_FLOOR


class TorchTooOld(StartRefused, RuntimeError):
    """The node's torch is below the floor (hpcjobs.protocol.versions): the start is refused."""


def parse(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def torch_problem(installed: str | None = None) -> str | None:
    """What keeps this Python's torch from running the node side, in a few words (None: nothing). Torch is not
    imported: the job script asks before every start, and an import costs seconds of a node's start-up."""
    if installed is None:
        try:
            installed = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return "torch is not installed for this Python"
        if importlib.util.find_spec("torch") is None:  # metadata left behind by a half-removed install
            return "torch is not installed for this Python"
    if parse(installed) < TORCH_FLOOR:
        return f"torch {installed} is installed; hpcjobs needs torch >= {FLOOR_TEXT}"
    return None


def require_torch(installed: str | None = None) -> None:
    """Raise TorchTooOld (one line) when torch is missing or older than TORCH_FLOOR."""
    problem = torch_problem(installed)
    if problem is not None:
        raise TorchTooOld(f"{problem}. HINT: pip install 'torch>={FLOOR_TEXT}' in the environment the nodes use (the "
                          "profile's python or setup)")
