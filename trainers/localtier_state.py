"""The node-local checkpoint tier's files and state (trainers.localtier): one rank's part of the training state as
one self-checking file (torch.save's bytes, then their SHA-256: a torn or altered file is refused before anything
is applied), copied to the CPU for a thread to write, and applied back into the live model and optimizer (DTensor
shards under FSDP filled in place, as the DCP load fills them)."""

from __future__ import annotations

import copy
import hashlib
import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainers.checkpoint.stateful import Place, Stateful, place_of, small_entries

DIGEST = 32


def encode(payload: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    return data + hashlib.sha256(data).digest()


def intact(data: bytes) -> bool:
    return len(data) > DIGEST and hashlib.sha256(memoryview(data)[:-DIGEST]).digest() == data[-DIGEST:]


def decode(data: bytes) -> dict[str, Any]:
    if not intact(data):
        raise ValueError("its checksum does not match (torn or altered)")
    return torch.load(io.BytesIO(memoryview(data)[:-DIGEST]), weights_only=True, map_location="cpu")


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def to_cpu(obj: Any) -> Any:
    """A copy on the CPU of a state tree: this rank's own shard of a DTensor, a copy of every other tensor."""
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    return copy.deepcopy(obj)


def nbytes(obj: Any) -> int:
    """The bytes of a state tree's tensors (this rank's shard of a DTensor)."""
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, DTensor):
        obj = obj.to_local()
    return obj.nbytes if isinstance(obj, torch.Tensor) else 0


def free_room(root: Path) -> tuple[int, str]:
    """The bytes the tier may still take, and where that limit comes from: the free space of the file system of
    `root` (its nearest existing folder; tmpfs /dev/shm: half the node's memory by default), or less, the headroom of
    the process's memory cgroup (Slurm's --mem: /dev/shm's pages are charged to it)."""
    folder = root
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    st = os.statvfs(folder)
    room, where = st.f_bavail * st.f_frsize, f"{folder} (free space)"
    headroom = cgroup_headroom()
    return (headroom, "the job's memory cgroup (limit less usage)") if headroom is not None and headroom < room \
        else (room, where)


def cgroup_headroom(proc: Path = Path("/proc/self/cgroup"), fs: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory cgroup's limit less its usage (cgroup v2, else v1's memory controller); None: no limit."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        pairs = [(fs / path.lstrip("/"), "memory.max", "memory.current")] if controllers == "" else \
            [(fs / "memory" / path.lstrip("/"), "memory.limit_in_bytes", "memory.usage_in_bytes")] \
            if "memory" in controllers.split(",") else []
        for folder, limit, usage in pairs:
            try:
                most, used = (folder / limit).read_text().strip(), (folder / usage).read_text().strip()
            except OSError:
                continue
            if most.isdigit() and int(most) < 2**60:
                return max(0, int(most) - int(used))
    return None


def same_shape(template: Any, saved: Any, key: str = "") -> str:
    """Why `saved` cannot fill `template` ("" when it can): other keys, shapes or dtypes."""
    if isinstance(template, dict):
        if not isinstance(saved, dict) or set(template) != set(saved):
            return f"{key or 'state'}: other keys"
        return next((why for k in template if (why := same_shape(template[k], saved[k], f"{key}.{k}"))), "")
    if isinstance(template, torch.Tensor):
        local = template.to_local() if isinstance(template, DTensor) else template
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape or saved.dtype != local.dtype:
            return f"{key}: another shape or dtype"
    return ""


def fill(template: Any, saved: Any) -> Any:
    """`template` (live tensors, DTensor shards) with `saved`'s values copied in; the other leaves are `saved`'s."""
    if isinstance(template, dict):
        return {k: fill(v, saved[k]) for k, v in template.items()}
    if isinstance(template, torch.Tensor):
        (template.to_local() if isinstance(template, DTensor) else template).copy_(saved)
        return template
    return saved


def templates(states: Mapping[str, Stateful]) -> dict[str, Any]:
    out = {}
    for name, part in states.items():
        if place_of(part) is Place.SHARDED:
            out[name] = part.state_dict()
            for key in small_entries(part):
                out[name].pop(key)
    return out


def apply(states: Mapping[str, Stateful], payload: dict[str, Any]) -> None:
    """Every part from a checked payload: the SHARDED parts' tensors copied into this rank's, then the rest."""
    filled = {n: fill(t, payload["tensors"][n]) for n, t in templates(states).items()}
    for name, part in states.items():
        place = place_of(part)
        if place is Place.SHARDED:
            part.load_state_dict({**filled[name], **{k: payload["shared"][kept]
                                                     for k, kept in small_entries(part).items()}})
        else:
            part.load_state_dict(payload["shared" if place is Place.SHARED else "own"][name])
