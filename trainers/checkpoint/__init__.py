"""Checkpoints, one package by concept: the folder and its protocol (folder), the torch files (files), what goes wrong
(errors), one call for users' scripts (single_file), the shared trainer's checkpoint manager with its sharded and
asynchronous saves (sharded, staging), the named parts it is handed and where each goes (stateful), where a start
resumes (resume) and the position and RNG states saved beside the weights (state). Atomic:
RUN/checkpoints/step-N/, only finished ones count; every layout goes through the same three steps (`begin`, its
files, `commit`).

Saving (every rank takes part, in this order):
  1. rank 0 clears a stale `.step-N.tmp` left by a killed save, creates it; barrier
  2. rank 0 writes shared.pt (model, optimizer, scheduler, scaler, progress, config); every rank writes
     rank-R.pt (its RNG states); each file is fsynced; barrier
  3. rank 0 writes meta.json and the FINISHED marker (fsynced), fsyncs the folder, renames it to step-N, fsyncs
     the parent, then prunes older checkpoints beyond `keep` (never the newest finished one, never the one
     best.json names); barrier
A process killed at any instant leaves either the previous finished checkpoints untouched or a `.tmp` folder that
the loader ignores and the next save clears. Loading uses torch.load(weights_only=True): no arbitrary pickle.

A finished checkpoint can still be unreadable later (a disk or filesystem fault, a file truncated by hand): the
trainer then moves it aside to RUN/checkpoints/corrupt/step-N (`move_aside`, never deleted: it is the user's to look
at) and resumes from the next newest one (trainers.checkpoint.resume).
"""

from __future__ import annotations

from trainers.checkpoint.errors import CheckpointSpaceError, CorruptCheckpoint, dcp_failures, full_disk
from trainers.checkpoint.files import load_checkpoint, no_crc32, read_states, write_files
from trainers.checkpoint.folder import (
    BEST,
    CORRUPT,
    FINISHED,
    SHARED,
    CheckpointRef,
    begin,
    commit,
    finished,
    full_disk_explained,
    latest,
    mark_best,
    move_aside,
    prune,
    read_best,
    read_meta,
)
from trainers.checkpoint.single_file import save_checkpoint

__all__ = [
    "BEST", "CORRUPT", "CheckpointRef", "CheckpointSpaceError", "CorruptCheckpoint", "FINISHED", "SHARED", "begin",
    "commit", "dcp_failures", "finished", "full_disk", "full_disk_explained", "latest", "load_checkpoint",
    "mark_best", "move_aside", "no_crc32", "prune", "read_best", "read_meta", "read_states", "save_checkpoint",
    "write_files",
]
