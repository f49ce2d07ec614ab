"""The CUDA caching allocator: expandable segments unless the user chose the allocator's settings, and what it
reports at each log step (peak allocated and reserved memory, the retries that mean it ran short).

Expandable segments let the allocator grow one mapping per stream instead of carving fixed-size blocks, so
blocks freed at one size are reused at another: FSDP's all-gathered blocks and activations of changing sizes no
longer leave reserved-but-unusable memory behind (torch's CUDA notes, "Optimizing memory usage with
PYTORCH_CUDA_ALLOC_CONF"; torchtitan sets it by default). Torch reads the setting when CUDA's allocator is first
made, so `configure` runs before the rank's first CUDA call that makes it (trainers.dist.distributed, before
set_device).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where torch reads the allocator's settings (the second is torch 2.9's device-generic name; the first still wins)."""
EXPANDABLE = "expandable_segments:True"


def configure(environ: MutableMapping[str, str] = os.environ) -> None:
    """On a CUDA rank, before its allocator exists: expandable segments, unless the user set the allocator."""
    if any(name in environ for name in SETTINGS):
        return
    environ[SETTINGS[0]] = EXPANDABLE
    if torch.cuda.is_initialized():  # too late for the variable (a script's own CUDA call): set it directly
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)


def words(device: torch.device, environ: MutableMapping[str, str] = os.environ) -> str:
    """What the start line says about the allocator (nothing on the CPU)."""
    if device.type != "cuda":
        return ""
    name = next((n for n in SETTINGS if n in environ), None)
    if name is None:
        return ""
    if environ[name] == EXPANDABLE:
        return "expandable segments"
    return f"allocator {name}={environ[name]} (yours)"


def figures(device: torch.device) -> dict[str, float | int]:
    """metrics.jsonl's memory fields on a CUDA rank, from the allocator's own counters (no device sync): the peak
    of allocated and of reserved memory (their gap is what fragmentation costs) and how many times an allocation
    failed, freed the cache and retried (`num_alloc_retries`: each one is a full synchronize; a rising count means
    the run is at the edge of the GPU's memory)."""
    stats = torch.cuda.memory_stats(device)
    return {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
            "alloc_retries": int(stats.get("num_alloc_retries", 0))}
