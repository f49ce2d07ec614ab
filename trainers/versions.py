"""The oldest torch the node side runs on, checked when a rank starts: an older one would otherwise fail at the first
checkpoint save, which may be the one a preemption asks for.

Torch-free at import (it reads the installed version's metadata); `pyproject.toml` declares the same floor, and a
test keeps the two equal.
"""

from __future__ import annotations

import re
from importlib import metadata

TORCH_FLOOR = (2, 7)
"""torch.utils.serialization.config (checkpoint writes without the zip CRC) is the newest API the node side needs;
torch 2.6 has none (measured: a 2.6 run failed at its first save). 2.7.1, 2.11 (an H100) and 2.13 run the tests."""


class TorchTooOld(RuntimeError):
    pass


def parse(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def require_torch(installed: str | None = None) -> None:
    """Raise TorchTooOld (one line) when the installed torch is older than TORCH_FLOOR."""
    if installed is None:
        try:
            installed = metadata.version("torch")
        except metadata.PackageNotFoundError:
            raise TorchTooOld("torch is not installed for this Python; valid: torch >= "
                              f"{'.'.join(map(str, TORCH_FLOOR))}. HINT: install it in the environment the nodes "
                              "use (the profile's python or setup)") from None
    if parse(installed) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise TorchTooOld(f"torch {installed} is installed; hpcjobs needs torch >= {floor}. HINT: pip install "
                          f"'torch>={floor}' in the environment the nodes use (the profile's python or setup)")
