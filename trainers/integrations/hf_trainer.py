"""`transformers.Trainer` under hpcjobs's stop protocol, with no line of the user's script changed.

Attached when the script imports `transformers.trainer` (trainers/integrations/__init__.py):

- Every `Trainer` gets one more callback. At the step ends its cadence names (trainers/integrations/checks.py: every
  step end over a start's first 12, then about once a second of training, as the shared trainer's) the ranks agree
  whether any of them was asked to stop (the profile's signal, SIGTERM, Ctrl-C; one small CPU all-reduce a check).
  When one was, that step is saved by the Trainer itself (`checkpoint-N`: model, optimizer,
  scheduler, scaler, RNG, trainer state) and training stops there: no evaluation, no other work.
- After every save, periodic or not, each rank fsyncs the folder's files and, once all have, rank 0 writes
  `hpcjobs-complete.json` into it (fsynced): only then is the checkpoint complete. A save that dies halfway leaves
  its `.hpcjobs-pending` mark, written before the save began, and no completion mark.
- The hang watchdog (trainers/watchdog.py) is armed for the length of `train()`: each step end marks progress, a
  save from its step end to its completion mark has the save allowance, each evaluation batch counts as progress.
- The protocol's signal handlers hold only while `train()` runs (trainers/integrations/signals.py): the code before
  and after it keeps the script's own (Ctrl-C stops it), and a signal that came after the ranks' last agreement is
  handed to them as `train()` returns.
- After a stop's save, rank 0 requeues the job (on Slurm, when the stop came from the profile's signal) and every
  rank exits: nothing after `trainer.train()` runs (no final save_model, evaluation or upload on a stop).
- `train()` resumes the newest complete checkpoint of the output folder when it is given none, among those this
  run completed: one another run completed (another command, or `--new`, with the same output folder; the completion
  mark names the run folder) is not resumed, and one line says so and which was. A checkpoint it is
  given, or finds, that a save left incomplete (the pending mark without the completion mark) is moved aside to
  `OUTPUT/incomplete/` with one line, and the newest complete one before it is used instead (Hugging Face's own
  `get_last_checkpoint`, which scripts like run_clm.py call, picks the newest folder however it ended). A
  checkpoint written without hpcjobs (neither mark) is taken as it is.
- DeepSpeed through the Trainer's `deepspeed=` (ZeRO-2, ZeRO-3, CPU offload) needs nothing more: its shards are
  files of checkpoint-N like the others (tests/test_deepspeed.py). Its checkpoint resumes only at the world size that
  wrote it: another is refused in one line naming DeepSpeed's universal-checkpoint conversion (`same_world_size`).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

from hpcjobs.protocol.runfolder import read_json
from trainers import watchdog
from trainers.integrations import marks
from trainers.integrations.account import ACCOUNT
from trainers.integrations.marks import COMPLETE, incomplete, mark_complete, mark_pending, run_folder, say, settle
from trainers.integrations.signals import joined


def attach(module: ModuleType) -> None:
    """Wrap the module's Trainer (once): the callback in __init__, the resume in train()."""
    trainer_cls = module.Trainer
    if getattr(trainer_cls, "_hpcjobs_attached", False):
        return
    original_init, original_train = trainer_cls.__init__, trainer_cls.train

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        self.add_callback(stop_callback())

    @functools.wraps(original_train)
    def train(self: Any, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        skippable(self.args)
        resume = resume_point(self.args.output_dir, resume_from_checkpoint)
        callback = next((c for c in self.callback_handler.callbacks if getattr(c, "hpcjobs", False)), None)
        if callback is None:  # the script removed it: the Trainer as it is
            return original_train(self, resume, *args, **kwargs)
        with joined(callback), watchdog.armed():  # the protocol's handlers and the hang watchdog, for train()
            return original_train(self, resume, *args, **kwargs)

    trainer_cls.__init__, trainer_cls.train = __init__, train
    trainer_cls._hpcjobs_attached = True


# --- which checkpoint a start resumes ------------------------------------------------------------------------------

def resume_point(output_dir: str, given: Any) -> Any:
    """What train() resumes from: `given` when it is a complete (or foreign) checkpoint or False, else the newest
    complete checkpoint of the output folder, else the one the job's previous start recorded (an output folder whose
    name changed), else a fresh start. Incomplete ones are moved aside by rank 0. A start that could never save is
    refused now, in one line, rather than after its first stretch of training."""
    if given is False:
        return given
    root = Path(output_dir)
    writable(root)
    if given not in (None, True):
        if not Path(given).is_dir():
            say(f"resume_from_checkpoint {given} is not a folder; valid: a checkpoint-N folder of a run, or none to "
                 f"resume the newest complete one of {output_dir}. HINT: check the path, or drop the flag")
            raise SystemExit(2)  # on every rank: each was given the same path
        if not incomplete(Path(given)):
            same_world_size(Path(given))
            other = marks.another_run(Path(given))
            say(f"resuming from {given}" + (f", which another run completed ({other}): the script asked for it"
                                            if other else ""))
            return given
    newest = own_newest(root) or previous_start(root)
    if newest is not None:
        same_world_size(newest)
        say(f"resuming from {newest}")
        return str(newest)
    return None if given is True else given


def own_newest(root: Path) -> Path | None:
    """The newest complete checkpoint of `root` that this run wrote (or one written without a run folder's name). A
    newer one another run completed (a different command, or `--new`, with the same --output_dir) is not resumed,
    and one line says so: that run's own command continues it, as the shared trainer's runs keep apart."""
    newest = settle(root)
    if newest is None or (other := marks.another_run(newest)) is None:
        return newest
    mine = next((p for _, p in reversed(marks.checkpoints(root))
                 if p != newest and not incomplete(p) and marks.another_run(p) is None), None)
    say(f"{newest} was completed by another run ({other}), not this one: not resumed, "
        f"{f'resuming {mine}, the newest of this run' if mine else 'this run starts at step 0'}. HINT: that run's own "
        f"command continues it (or --resume_from_checkpoint {newest}); another --output_dir keeps runs apart")
    return mine


_ZERO_SHARD = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def same_world_size(checkpoint: Path) -> None:
    """A DeepSpeed checkpoint (`global_stepN/` inside the Trainer's checkpoint-N) holds one ZeRO shard of the
    optimizer per rank and loads only at the world size that wrote it: at another, DeepSpeed fails on every rank
    after the model is built (or, for some stages, loads a wrong partition). Refused in one line before that."""
    ranks = {m.group(1) for p in checkpoint.glob("global_step*/*") if (m := _ZERO_SHARD.search(p.name))}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks and len(ranks) != world:
        say(f"{checkpoint} holds DeepSpeed ZeRO shards for {len(ranks)} ranks and this start has {world} "
            f"rank{'s' if world != 1 else ''}; valid: the world size that wrote it (DeepSpeed's checkpoints are tied "
            f"to it). HINT: run with {len(ranks)} ranks, or convert it to a universal checkpoint (python -m "
            "deepspeed.checkpoint.ds_to_universal --input_folder CHECKPOINT/global_stepN --output_folder ...) and "
            "resume with \"load_universal_checkpoint\": true in the DeepSpeed config")
        raise SystemExit(2)  # on every rank: each reads the same folder


def skippable(args: Any) -> None:
    """A start that resumes mid-epoch skips the batches the stopped start trained on (the Trainer's own
    `skip_first_batches`); `ignore_data_skip` turns that off, and the resumed epoch would train them again: refused
    on every rank before training, in one line (from rank 0)."""
    if getattr(args, "ignore_data_skip", False):
        say("ignore_data_skip is set: a resumed start would train the stopped epoch's first batches again, so a "
            "requeued run would not go on where it stopped; valid: ignore_data_skip False (the default). HINT: drop "
            "--ignore_data_skip, or run without hpcjobs's hooks (HPCJOBS_HOOKS=0)")
        raise SystemExit(2)


def writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".hpcjobs-probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        say(f"output_dir {root} cannot hold checkpoints ({e.strerror or e}); valid: a folder every rank can write. "
             "HINT: give --output_dir a writable place, e.g. under $HPCJOBS_RUN_DIR")
        raise SystemExit(2) from None


def previous_start(root: Path) -> Path | None:
    """The complete checkpoint this job's earlier start recorded, when it lies in another output folder than this
    start's: a name made anew at each start (a timestamp) would otherwise start the requeued job from zero."""
    run = run_folder()
    record = read_json(run.script_checkpoint) if run else None
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        return None
    path = Path(record["path"])
    if path.parent == root or not (path / COMPLETE).is_file():
        return None
    say(f"output_dir {root} is not where this job's previous start saved ({path.parent}): its name changes every "
         "start (a timestamp?), and a requeued job would start from step 0. HINT: give --output_dir a fixed name")
    return path


# --- the callback ---------------------------------------------------------------------------------------------------

def stop_callback() -> Any:
    from transformers import TrainerCallback

    from trainers.integrations.checks import StepEndGuard

    class StopAtAgreedStep(TrainerCallback):
        """The stop protocol at the Trainer's step ends, and the completion mark after each save."""

        hpcjobs = True

        def __init__(self) -> None:
            self.guard: StepEndGuard | None = None  # made by train() (signals.joined)
            self.stop_step: int | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
            ACCOUNT.begin(state.global_step)  # the step a resume loaded, 0 fresh
            return control

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> Any:
            if isinstance(logs, dict) and isinstance(logs.get("loss"), (int, float)):
                ACCOUNT.logged(state.global_step, logs["loss"])
            return control

        def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
            ACCOUNT.end()
            return control

        def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
            watchdog.progress(state.global_step)
            ACCOUNT.step_done(state.global_step)
            # every rank, every step; a collective at the cadence's steps
            if self.guard is not None and self.guard.step_ended():
                control.should_save, control.should_training_stop, control.should_evaluate = True, True, False
                self.stop_step = state.global_step
            if control.should_save:
                watchdog.saving(state.global_step)  # the evaluation due now is inside the allowance too
                mark_pending(Path(args.output_dir) / f"checkpoint-{state.global_step}")
            return control

        def on_prediction_step(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
            watchdog.alive()  # an evaluation batch: progress, though not a step
            return control

        def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> Any:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            mark_complete(folder, state.global_step)
            watchdog.saved()
            if self.stop_step is not None and self.guard is not None:
                ACCOUNT.end()
                self.guard.requeue_and_exit(state.global_step)
            return control

    return StopAtAgreedStep()
