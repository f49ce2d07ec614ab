"""Lightning's `Trainer` under hpcjobs's stop protocol, with no line of the user's script changed.

Attached when the script imports `lightning.pytorch.trainer.trainer` or `pytorch_lightning.trainer.trainer`
(trainers/integrations/__init__.py):

- Lightning's own stop handling is off: no SIGUSR1 auto-requeue of its SLURMEnvironment, no SIGTERM handler (which
  ran a collective inside the handler), no per-batch broadcast of that SIGTERM flag. During `fit()` hpcjobs's
  handlers hold SIGINT, SIGTERM and the profile's signal; after `fit()` returns, the script's own handlers are back
  (Ctrl-C, SIGTERM and cancel stop the code after fit() as usual).
- The hang watchdog (trainers/watchdog.py) is armed for the length of `fit()`: each training batch end marks
  progress, a checkpoint being saved (any callback's) has the save allowance until the next batch end, each
  validation batch counts as progress.
- At the training batch ends the cadence names (trainers/integrations/checks.py, as for the Hugging Face Trainer:
  every batch end over a start's first 12, then about once a second of training) the ranks agree whether any of
  them was asked to stop. When one was, that batch's state is
  saved with `trainer.save_checkpoint` into `RUN/checkpoints/lightning/checkpoint-N/` (N: the global step) with the
  pending and completion marks of trainers/integrations/marks.py, plus each rank's position and RNG streams; the
  validation due at that batch is skipped; rank 0 requeues (on Slurm, when the stop came from the profile's signal)
  and every rank exits 0: nothing after `fit()` runs. A stop that lands where a checkpoint could not resume exactly
  (inside a gradient accumulation, on an epoch's last batch, on the last step) waits for the next batch end that
  can, or for the end of training.
- `fit()` given no `ckpt_path` resumes the newest complete one of those checkpoints (an incomplete one is moved
  aside with one line). Lightning restores its loop counters but would read the interrupted epoch's data again from
  its first batch; here each training DataLoader's index sampler skips the batches the stopped start had consumed,
  drawn in the same order (the sampler's epoch is set first and its RNG state at the epoch's first batch is
  restored for the draw), and the rank's RNG streams are put back as they were at the stop: losses step by step
  and final weights equal an uninterrupted run's (tests/test_lightning.py). Not exact, said in one line at resume:
  an IterableDataset (nothing to skip by index: its epoch starts over), random transforms inside DataLoader workers
  (their seeds are drawn anew).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from pathlib import Path
from types import ModuleType
from typing import Any

from trainers import watchdog
from trainers.integrations.account import ACCOUNT
from trainers.integrations.marks import mark_complete, mark_pending, rank, run_folder, say, settle
from trainers.integrations.signals import joined

CKPT = "lightning.ckpt"
"""The Lightning checkpoint's file inside `checkpoint-N/`."""
FOLDER = "lightning"
"""Under the run folder's checkpoints/: hpcjobs's stop checkpoints of a Lightning script."""


def attach(module: ModuleType) -> None:
    """Wrap the module's Trainer (once): Lightning's own requeue off and the callback in __init__, the resume and
    the protocol's signals in fit()."""
    trainer_cls = module.Trainer
    if getattr(trainer_cls, "_hpcjobs_attached", False):
        return
    package = module.__name__.removesuffix(".trainer.trainer")  # lightning.pytorch or pytorch_lightning
    original_init, original_fit = trainer_cls.__init__, trainer_cls.fit
    signature = inspect.signature(original_fit)

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        own_stop_handling_off(self)
        self.callbacks.append(stop_callback(package))

    @functools.wraps(original_fit)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        callback = next((c for c in self.callbacks if getattr(c, "hpcjobs", False)), None)
        if callback is None:  # the script replaced the trainer's callbacks: Lightning as it is
            return original_fit(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        callback.resume_from = None
        if bound.arguments.get("ckpt_path") is None:
            newest = settle(checkpoint_root(self))
            if newest is not None:
                say(f"resuming from {newest}")
                bound.arguments["ckpt_path"], callback.resume_from = str(newest / CKPT), newest
                if "weights_only" in signature.parameters and bound.arguments.get("weights_only") is None:
                    bound.arguments["weights_only"] = False  # hpcjobs's own file; Lightning said so once a rank
        with joined(callback), watchdog.armed():  # the protocol's handlers and the hang watchdog, for fit()
            return original_fit(*bound.args, **bound.kwargs)

    trainer_cls.__init__, trainer_cls.fit = __init__, fit
    trainer_cls._hpcjobs_attached = True


def own_stop_handling_off(trainer: Any) -> None:
    """Only one protocol acts: Lightning's SLURMEnvironment would requeue on SIGUSR1 by itself, and its SIGTERM
    handler (a broadcast inside a signal handler) and per-batch broadcast of that flag would race ours."""
    environment = trainer._accelerator_connector.cluster_environment
    if hasattr(environment, "auto_requeue"):
        environment.auto_requeue = False
    trainer._signal_connector.register_signal_handlers = lambda: None
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


def checkpoint_root(trainer: Any) -> Path:
    """The run folder's checkpoints/lightning (a run's own: the same command with the same --run-dir resumes it);
    outside a launched rank, the trainer's default_root_dir."""
    run = run_folder()
    return run.checkpoints / FOLDER if run else Path(trainer.default_root_dir) / "hpcjobs-checkpoints"


# --- the callback ---------------------------------------------------------------------------------------------------

def stop_callback(package: str) -> Any:
    base = importlib.import_module(f"{package}.callbacks").Callback

    class StopAtAgreedBatch(base):  # type: ignore[misc, valid-type]
        """The stop protocol at each training batch end; the exact mid-epoch resume at the train start."""

        hpcjobs = True

        def __init__(self) -> None:
            self.guard: Any = None
            self.resume_from: Path | None = None
            self.asked = False
            self.saved: tuple[Path, int] | None = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            from trainers.integrations.lightning_data import position, rewind

            stop_after_batch_end(trainer, self)
            rewind(trainer, position(self.resume_from, rank()) if self.resume_from else None)
            ACCOUNT.begin(trainer.global_step)  # the step a resume loaded, 0 fresh

        def on_train_end(self, trainer: Any, *_: Any) -> None:
            ACCOUNT.end()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            watchdog.progress(trainer.global_step)  # a batch, not always a step: its time is what is measured
            ACCOUNT.step_done(trainer.global_step)
            every = max(1, getattr(trainer, "log_every_n_steps", 1) or 1)
            if rank() == 0 and trainer.global_step % every == 0:  # callback_metrics is built when read: not each batch
                loss = (getattr(trainer, "callback_metrics", None) or {}).get("loss")  # the script's self.log("loss")
                if loss is not None:
                    ACCOUNT.logged(trainer.global_step, float(loss))
            self.asked |= self.guard.step_ended()  # every rank, every batch; a collective at the cadence's batches
            if not self.asked or self.saved or not resumable_here(trainer):
                return
            from trainers.integrations.lightning_data import save_position

            folder = checkpoint_root(trainer) / f"checkpoint-{trainer.global_step}"
            mark_pending(folder)
            trainer.save_checkpoint(folder / CKPT)
            save_position(trainer, folder / f"hpcjobs-rank-{rank()}.pt")
            trainer.fit_loop.epoch_loop._skip_next_val = True  # no validation on a stop, as for the HF Trainer
            self.saved = (folder, trainer.global_step)

        def on_validation_batch_end(self, *_: Any, **__: Any) -> None:
            watchdog.alive()  # progress, though not a step

        def on_save_checkpoint(self, trainer: Any, *_: Any, **__: Any) -> None:
            watchdog.saving(trainer.global_step)  # in flight until the next batch end

        def after_batch(self) -> None:
            """After Lightning finished the batch (its metrics are with the loggers): complete the stop's save,
            requeue (rank 0) and exit, every rank."""
            if self.saved is not None:
                folder, step = self.saved
                mark_complete(folder, step)
                ACCOUNT.end()
                self.guard.requeue_and_exit(step)

    return StopAtAgreedBatch()


def stop_after_batch_end(trainer: Any, callback: Any) -> None:
    """Call `callback.after_batch()` once the epoch loop is done with a batch (on_advance_end: metrics logged,
    plateau schedulers stepped), on this trainer's loop only."""
    loop = trainer.fit_loop.epoch_loop
    original = vars(loop).get("_hpcjobs_on_advance_end") or loop.on_advance_end
    loop._hpcjobs_on_advance_end = original

    def on_advance_end(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        callback.after_batch()

    loop.on_advance_end = on_advance_end


def resumable_here(trainer: Any) -> bool:
    """Whether a checkpoint taken at this batch end resumes exactly: not inside a gradient accumulation (the
    accumulated gradients are not saved), not on the epoch's last batch (Lightning's resume would skip that
    epoch's end: its epoch schedulers and hooks), not on the last step (training is over: it just ends)."""
    loop = trainer.fit_loop.epoch_loop
    progress = loop.batch_progress
    if progress.is_last_batch or progress.current.ready >= trainer.num_training_batches:
        return False
    if 0 <= trainer.max_steps <= trainer.global_step:
        return False
    return not loop._should_accumulate()

