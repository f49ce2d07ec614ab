"""A resume its checkpoint would refuse, refused at submit instead. The shared trainer refuses, on its ranks, a
checkpoint written under settings that would make the resumed start another run (trainers/checkpoint/resume.py:
check_compatible, check_steps, check_layout). Said there, the refusal came after the job had queued and started:
a job record more, a start more in the run folder. Here the run folder's newest finished checkpoint tells what it
was written with (its meta.json: the trainer's settings, the world size), and every setting this submission's flags
give is compared with it, as the node will. A setting the flags leave out is left to the node: its value may be the
task's own default, which only the node knows. Torch-free, reads only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.runfolder import RunFolder, has_pattern, read_json
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError, parse_trainer_args
from hpcjobs.request.spec import JobSpec

CHECKPOINT_META = "meta.json"
"""A finished checkpoint's small record, written by rank 0 (trainers/checkpoint/folder.py): `config` (every trainer
setting), `step`, `world_size`, `task`."""
BATCH_KEYS = ("batch_size", "global_batch_size")
"""Under --reshard only the global batch must stay (the node checks that), not how it was written."""
NEW_RUN = "or pass a new --run-dir to start another run; nothing was submitted."


def given_settings(args: Sequence[str]) -> dict[str, Any]:
    """The trainer settings the arguments give explicitly (a flag typed, before any `--`), with their values."""
    try:
        cfg, _ = parse_trainer_args(list(args))
    except ConfigError:
        return {}  # refused before this, by the request's own check
    words = list(args)[:list(args).index("--")] if "--" in args else list(args)
    typed = {w.split("=", 1)[0] for w in words if w.startswith("--")}
    values = cfg.as_dict()
    return {name: values[name] for name in values
            if {"--" + name.replace("_", "-"), "--no-" + name.replace("_", "-")} & typed}


def check_resume(spec: JobSpec) -> None:
    """Refuse (UsageError) a submission to a run folder whose newest checkpoint its trainer flags contradict."""
    if spec.entry.kind != "task" or spec.array or has_pattern(spec.run_dir):
        return
    run = RunFolder(spec.run_dir)
    step = run.newest_checkpoint()
    if step is None:
        return
    where = run.checkpoints / f"step-{step}"
    meta = read_json(where / CHECKPOINT_META)
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        return
    given = given_settings(spec.entry.args)
    reshard = bool(given.get("reshard"))
    _check_settings(meta["config"], given, reshard, where)
    _check_steps(meta["config"], given, int(meta.get("step") or step), where)
    _check_layout(meta, given, spec.ranks, reshard, where)


def _check_settings(saved: Mapping[str, Any], given: Mapping[str, Any], reshard: bool, where: Path) -> None:
    diffs = [f"{k}: {saved[k]!r} → {given[k]!r}" for k in TrainConfig.RESUME_KEYS
             if k in given and k in saved and saved[k] != given[k] and not (reshard and k in BATCH_KEYS)]
    if diffs:
        raise UsageError(f"checkpoint {where} was written with other settings ({'; '.join(diffs)}); resuming would "
                         "not continue the same run, and the ranks would refuse it.",
                         f"use the checkpoint's settings ({', '.join(d.split(' → ')[0] for d in diffs)}), {NEW_RUN}")


def _check_steps(saved: Mapping[str, Any], given: Mapping[str, Any], step: int, where: Path) -> None:
    saved_steps, steps = saved.get("steps"), given.get("steps")
    if steps is None or saved_steps is None or saved_steps == steps:
        return
    if not given.get("extend"):
        raise UsageError(f"checkpoint {where} (step {step}) was written by a run of --steps {saved_steps}, this "
                         f"submission asks for --steps {steps}: the cosine schedule would be re-planned and the LR "
                         "would jump; the ranks would refuse it.", f"resume with --steps {saved_steps}, or add "
                         f"--extend to continue the schedule from the saved LR down to its minimum at step {steps}, "
                         f"{NEW_RUN}")
    if steps < step:
        raise UsageError(f"--steps {steps} --extend is below the step of checkpoint {where} ({step}): nothing to "
                         "extend.", f"give --steps above {step}, {NEW_RUN}")


def _check_layout(meta: Mapping[str, Any], given: Mapping[str, Any], ranks: int, reshard: bool, where: Path) -> None:
    """Another world size (or an explicitly other --strategy) without --reshard."""
    saved_world, saved_strategy = meta.get("world_size"), meta["config"].get("strategy", "ddp")
    strategy = given.get("strategy", saved_strategy)
    if reshard or not isinstance(saved_world, int) or (saved_world, saved_strategy) == (ranks, strategy):
        return
    raise UsageError(f"checkpoint {where} was written by {saved_world} ranks with --strategy {saved_strategy}, this "
                     f"submission has {ranks} with --strategy {strategy}: the data order and per-rank RNG states "
                     "would not continue exactly; the ranks would refuse it.",
                     f"resume with {saved_world} ranks and --strategy {saved_strategy}, add --reshard to load it "
                     f"anyway (see docs/how-to/fsdp.md#resharding), {NEW_RUN}")
