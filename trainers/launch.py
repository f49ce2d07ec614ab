"""What every rank runs first, however the job was started (srun in a rendered script, submitit, the local
launcher, torchrun): derive the rank's environment, read the launch contract, install the stop handler, take the run
folder's lock (rank 0; trainers.runlock), open its per-restart log, enforce the restart cap, then run the entry: a
task for the shared trainer, or the user's own script or module.

A start is refused (exit 2, one line, final.json left as it was) for a contract or flag that cannot be used, a run
folder another job holds, or a resume under other settings. A rank that fails keeps its traceback in its log file;
the terminal gets one line, and final.json the reason: `rank R: ExcType: message (log: PATH)`.

    python -m trainers.launch --contract JSON --kind task|script|module -- ENTRY ARGS     (as rendered)
    python -m trainers.launch --run-dir RUN [--kind ...] -- ENTRY ARGS                      (by hand: the defaults)

The contract (hpcjobs.contract) is read once here, its run folder resolved from the job's ids and its start time
stamped, then exported as $HPCJOBS_CONTRACT for the rest of the rank (the trainer, StopGuard, child processes).
Importing this module does not import torch: the submit side pickles SubmititEntry without paying for it.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from hpcjobs.contract import ContractError, LaunchContract
from hpcjobs.runfolder import RunDirPatternError, RunFolder, append_jsonl
from hpcjobs.states import FinalState
from hpcjobs.sweep import Point, as_args
from trainers import preemption, runlock, startup
from trainers.config import ConfigError, TaskArgError
from trainers.distenv import COLLECTIVE_TIMEOUT, INIT_TIMEOUT, DistEnv, DistEnvError, from_environ, setting_seconds
from trainers.logtee import Tee
from trainers.versions import TorchTooOld, require_torch

KINDS = ("task", "script", "module")
REFUSED_EXIT = 2
"""Exit code of a refused start: a contract or environment that cannot be read, a run folder another job holds, a
trainer or task flag that cannot be used, a resume under other settings. A usage error, like argparse's, not a
training failure: final.json is left as it was (except for a task flag, see `fail`)."""
BAD_CONTRACT_EXIT = REFUSED_EXIT


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainers.launch", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--contract", help="the launch contract as JSON, as the submit side renders it")
    source.add_argument("--run-dir", help="by hand: this run folder (%%j, %%A, %%a resolved from the job's ids) "
                                          "with the default preemption settings and no known time limit")
    p.add_argument("--kind", choices=KINDS, default="task")
    p.add_argument("entry")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def read_contract(ns: argparse.Namespace) -> LaunchContract:
    """The contract as given (not yet started); raises ContractError."""
    if ns.contract is not None:
        return LaunchContract.from_json(ns.contract)
    if not ns.run_dir:
        raise ContractError("--run-dir is empty; valid: a folder, e.g. --run-dir runs/mine")
    return LaunchContract(run_dir=ns.run_dir)


def start_contract(contract: LaunchContract, env: DistEnv, environ: Mapping[str, str], now: float,
                   ) -> LaunchContract:
    """This rank's copy: the run folder resolved with the distenv's job id visible (HPCJOBS_JOB_ID stands for %j
    where Slurm gives none: a local run, torchrun), the start time stamped. Raises ContractError."""
    try:
        return contract.started({**environ, **env.as_env()}, now)
    except RunDirPatternError as e:
        raise ContractError(str(e)) from None


def run_entry(kind: str, entry: str, args: list[str], run: RunFolder, contract: LaunchContract) -> int:
    if kind == "task":
        from trainers.run import run_task  # torch is imported from here on

        return run_task(entry, args, run, contract)
    sys.argv = [entry, *args]
    try:
        if kind == "script":
            sys.path.insert(0, os.path.dirname(entry))
            runpy.run_path(entry, run_name="__main__")
        else:
            runpy.run_module(entry, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr, flush=True)  # as Python itself does for sys.exit("message")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        require_torch()
        for setting in (INIT_TIMEOUT, COLLECTIVE_TIMEOUT):  # a typo refused now, not after the first step
            setting_seconds(setting, os.environ)
        env: DistEnv = from_environ(os.environ)
        contract = start_contract(read_contract(ns), env, os.environ, startup.launched_at())
        point = contract.point(os.environ)
        ns.args = [*ns.args, *as_args(point or ())]  # a sweep's task: its point's flags after the entry's own
    except (ContractError, DistEnvError, TorchTooOld) as e:
        print(f"hpcjobs: {one_line(e)}", file=sys.stderr, flush=True)
        return REFUSED_EXIT
    os.environ.update(env.as_env())
    contract.export()
    run = RunFolder(contract.run_dir)
    preemption.install(contract)  # after submitit's runner installed its own: ours replace them
    refused = claim_run_folder(run, env)
    if refused is not None:
        return refused
    tee = Tee(run.rank_log(env.restart, env.rank))
    try:
        return run_rank(ns, env, run, contract, point)
    except ConfigError as e:  # a refused start (a flag, a resume that would not continue the run): not a run's end
        say(env, tee, f"hpcjobs: {one_line(e)}")
        return REFUSED_EXIT
    except BaseException as e:  # noqa: BLE001 - record why, then let the exit code speak
        return fail(e, env, run, tee)
    finally:
        preemption.ignore_from_now(contract)  # the work is over: a late signal must not turn it into a failure
        tee.close()
        # The exit of a process that imported torch collects every object it ever made: ~0.6 s of CPU on each rank
        # at the end of every start, paid by all ranks of a node at once (and by a requeue, whose next start waits
        # for every rank to leave). What is left is freed by the OS; the atexit handlers still run.
        atexit.register(gc.freeze)


def claim_run_folder(run: RunFolder, env: DistEnv) -> int | None:
    """Rank 0 locks the run folder (held until the process exits, however it exits); the other ranks write nothing
    there until their rank 0 holds it. Returns the exit code of a refused start, None to go on."""
    if env.rank == 0:
        try:
            _held.append(runlock.take(run, env))
        except (runlock.RunFolderBusy, runlock.RunFolderUnwritable) as e:
            print(f"hpcjobs: {e}", file=sys.stderr, flush=True)
            return REFUSED_EXIT
        return None
    wait = min(setting_seconds(INIT_TIMEOUT, os.environ), runlock.WAIT_FOR_RANK0_S)
    if runlock.wait_for_rank0(run, env, wait, preemption.signalled) or not preemption.signalled():
        return None  # rank 0 holds the folder, or is late: the rendezvous waits for it and says so if it never comes
    return REFUSED_EXIT  # stopped before it began (its rank 0 was refused and the launcher stops the rest): quiet


_held: list[runlock.RunLock] = []
"""The run folder's lock, open for the life of the process (the kernel releases it when the process ends)."""


def one_line(e: BaseException, limit: int = 500) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "…"


def say(env: DistEnv, tee: Tee, line: str) -> None:
    """One line for a refused start: rank 0 prints it (terminal and log); the others, whose line would be the same,
    only log it."""
    if env.rank == 0:
        print(line, file=sys.stderr, flush=True)
    else:
        tee.log_only(line)


def fail(e: BaseException, env: DistEnv, run: RunFolder, tee: Tee) -> int:
    """A rank failed: its traceback goes into its log file only, final.json's reason says which rank, what and where
    the log is, and the terminal gets one line: from rank 0, or from the rank whose failure is the one recorded. A
    task flag is the same on every rank: rank 0 speaks for all."""
    log_path = run.rank_log(env.restart, env.rank)
    tee.log_only(traceback.format_exc())
    line = f"hpcjobs: rank {env.rank} failed: {describe_failure(e)} (traceback in {log_path})"
    same_everywhere = isinstance(e, TaskArgError) and env.rank != 0
    recorded = False if same_everywhere else record_rank_failure(e, env, run)
    first = run.read("final")
    if env.rank == 0 and not recorded and failed_in_this_start(first, env, run):
        # Most likely it failed because another rank did (a collective whose peer left): point at that one.
        line = f"hpcjobs: rank 0 failed ({one_line(e, 150)}) after the job's first failure: {first['reason']}"
    if env.rank == 0 or recorded:
        print(line, file=sys.stderr, flush=True)
    else:
        tee.log_only(line)
    return REFUSED_EXIT if isinstance(e, TaskArgError) else 1


def describe_failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {one_line(e)}" if str(e).strip() else type(e).__name__


def record_rank_failure(e: BaseException, env: DistEnv, run: RunFolder) -> bool:
    """Record `e` as this start's failure (see record_failure), once per exception; True if it is the one recorded.
    trainers.run calls it before the process group goes, so the peers that fail because this rank left find the
    first failure already written."""
    known = getattr(e, "_hpcjobs_recorded", None)
    if known is None:
        log_path = run.rank_log(env.restart, env.rank)
        append_jsonl(run.failures, {"time": time.time(), "job_id": env.job_id, "restart": env.restart,
                                    "rank": env.rank, "host": os.uname().nodename, "error": describe_failure(e),
                                    "log": str(log_path)})
        known = record_failure(run, env, f"rank {env.rank} on {os.uname().nodename}: {describe_failure(e)} (log: "
                                         f"{log_path})")
        with contextlib.suppress(AttributeError):
            e._hpcjobs_recorded = known  # type: ignore[attr-defined]
    return bool(known)


def record_failure(run: RunFolder, env: DistEnv, reason: str) -> bool:
    """final.json says the job failed, and why; True if this call wrote it. The first failure of a start wins (a
    rank whose peer died fails next, for that reason alone), and an earlier start's `finished` is never replaced: a
    start that trains again removes it first (trainers.trainer), so only a failure of a start that never trained is
    left out. This start's own `finished` (an own script's rank 0 exited 0 first) gives way to its failure."""
    final = run.read("final")
    mine = final_of_this_start(final, env, run)
    finished_before = mine is None and isinstance(final, dict) and final.get("state") == str(FinalState.FINISHED)
    if finished_before or mine == str(FinalState.FAILED):
        return False
    run.write_final(FinalState.FAILED, reason, job_id=env.job_id)
    return True


def failed_in_this_start(final: Any, env: DistEnv, run: RunFolder) -> bool:
    return final_of_this_start(final, env, run) == str(FinalState.FAILED)


def final_of_this_start(final: Any, env: DistEnv, run: RunFolder) -> str | None:
    """final.json's state if this start of this job wrote it, else None: its job id, written since the start took
    the run folder's lock (job ids repeat: a plain `python -m trainers` is job 0 every time, and the lock keeps
    starts apart). The lock's time is rank 0's clock, taken before anything of the start happens."""
    holder = runlock.read_holder(run)
    if holder is not None and runlock.same_start(holder, env):
        since = float(holder["time"])
    else:  # a rank 0 that never took it (late, or a filesystem that cannot lock): this rank's own start
        contract = LaunchContract.current()
        since = contract.start_time if contract else 0.0
    if isinstance(final, dict) and final.get("job_id") == env.job_id and float(final.get("time") or 0) >= since:
        return str(final.get("state"))
    return None


def run_rank(ns: argparse.Namespace, env: DistEnv, run: RunFolder, contract: LaunchContract,
             point: Point | None = None) -> int:
    """Record the start, refuse a start past the restart cap, run the entry; returns the rank's exit code."""
    if env.rank == 0:
        run.record_start(env.restart, env.job_id, env.world_size, host=os.uname().nodename,
                         master=f"{env.master_addr}:{env.master_port}", **({"point": dict(point)} if point else {}))
    print(f"hpcjobs: rank {env.rank}/{env.world_size} (local {env.local_rank}) on {os.uname().nodename}, "
          f"job {env.job_id} restart {env.restart}, rendezvous {env.master_addr}:{env.master_port}, "
          f"run folder {run.path}", flush=True)
    cap = contract.preemption.max_restarts
    if env.requeues > cap:
        msg = f"restart {env.requeues} is past the cap of {cap} restarts: not training again"
        print(f"hpcjobs: {msg}. The job ends failed.", flush=True)
        if env.rank == 0:
            run.write_final(FinalState.FAILED, msg, job_id=env.job_id)
        return 1
    rc = run_entry(ns.kind, ns.entry, list(ns.args), run, contract)
    if rc:
        record_failure(run, env, f"rank {env.rank} exited with code {rc} (log: {run.rank_log(env.restart, env.rank)})")
    elif env.rank == 0 and ns.kind != "task" and preemption.first_request() is None:
        # A user's own script has no trainer to say it finished: its rank 0 exiting 0, unasked to stop, does.
        run.write_final(FinalState.FINISHED, f"{ns.kind} {ns.entry} exited 0", job_id=env.job_id)
    return rc


class SubmititEntry:
    """The callable submitit pickles and runs on every task; `checkpoint` only matters if submitit's own handler
    fires before ours is installed: the job is then resubmitted as is and resumes from the run folder."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)

    def __call__(self) -> int:
        # submitit's runner handles SIGCONT only to log "Bypassing signal SIGCONT" into the rank's log, twice a stop
        # (measured: `scancel --signal=USR2`); its default action, continuing, is all a rank needs.
        signal.signal(signal.SIGCONT, signal.SIG_DFL)
        rc = main(self.argv)
        if rc:
            raise RuntimeError(f"hpcjobs rank exited with code {rc}; see the run folder's logs")
        return rc

    def checkpoint(self, *args: object, **kwargs: object) -> object:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)


if __name__ == "__main__":
    raise SystemExit(main())
