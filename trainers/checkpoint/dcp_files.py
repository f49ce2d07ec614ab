"""Torch's Distributed Checkpoint files of a step folder, read and written safely: the writer the Checkpointer
(trainers.checkpoint.sharded) saves through, the reader that never runs pickled code (`.metadata` through an
allowlist of DCP's own classes, tensors with weights_only), and the readers used without a process group (export, the
tests' weight comparisons, resharding checks). Apart from the manager so that each reads on its own: the manager's
save state machine, this module's file format."""

from __future__ import annotations

import dataclasses
import pickle
import textwrap
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from trainers import checkpoint
from trainers.checkpoint.errors import corrupt

METADATA = ".metadata"
"""DCP's index of a step folder: present in the shared trainer's checkpoints, absent in save_checkpoint's."""

# One rank has no process group, and DCP then warns at every save and load (even told no_dist=True) that it assumes
# "the intent is to save in a single process": it is, so the warning only cluttered each 1-rank run's log. By its
# words, not by category: DCP's other warnings still show. A filter, not catch_warnings: saves run in a thread.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized, assuming "
                        "the intent is to", category=UserWarning)


class Writer(dcp.FileSystemWriter):
    """DCP's file writer, without zip CRC32s (checkpoint.no_crc32), whose failures keep the errno of a full disk
    when DCP gathers them to every rank: it pickles each rank's exception, and pickling drops __context__, where
    torch.save's RuntimeError ("unexpected pos") keeps the OSError that says the disk is full."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            with checkpoint.no_crc32():  # DCP torch.saves each tensor
                written = super().write_data(plan, planner)
                written.wait()
        except Exception as e:
            full = checkpoint.full_disk(e)
            if full is None:
                raise
            raise OSError(full.errno, full.strerror) from e
        return written


SAFE_IN_METADATA = {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("torch", "Size"),
                    ("torch.serialization", "_get_layout"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                    *(("torch.distributed.checkpoint.metadata", name) for name in (
                        "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                        "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"))}
"""What a `.metadata` of this trainer's checkpoints is made of (tensors only: no BytesStorageMetadata, whose entries
DCP would unpickle with weights_only=False), and torch's dtypes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SAFE_IN_METADATA or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's {METADATA}")


class SafeReader(dcp.FileSystemReader):
    """DCP's reader, but `.metadata` (a pickle) is read with an allowlist: a checkpoint is data, never code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(str(self.path)) / METADATA, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{METADATA} holds a {type(metadata).__name__}")
        storage = metadata.storage_meta or StorageMeta()
        storage.load_id = self.load_id  # what DCP's own reader does
        metadata.storage_meta = storage
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's read, one file at a time, so that a torn file is named: torch's own error says only that some zip
        archive has no central directory, in five sentences of advice."""
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        done = None
        for name, items in per_file.items():
            try:
                done = super().read_data(dataclasses.replace(plan, items=items), planner)
            except Exception as e:  # noqa: BLE001 - torch raises many types for a torn or foreign file
                raise corrupt(name, e) from None
        return done if done is not None else super().read_data(plan, planner)


def flat(tensors: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(DCP's key, tensor) of a nested state dict: keys joined with dots, as DCP flattens them."""
    if isinstance(tensors, dict):
        return [pair for k, v in tensors.items() for pair in flat(v, f"{prefix}{k}.")]
    return [(prefix[:-1], tensors)] if isinstance(tensors, torch.Tensor) else []


def written_here(tensors: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """`tensors` less the whole tensors that another rank writes. A tensor every rank holds whole (all of them under
    DDP; buffers and step counts under FSDP) is written once, and DCP would pick the rank, but only inside the save:
    every rank would copy all of them first (a background save's host buffers: 16 bytes a parameter per rank under
    DDP, 8 ranks on a node). Largest first, each goes to the rank with the fewest bytes so far, lowest rank on a tie:
    the same choice on every rank, since every rank has the same shapes. A load still reads every tensor it holds."""
    whole = sorted(((key, t.nbytes) for key, t in flat(tensors) if not isinstance(t, DTensor)),
                   key=lambda entry: (-entry[1], entry[0]))
    load, elsewhere = [0] * world_size, set()
    for key, size in whole:
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += size
        if owner != rank:
            elsewhere.add(key)
    return _without(tensors, elsewhere) if elsewhere else tensors


def _without(tensors: dict[str, Any], keys: set[str], prefix: str = "") -> dict[str, Any]:
    return {k: _without(v, keys, f"{prefix}{k}.") if isinstance(v, dict) else v
            for k, v in tensors.items() if f"{prefix}{k}" not in keys}


def mismatch(key: str, t: torch.Tensor, saved: dict[str, Any]) -> str:
    """Why `key` cannot be loaded from a checkpoint's entries ("" if it can)."""
    entry = saved.get(key)
    if entry is None:
        return f"{key} is not in it"
    if not isinstance(entry, TensorStorageMetadata):
        return f"{key} is not a tensor there"
    if tuple(entry.size) != tuple(t.shape):
        return f"{key} is {tuple(entry.size)} there, {tuple(t.shape)} here"
    return ""


def model_weights(ref: checkpoint.CheckpointRef) -> dict[str, torch.Tensor]:
    """The whole model of a finished checkpoint, in either layout (sharded, or save_checkpoint's shared.pt), on the
    CPU and without a process group; raises checkpoint.CorruptCheckpoint."""
    if not (ref.path / METADATA).is_file():
        shared, _ = checkpoint.read_states(ref, 0, shared_keys=("model",), own=False)
        return dict(shared["model"])
    try:
        return offline_tensors(ref.path, "model.")
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises its own types for torn files
        raise unreadable(e) from None


def unreadable(e: BaseException) -> checkpoint.CorruptCheckpoint:
    """One line: what each rank's read raised (DCP's own message holds every rank's traceback), else `e`."""
    failures = checkpoint.dcp_failures(e)
    what = "; ".join(f"rank {rank}: {_named(x)}" for rank, x in failures) or _named(e)
    return checkpoint.CorruptCheckpoint(f"sharded tensors: {textwrap.shorten(what, 300, placeholder=' …')}")


def _named(e: BaseException) -> str:
    if isinstance(e, checkpoint.CorruptCheckpoint):
        return str(e)  # names its file already (SafeReader.read_data)
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def offline_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The full tensors saved under `prefix` (e.g. "model.") in a sharded step folder, on the CPU, without a process
    group: for `hpcjobs export` and tests. Every shard is read (this is the whole model, on purpose)."""
    reader = SafeReader(path)
    meta = reader.read_metadata()
    wanted = {fqn: torch.empty(m.size, dtype=m.properties.dtype)
              for fqn, m in meta.state_dict_metadata.items()
              if fqn.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process": yes
        warnings.simplefilter("ignore", UserWarning)  # (the filter above is undone where warnings are caught: pytest)
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    return {fqn.removeprefix(prefix): t for fqn, t in wanted.items()}

