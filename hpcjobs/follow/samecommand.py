"""The same `hpcjobs submit` command continues its run (issue 37). Every submit used to make a fresh run folder, so
running the same command again after a Ctrl-C, a preemption that was cancelled or a failure trained from step 0
unless the user copied the old run folder into --run-dir. Now a submit without --run-dir and without --new asks the
job store for the newest job of the same command (hpcjobs.request.commandkey) and lets its run folder decide:

- gone (deleted), or no job of the command yet: a fresh run, as before;
- a job of it is still queued or running (the backend's state, or the folder's lock held): refused in one line with
  the job to cancel; a second job on the same folder would mix its checkpoints and logs with the first one's;
- its job finished (final.json): refused in one line, exit 2, nothing written: it says where and at which step, and
  how to train again (--new) or on (--run-dir with more steps);
- otherwise (stopped, failed, cancelled, killed): that run folder is used again, and one line says which and from
  which step, read from the folder's files (the shared trainer's checkpoints/step-N, an integration's
  script-checkpoint.json). The ranks resume there as they do for the same --run-dir.

Sweeps, chains and `render` never look here (hpcjobs.request.spec.build_spec asks only for submit's single jobs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpcjobs.follow.status import status_of
from hpcjobs.jobs.store import JobRecord, JobStore
from hpcjobs.protocol.errors import HpcjobsError, UsageError
from hpcjobs.protocol.folderlock import in_use, read_holder
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.states import FinalState, JobState

NEW_FLAG = "--new"
"""submit's flag for a fresh run of a command that ran before."""


@dataclass(frozen=True)
class Continued:
    """The run folder the same command goes on in, and the one line that says so."""

    run_dir: str
    line: str


def continued_run(key: str, entry_kind: str, store: JobStore | None = None) -> Continued | None:
    """The run folder the command with this key continues; None for a fresh run. UsageError (one line, nothing
    written) when its newest job is still queued or running, or finished."""
    jobs = (store or JobStore()).of_command(key)
    if not jobs:
        return None
    rec = jobs[0]  # the newest job of the command: its run folder decides
    run = RunFolder(rec.run_dir)
    if not run.path.is_dir():
        return None  # deleted: the user threw that run away
    state = _refuse_running(rec, run)
    final = run.final_of(rec.job_id)
    if isinstance(final, dict) and final.get("state") == FinalState.FINISHED:
        raise _finished(rec, final.get("step"), entry_kind)
    step = known_step(run)
    ended = f"job {rec.job_id}, {state.value.lower()}" if state != JobState.UNKNOWN else f"job {rec.job_id}"
    where = f"from step {step}, its newest checkpoint" if step is not None else (
        "from the start: it has no checkpoint yet" if entry_kind == "task" else
        "with no checkpoint hpcjobs knows of: your script goes on from what it saved itself, if anything")
    return Continued(str(run.path), f"hpcjobs: the same command ran before: continuing {run.path} ({ended}) "
                                    f"{where}; {NEW_FLAG} starts a fresh run instead")


def _refuse_running(rec: JobRecord, run: RunFolder) -> JobState:
    """The newest job's state; refused while it (or any job holding the folder) is queued or running."""
    try:
        status = status_of(rec)
        state, source = status.state, status.state_source
    except HpcjobsError as e:
        state, source = JobState.UNKNOWN, e.message
    busy = in_use(run)
    if busy is None and (state.finished or (state == JobState.UNKNOWN and source == "none")):
        return state  # ended, or forgotten by its scheduler and never ended in the folder (killed, lost)
    if busy is None and state == JobState.UNKNOWN:  # its scheduler did not answer: it may still be queued
        raise UsageError(f"the same command's newest job {rec.job_id} (run folder {run.path}) may still be queued "
                         f"or running: hpcjobs cannot tell ({source}); nothing was submitted.",
                         f"`hpcjobs status {rec.job_id}` once the scheduler answers; --run-dir {run.path} continues "
                         f"that run folder now, {NEW_FLAG} starts another run.")
    holder = read_holder(run) if busy else None
    job = str(holder.get("job_id") or rec.job_id) if holder else rec.job_id
    doing = "running" if busy or state == JobState.RUNNING else state.value.lower()
    raise UsageError(f"the same command is still {doing} as job {job} in run folder {run.path}; a second job there "
                     "would mix its checkpoints and logs with that one's, so nothing was submitted.",
                     f"wait for it (`hpcjobs status {job}`), stop it with `hpcjobs cancel {job}` and run this "
                     f"command again to continue it, or add {NEW_FLAG} to start another run beside it.")


def _finished(rec: JobRecord, step: object, entry_kind: str) -> UsageError:
    at = f", at step {step}" if isinstance(step, int) else ""
    if entry_kind == "task":
        more = (f"to train on from step {step}, give more steps in that folder: --run-dir {rec.run_dir} --steps M "
                "--extend (the schedule goes on from the saved LR)" if isinstance(step, int) else
                f"to train on, give more steps with --run-dir {rec.run_dir} --extend")
    else:
        more = (f"to train on, run it in that folder with your script's setting for more steps: --run-dir "
                f"{rec.run_dir} (it resumes from what it saved there)")
    return UsageError(f"the same command already finished in run folder {rec.run_dir} (job {rec.job_id}{at}); "
                      "nothing was submitted, nothing trained again.",
                      f"add {NEW_FLAG} to train it again from the start in a fresh run folder; {more}.")


def known_step(run: RunFolder) -> int | None:
    """The newest complete checkpoint's step the run folder tells of: the shared trainer's (and trainers.checkpoint's,
    a StopGuard script's) checkpoints/step-N, or an integration's script-checkpoint.json (HF Trainer, Lightning,
    accelerate; while the folder it names is there). Files only: the layouts are in hpcjobs.protocol.runfolder."""
    steps = [run.newest_checkpoint()]
    mark = run.read("script_checkpoint")
    if isinstance(mark, dict) and isinstance(mark.get("step"), int) and Path(str(mark.get("path"))).is_dir():
        steps.append(mark["step"])
    return max((s for s in steps if s is not None), default=None)
