"""What every rank runs first, however the job was started (srun in a rendered script, submitit, the local
launcher, torchrun): derive the rank's environment, open its per-restart log, install the stop handler, enforce the
restart cap, then run the entry: a task for the shared trainer, or the user's own script or module.

    python -m trainers.launch --run-dir RUN [--signal USR2] [--max-restarts N] --kind task|script|module -- ENTRY ARGS

Importing this module does not import torch: the submit side pickles SubmititEntry without paying for it.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
import traceback
from typing import Sequence

from hpcjobs.runfolder import RunFolder
from trainers import preemption
from trainers.distenv import DistEnv, from_environ
from trainers.logtee import Tee


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainers.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="the run folder; %%j is replaced by the Slurm job id")
    p.add_argument("--signal", default="USR2", help="the preemption signal Slurm sends (the profile's)")
    p.add_argument("--signal-seconds", type=int, default=90, help="how long before the time limit it comes")
    p.add_argument("--max-restarts", type=int, default=10, help="requeues allowed before the job ends failed")
    p.add_argument("--time-limit", type=int, default=0, help="the job's time limit in seconds (0: unknown)")
    p.add_argument("--kind", choices=("task", "script", "module"), default="task")
    p.add_argument("entry")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def run_entry(kind: str, entry: str, args: list[str], run: RunFolder) -> int:
    if kind == "task":
        from trainers.run import run_task  # torch is imported from here on

        return run_task(entry, args, run)
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
    env: DistEnv = from_environ(os.environ)
    run = RunFolder(ns.run_dir.replace("%j", env.job_id))
    os.environ.update(env.as_env())
    os.environ.update({"HPCJOBS_RUN_DIR": str(run.path), "HPCJOBS_SIGNAL": ns.signal,
                       "HPCJOBS_SIGNAL_SECONDS": str(ns.signal_seconds),
                       "HPCJOBS_MAX_RESTARTS": str(ns.max_restarts), "HPCJOBS_START_TIME": str(time.time()),
                       "HPCJOBS_TIME_LIMIT": str(ns.time_limit)})
    preemption.install(ns.signal)  # after submitit's runner installed its own: ours replace them
    tee = Tee(run.rank_log(env.restart, env.rank))
    try:
        if env.rank == 0:
            run.record_start(env.restart, env.job_id, env.world_size, host=os.uname().nodename,
                             master=f"{env.master_addr}:{env.master_port}")
        print(f"hpcjobs: rank {env.rank}/{env.world_size} (local {env.local_rank}) on {os.uname().nodename}, "
              f"job {env.job_id} restart {env.restart}, rendezvous {env.master_addr}:{env.master_port}, "
              f"run folder {run.path}", flush=True)
        if env.restart > ns.max_restarts:
            msg = f"restart {env.restart} is past the cap of {ns.max_restarts} restarts: not training again"
            print(f"hpcjobs: {msg}. The job ends failed.", flush=True)
            if env.rank == 0:
                run.write_final("failed", msg)
            return 1
        rc = run_entry(ns.kind, ns.entry, list(ns.args), run)
        if rc and not run.final.exists():
            run.write_final("failed", f"rank {env.rank} exited with code {rc}")
        return rc
    except BaseException as e:  # noqa: BLE001 - record why, then let the exit code speak
        traceback.print_exc()
        run.write_final("failed", f"rank {env.rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return 1
    finally:
        preemption.ignore_from_now(ns.signal)  # the work is over: a late signal must not turn it into a failure
        tee.close()


class SubmititEntry:
    """The callable submitit pickles and runs on every task; `checkpoint` only matters if submitit's own handler
    fires before ours is installed: the job is then resubmitted as is and resumes from the run folder."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)

    def __call__(self) -> int:
        rc = main(self.argv)
        if rc:
            raise RuntimeError(f"hpcjobs rank exited with code {rc}; see the run folder's logs")
        return rc

    def checkpoint(self, *args: object, **kwargs: object) -> object:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)


if __name__ == "__main__":
    raise SystemExit(main())
