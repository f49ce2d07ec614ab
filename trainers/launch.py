"""What every rank runs first, however the job was started (srun in a rendered script, submitit, the local
launcher, torchrun): derive the rank's environment, read the launch contract, open its per-restart log, install the
stop handler, enforce the restart cap, then run the entry: a task for the shared trainer, or the user's own script
or module.

    python -m trainers.launch --contract JSON --kind task|script|module -- ENTRY ARGS     (as rendered)
    python -m trainers.launch --run-dir RUN [--kind ...] -- ENTRY ARGS                      (by hand: the defaults)

The contract (hpcjobs.contract) is read once here, its run folder resolved from the job's ids and its start time
stamped, then exported as $HPCJOBS_CONTRACT for the rest of the rank (the trainer, StopGuard, child processes).
Importing this module does not import torch: the submit side pickles SubmititEntry without paying for it.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
import traceback
from collections.abc import Mapping, Sequence

from hpcjobs.contract import ContractError, LaunchContract
from hpcjobs.runfolder import RunDirPatternError, RunFolder
from hpcjobs.states import FinalState
from trainers import preemption
from trainers.distenv import DistEnv, from_environ
from trainers.logtee import Tee

KINDS = ("task", "script", "module")
BAD_CONTRACT_EXIT = 2
"""Exit code of a rank whose contract cannot be read: a usage error, like argparse's, not a training failure."""


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
    env: DistEnv = from_environ(os.environ)
    try:
        contract = start_contract(read_contract(ns), env, os.environ, time.time())
    except ContractError as e:
        print(f"hpcjobs: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return BAD_CONTRACT_EXIT
    os.environ.update(env.as_env())
    contract.export()
    run = RunFolder(contract.run_dir)
    preemption.install(contract)  # after submitit's runner installed its own: ours replace them
    tee = Tee(run.rank_log(env.restart, env.rank))
    try:
        return run_rank(ns, env, run, contract)
    except BaseException as e:  # noqa: BLE001 - record why, then let the exit code speak
        traceback.print_exc()
        run.write_final(FinalState.FAILED,
                        f"rank {env.rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        return 1
    finally:
        preemption.ignore_from_now(contract)  # the work is over: a late signal must not turn it into a failure
        tee.close()


def run_rank(ns: argparse.Namespace, env: DistEnv, run: RunFolder, contract: LaunchContract) -> int:
    """Record the start, refuse a start past the restart cap, run the entry; returns the rank's exit code."""
    if env.rank == 0:
        run.record_start(env.restart, env.job_id, env.world_size, host=os.uname().nodename,
                         master=f"{env.master_addr}:{env.master_port}")
    print(f"hpcjobs: rank {env.rank}/{env.world_size} (local {env.local_rank}) on {os.uname().nodename}, "
          f"job {env.job_id} restart {env.restart}, rendezvous {env.master_addr}:{env.master_port}, "
          f"run folder {run.path}", flush=True)
    cap = contract.preemption.max_restarts
    if env.restart > cap:
        msg = f"restart {env.restart} is past the cap of {cap} restarts: not training again"
        print(f"hpcjobs: {msg}. The job ends failed.", flush=True)
        if env.rank == 0:
            run.write_final(FinalState.FAILED, msg)
        return 1
    rc = run_entry(ns.kind, ns.entry, list(ns.args), run, contract)
    if rc and not run.final.exists():
        run.write_final(FinalState.FAILED, f"rank {env.rank} exited with code {rc}")
    return rc


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
