"""Where a start of a run continues: the newest finished checkpoint every rank can read and whose settings match,
the learning-rate schedule from there, and metrics.jsonl cut back to it.

Ranks agree on the checkpoint before any of them applies one: each reads its files whole into memory, the verdicts
are gathered on the CPU control group, and if any rank could not read its part, rank 0 moves the checkpoint aside
(checkpoints/corrupt/) and all try the next newest together, so no two ranks ever resume from different steps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpcjobs.protocol.atomic import write_atomic
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ResumeError
from trainers import checkpoint, ranklog
from trainers.checkpoint import CheckpointRef, CorruptCheckpoint
from trainers.dist import DistContext
from trainers.task import Task

Keys = tuple[tuple[str, ...], tuple[str, ...]]
"""The keys shared.pt and rank-R.pt must hold (Checkpointer.names), checked before anything is applied."""
_OK, _CORRUPT, _REFUSED = 0, 1, 2
Anchor = tuple[int, float]
"""(step k, LR factor at k) an --extend continues the schedule from; stored in every later checkpoint's meta."""


@dataclass
class Resumed:
    ref: CheckpointRef
    meta: dict[str, Any]
    shared: dict[str, Any]
    mine: dict[str, Any]
    """This rank's own states; empty after a reshard (another world size has other ranks)."""


def lr_lambda(cfg: TrainConfig, anchor: Anchor | None = None) -> Callable[[int], float]:
    """The LR factor LambdaLR applies after `step` optimizer steps: linear warmup, then a half cosine to
    min_lr_ratio at cfg.steps; from an --extend's anchor (k, f) on, a half cosine from f at k to min_lr_ratio."""
    low = cfg.min_lr_ratio

    def factor(step: int) -> float:  # a closure, not a callable object: LambdaLR would pickle an object's fields
        if anchor is not None and step >= anchor[0]:
            start, value = anchor
            if step == start:
                return value  # exactly the saved LR, not m + (value - m) rounded
            progress = min(1.0, (step - start) / max(1, cfg.steps - start))
            return low + (value - low) * 0.5 * (1 + math.cos(math.pi * progress))
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def saved_anchor(meta: dict[str, Any]) -> Anchor | None:
    saved = meta.get("lr_anchor")
    return (int(saved[0]), float(saved[1])) if saved else None


def lr_anchor(meta: dict[str, Any], cfg: TrainConfig, lr: float) -> tuple[Anchor | None, str]:
    """The schedule's anchor for a start resumed from a checkpoint with this meta, and what happened to the schedule
    in words ("" when nothing changed); `lr` is the peak LR (world-size scaled). check_compatible has refused a
    changed --steps without --extend."""
    anchor = saved_anchor(meta)
    saved_steps = meta.get("config", {}).get("steps", cfg.steps)
    step = int(meta["step"])
    if saved_steps == cfg.steps:
        return anchor, ""
    was = f"--steps {saved_steps} → {cfg.steps} (--extend)"
    if anchor is None and step <= cfg.warmup_steps:
        return None, f"{was}: still in warmup at step {step}, so the plan for --steps {cfg.steps} applies unchanged"
    value = lr_lambda(replace(cfg, steps=saved_steps), anchor)(step)  # what the interrupted plan gave at step k
    return (step, value), (f"{was}: the LR goes on from {value * lr:.6g} (as saved at step {step}) down to "
                           f"{cfg.min_lr_ratio * lr:.6g} at step {cfg.steps} along a half cosine")


BATCH_KEYS = ("batch_size", "global_batch_size")
"""Under --reshard only the global batch they give must stay (check_layout), not how it was written."""


def check_compatible(meta: dict[str, Any], cfg: TrainConfig, task: Task, world: int, where: str) -> bool:
    """Raise ResumeError if the checkpoint was written under settings that would make this start another run;
    returns whether loading it reshards (another world size or strategy, allowed by --reshard)."""
    saved_cfg = meta.get("config", {})
    reshard = cfg.reshard and layout_changes(meta, cfg, world)
    diffs = [f"{k}: {saved_cfg.get(k)!r} → {getattr(cfg, k)!r}" for k in TrainConfig.RESUME_KEYS
             if k in saved_cfg and saved_cfg[k] != getattr(cfg, k) and not (reshard and k in BATCH_KEYS)]
    if meta.get("task") != task.name:
        diffs.append(f"task: {meta.get('task')!r} → {task.name!r}")
    if meta.get("task_config", {}) != task.config:
        diffs.append(f"task config: {meta.get('task_config')} → {task.config}")
    if diffs:
        raise ResumeError(f"checkpoint {where} was written with other settings ({'; '.join(diffs)}); resuming "
                          "would not continue the same run. HINT: use the same settings, or a new --run-dir.")
    check_steps(meta, cfg, where)
    return check_layout(meta, cfg, world, where)


def layout_changes(meta: dict[str, Any], cfg: TrainConfig, world: int) -> bool:
    return bool(meta.get("world_size") != world or meta.get("config", {}).get("strategy", "ddp") != cfg.strategy)


def check_layout(meta: dict[str, Any], cfg: TrainConfig, world: int, where: str) -> bool:
    """Whether the checkpoint is resharded on load (its world size or strategy differ); ResumeError when that is
    not allowed (no --reshard, or the global batch would change)."""
    if not layout_changes(meta, cfg, world):
        return False
    saved_world, saved = meta.get("world_size") or 0, meta.get("config", {})
    was = f"{saved_world} ranks with --strategy {saved.get('strategy', 'ddp')}"
    now = f"{world} with --strategy {cfg.strategy}"
    if not cfg.reshard:
        raise ResumeError(f"checkpoint {where} was written by {was}, this run has {now}; the data order and per-rank "
                          f"RNG states would not continue exactly. HINT: resume with {saved_world} ranks and "
                          f"--strategy {saved.get('strategy', 'ddp')}, add --reshard to load it anyway (weights, "
                          "optimizer and step exactly; see docs/how-to/fsdp.md#resharding), or start a new --run-dir.")
    saved_global = saved.get("global_batch_size") or saved.get("batch_size", 0) * saved_world
    now_global = cfg.per_rank_batch(world) * world
    if saved_global != now_global:
        raise ResumeError(f"--reshard of checkpoint {where} ({was}) to {now}: the global batch would change from "
                          f"{saved_global} to {now_global} samples per step, which is another run. HINT: give "
                          f"--global-batch-size {saved_global} (--batch-size is per rank)")
    return True


def check_steps(meta: dict[str, Any], cfg: TrainConfig, where: str) -> None:
    saved_steps, step = meta.get("config", {}).get("steps"), meta.get("step", 0)
    if saved_steps is None or saved_steps == cfg.steps:
        return
    if not cfg.extend:
        raise ResumeError(f"checkpoint {where} (step {step}) was written by a run of --steps {saved_steps}, this "
                          f"start asks for --steps {cfg.steps}: the cosine schedule would be re-planned and the LR "
                          f"would jump. HINT: resume with --steps {saved_steps}, or add --extend to continue the "
                          f"schedule from the saved LR down to its minimum at step {cfg.steps}.")
    if cfg.steps < step:
        raise ResumeError(f"--steps {cfg.steps} is below the step of checkpoint {where} ({step}): nothing to "
                          f"extend. HINT: give --steps above {step}, or a new --run-dir.")


ResumeRule = Callable[[dict[str, Any], str], bool]
"""check(meta, where): raises ResumeError when a checkpoint's settings do not match this start's; returns whether it
is resharded on load."""
Load = Callable[[Resumed], None]
"""load(resumed): every rank applies the checkpoint (a collective); raises CorruptCheckpoint on every rank alike."""


def _examine(ref: CheckpointRef, rank: int, check: ResumeRule, keys: Keys) -> tuple[int, str, Resumed | None]:
    """This rank's verdict on a checkpoint's small files: ok (with them read), corrupt or refused (with why)."""
    try:
        meta = checkpoint.read_meta(ref)
        try:
            reshard = check(meta, str(ref.path))
        except ResumeError as e:
            return _REFUSED, str(e), None
        shared, mine = checkpoint.read_states(ref, rank, keys[0], () if reshard else keys[1], own=not reshard)
    except CorruptCheckpoint as e:
        return _CORRUPT, str(e), None
    return _OK, "", Resumed(ref, meta, shared, mine)


def _everyones(ctx: DistContext, mine: Any) -> list[Any]:
    """Every rank's `mine`, in rank order (a CPU collective on the control group; just [mine] alone)."""
    if ctx.world_size == 1 or not dist.is_initialized():
        return [mine]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, mine, group=ctx.control_group)
    return out


def newest_readable(run: RunFolder, ctx: DistContext, check: ResumeRule, load: Load, keys: Keys) -> Resumed | None:
    """The newest finished checkpoint that every rank read and applied, after moving aside those some rank could not
    read; None: none left (start fresh; a failed `load` may have changed the model: build it anew). Raises
    ResumeError on every rank when its settings do not match (`check`)."""
    while True:
        ref = checkpoint.latest(run.checkpoints)
        step = _everyones(ctx, ref.step if ref else None)[0]  # rank 0's listing decides (a shared filesystem's
        if step is None:                                      # directory cache may lag behind a rename)
            return None
        ref = CheckpointRef(step, run.checkpoints / f"step-{step}")
        code, why, resumed = _examine(ref, ctx.rank, check, keys)
        verdicts = _everyones(ctx, (code, why))
        refusals = [w for c, w in verdicts if c == _REFUSED]
        if refusals:
            raise ResumeError(why if code == _REFUSED else refusals[0])
        bad = [f"rank {r}: {w}" if ctx.world_size > 1 else w for r, (c, w) in enumerate(verdicts) if c == _CORRUPT]
        if not bad and resumed is not None:
            try:
                load(resumed)  # every rank: its small files were read by all
                return resumed
            except CorruptCheckpoint as e:
                bad = [str(e)]  # the same on every rank: DCP gathers each rank's error
        if ctx.is_main:
            moved = checkpoint.move_aside(run.checkpoints, ref)
            ranklog.warn(f"hpcjobs: checkpoint {ref.path} cannot be loaded ({'; '.join(bad)}); moved it to {moved} and "
                         "trying the next newest", rank=ctx.rank)
        ctx.barrier()


def trim_metrics(path: Path, step: int) -> int:
    """Rank 0, before it logs anything: drop metrics.jsonl's records past `step` (logged by a start that was
    interrupted after its last checkpoint: the resumed start logs those steps again) and a torn last line. Rewritten
    aside, fsynced and renamed over, so a kill leaves the old or the new file. Returns how many lines went."""
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    keep = [line for line in lines if _at_or_before(line, step)]
    if len(keep) == len(lines):
        return 0
    write_atomic(path, b"".join(keep), durable=True)
    return len(lines) - len(keep)


def _at_or_before(line: bytes, step: int) -> bool:
    try:
        rec = json.loads(line)
        return line.endswith(b"\n") and isinstance(rec, dict) and int(rec.get("step", 0)) <= step
    except (ValueError, TypeError):
        return False  # a torn line of a killed writer
