"""What every rank runs first, however the job was started (srun in a rendered script, submitit, the local
launcher, torchrun): derive the rank's environment, read the launch contract, install the stop handler, take the run
folder's lock (rank 0; trainers.runlock), open its per-restart log, enforce the restart cap, then run the entry: a
task for the shared trainer, or the user's own script or module.

A start is refused (exit 2, one line, final.json left as it was) for a contract or flag that cannot be used, a run
folder another job holds, or a resume under other settings. A rank that fails keeps its traceback in its log file;
the terminal gets one line, and final.json the reason: `rank R: ExcType: message (log: PATH)`.

    python -m trainers.launch --contract JSON --kind task|script|module -- ENTRY ARGS     (as rendered)
    python -m trainers.launch --run-dir RUN [--kind ...] -- ENTRY ARGS                      (by hand: the defaults)

The contract (hpcjobs.protocol.contract) is read once here, its run folder resolved from the job's ids and its start
time stamped, then exported as $HPCJOBS_CONTRACT for the rest of the rank (the trainer, StopGuard, child processes).
Importing this module does not import torch: submitit's callable (hpcjobs.protocol.nodecall) imports it first.
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
from pathlib import Path

from hpcjobs.protocol import access, rejoin, userstop
from hpcjobs.protocol.contract import ContractError, LaunchContract
from hpcjobs.protocol.errors import StartRefused
from hpcjobs.protocol.faultpolicy import restartcap
from hpcjobs.protocol.faultpolicy.recoverable import REFUSED_EXIT
from hpcjobs.protocol.points import Point, as_args
from hpcjobs.protocol.runfolder import RunDirPatternError, RunFolder
from hpcjobs.protocol.settings.taskargs import TaskArgError
from hpcjobs.protocol.states import FinalState
from hpcjobs.protocol.timeouts import COLLECTIVE_TIMEOUT, INIT_TIMEOUT
from trainers import integrations, preemption, ranklog, runlock, standby, startup, tiersweep
from trainers.distenv import DistEnv, from_environ, setting_seconds
from trainers.failures import describe_failure, failed_in_this_start, one_line, record_failure, record_rank_failure
from trainers.logtee import Tee
from trainers.versions import require_torch

KINDS = ("task", "script", "module")
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


def run_entry(kind: str, entry: str, args: list[str], run: RunFolder, contract: LaunchContract,
              env: DistEnv | None = None) -> int:
    if kind == "task":
        from trainers.run import run_task  # torch is imported from here on

        return run_task(entry, args, run, contract, env, again=lambda e: started_again(e, run))
    sys.argv = [entry, *args]
    enter_submit_dir(contract.submit_dir)
    try:
        # A user's Trainer joins the stop protocol (HPCJOBS_HOOKS=0: left as it is); a bad HPCJOBS_STOP_CHECK_EVERY
        # exits 2 here, as the script's own refusals do.
        integrations.install()
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
    finally:
        end_process_group()
    return 0


def started_again(env: DistEnv, run: RunFolder) -> None:
    """A rank that kept its process through a peer's replacement (trainers.rejoin) begins the launcher's new start
    `env.restart`: that start's log file, its start-up stages from now, and (rank 0) its record in restarts.jsonl,
    as a start in a new process would write them."""
    os.environ["HPCJOBS_RESTART"] = str(env.restart)
    startup.again(time.time())
    if Tee.active is not None:
        Tee.active.switch(run.rank_log(env.restart, env.rank))
    if env.rank == 0:
        for lock in _held:
            runlock.restate(lock, env)  # the new start's other ranks wait until their rank 0 holds the folder
        run.record_start(env.restart, env.job_id, env.world_size, host=os.uname().nodename,
                         master=f"{env.master_addr}:{env.master_port}", **replaced(run))


def replaced(run: RunFolder) -> dict[str, list[int]]:
    """A start record's word on a start that replaced lost ranks in place (hpcjobs.protocol.rejoin): which ranks
    are new processes (the others kept theirs); nothing for a start of every rank."""
    call = rejoin.read_call(run) if rejoin.on() else None
    return {"replaced": list(call.ranks)} if call is not None else {}


def enter_submit_dir(folder: str) -> None:
    """Run a user's script where it was submitted from: its relative paths (`--output_dir out`) land where the user
    meant, never inside the code snapshot the rank started in (they did, unsaid). The code stays the snapshot's:
    sys.path[0] is already the snapshot's folder (absolute, from `python -m`) and a script's own folder is put
    first by run_entry. A folder this node cannot enter (not shared with it) leaves the rank where it is, said."""
    if not folder:
        return
    try:
        os.chdir(folder)
    except OSError as e:
        ranklog.say(f"hpcjobs: the folder the job was submitted from, {folder}, cannot be entered here ({e.strerror}): "
                    f"the script runs in its code snapshot {os.getcwd()}, and relative paths land there",
                    every_rank=True)


def end_process_group() -> None:
    """Destroy the default process group a user's script left open, however the script ended. Left to the
    interpreter's exit, the group's threads are torn down in whatever order the process's destructors run: on the
    test cluster 1 of 8 such jobs had a rank abort after training ("terminate called without an active exception"),
    and the job ended FAILED. The shared trainer ends its own group (trainers.dist). Imports nothing: a script that
    never imported torch.distributed has no group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    with contextlib.suppress(Exception):  # a group already broken (a peer died): the exit code says what happened
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def wait_as_spare(ns: argparse.Namespace, spare: str, launcher: int) -> None:
    """A warm spare (hpcjobs.protocol.rejoin.SPARE_ENV): import what a rank of this entry imports, then wait until
    the launcher (pid `launcher`) makes this process a lost rank's replacement; its start begins then
    (startup.again). Ended by the launcher with the job when it was never needed, and gone with it.

    Until assigned it is nobody's rank: every stop signal takes its default action, set before the imports (on the
    local backend a spare was seen with SIGTERM and USR2 ignored, so the SIGTERM of its launcher's death, PDEATHSIG,
    was lost and it waited for ever, holding the job's output pipe); and it leaves once its parent is not the launcher
    that started it (a launcher that died before the spare could hear of it)."""
    import importlib

    for num in signal.Signals:  # the stop signals: TERM, HUP, INT and the user signals a profile may choose
        if num.name in ("SIGTERM", "SIGHUP", "SIGINT") or num.name.startswith("SIGUSR"):
            signal.signal(num, signal.SIG_DFL)
    if os.getppid() != launcher:
        raise SystemExit(0)

    import torch  # noqa: F401 - the import a replacement would otherwise wait for

    import trainers.run  # noqa: F401
    if ns.kind == "task":
        with contextlib.suppress(Exception):  # loaded again (and judged) by the rank as usual
            importlib.import_module(ns.entry)
    assigned = rejoin.await_assignment(Path(spare), gone=lambda: os.getppid() != launcher)
    if assigned is None:
        raise SystemExit(0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(assigned)
    startup.again(time.time())


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    if spare := os.environ.pop(rejoin.SPARE_ENV, ""):
        wait_as_spare(ns, spare, int(os.environ.pop(rejoin.LAUNCHER_ENV, "0")))
    try:
        require_torch()
        for setting in (INIT_TIMEOUT, COLLECTIVE_TIMEOUT):  # a typo refused now, not after the first step
            setting_seconds(setting, os.environ)
        env: DistEnv = from_environ(os.environ)
        contract = start_contract(read_contract(ns), env, os.environ, startup.launched_at())
        point = contract.point(os.environ)
        ns.args = [*ns.args, *as_args(point or ())]  # a sweep's task: its point's flags after the entry's own
    except StartRefused as e:
        ranklog.warn(f"hpcjobs: {one_line(e)}", every_rank=True)
        return REFUSED_EXIT
    preemption.choose(env.job)  # the start's job environment, before os.environ gets a launcher's RANK/WORLD_SIZE
    os.environ.update(env.as_env())
    contract.export()
    access.tighten(access.node_umask(os.environ))  # what this rank makes: the owner's (or the group's) alone
    run = RunFolder(contract.run_dir)
    if ns.kind == "task":  # after submitit's runner installed its own: ours replace them
        # The shared trainer takes part in the stop protocol from its start (the launcher knows it by the entry's
        # kind: nothing to announce, and a start its run folder refuses below writes nothing there).
        preemption.install(contract, announce=False)
    else:
        standby.stand_by(contract)  # a user's entry joins only if it makes a StopGuard: its signals' usual meaning
    refused = claim_run_folder(run, env)
    if refused is not None:
        return refused
    tee = Tee(run.rank_log(env.restart, env.rank))
    ranklog.log_only_to(tee.log_only)  # the lines the rank filter keeps off the terminal: this rank's log file
    tiersweep.at_start(env)  # local rank 0: this user's tier folders of jobs that ended without removing them
    try:
        return run_rank(ns, env, run, contract, point)
    except StartRefused as e:  # a refused start (a flag, a resume that would not continue the run): not a run's end
        ranklog.warn(f"hpcjobs: {one_line(e)}", rank=env.rank)  # the others' line, the same: their log only
        return REFUSED_EXIT
    except KeyboardInterrupt as e:
        if preemption.joined():  # raised by the trainer's or StopGuard script's own code: a failure, as before
            return fail(e, env, run, tee)
        return interrupted(env, run, tee, contract)
    except BaseException as e:  # noqa: BLE001 - record why, then let the exit code speak
        return fail(e, env, run, tee)
    finally:
        preemption.ignore_from_now(contract)  # the work is over: a late signal must not turn it into a failure
        standby.disarm()  # nor a late deadline into a requeue
        ranklog.log_only_to(None)
        tee.close()
        # The exit of a process that imported torch collects every object it ever made: ~0.6 s of CPU on each rank
        # at the end of every start, paid by all ranks of a node at once (and by a requeue, whose next start waits
        # for every rank to leave). What is left is freed by the OS; the atexit handlers still run.
        atexit.register(gc.freeze)


INTERRUPTED_EXIT = 128 + signal.SIGINT
"""Exit code of a script that does not take part in the stop protocol, stopped by Ctrl-C: a shell's for SIGINT."""


def interrupted(env: DistEnv, run: RunFolder, tee: Tee, contract: LaunchContract) -> int:
    """A script that does not take part in the stop protocol was stopped (Ctrl-C, which the local launcher passes
    on as the profile's signal, a SIGINT to the rank) and its KeyboardInterrupt has unwound: one line from rank 0
    saying that hpcjobs saved nothing, the traceback in the log, the stop in restarts.jsonl (the job shows STOPPED,
    not FAILED), and a shell's exit code for Ctrl-C."""
    tee.log_only(traceback.format_exc())
    first = preemption.first_request()
    by = userstop.asked_by(run, os.environ.get("HPCJOBS_JOB_ID")) or (first[0] if first else "SIGINT")
    if env.rank == 0:
        reason = preemption.stop_reason(contract, unasked=True)
        run.record_stop(str(reason), -1, env.restart, signal=by, saved_by_hpcjobs=False)
    ranklog.warn(f"hpcjobs: stopped by {by}: this script has not joined hpcjobs's stop protocol (no StopGuard), so "
                 "it stopped at once and hpcjobs saved nothing; run again, it goes on only from what it saved itself",
                 rank=env.rank)
    return INTERRUPTED_EXIT


def claim_run_folder(run: RunFolder, env: DistEnv) -> int | None:
    """Rank 0 locks the run folder (held until the process exits, however it exits); the other ranks write nothing
    there until their rank 0 holds it. Returns the exit code of a refused start, None to go on."""
    if env.rank == 0:
        try:
            _held.append(runlock.take(run, env))
        except (runlock.RunFolderBusy, runlock.RunFolderUnwritable) as e:
            ranklog.warn(f"hpcjobs: {e}", rank=env.rank)
            return REFUSED_EXIT
        return None
    wait = min(setting_seconds(INIT_TIMEOUT, os.environ), runlock.WAIT_FOR_RANK0_S)
    if runlock.wait_for_rank0(run, env, wait, preemption.signalled) or not preemption.signalled():
        return None  # rank 0 holds the folder, or is late: the rendezvous waits for it and says so if it never comes
    return REFUSED_EXIT  # stopped before it began (its rank 0 was refused and the launcher stops the rest): quiet


_held: list[runlock.RunLock] = []
"""The run folder's lock, open for the life of the process (the kernel releases it when the process ends)."""


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
    ranklog.warn(line, every_rank=recorded, rank=env.rank)  # another rank's: its log only
    return REFUSED_EXIT if isinstance(e, TaskArgError) else 1


def run_rank(ns: argparse.Namespace, env: DistEnv, run: RunFolder, contract: LaunchContract,
             point: Point | None = None) -> int:
    """Record the start, refuse a start past the restart cap, run the entry; returns the rank's exit code."""
    if env.rank == 0:
        run.record_start(env.restart, env.job_id, env.world_size, host=os.uname().nodename,
                         master=f"{env.master_addr}:{env.master_port}", **({"point": dict(point)} if point else {}),
                         **(replaced(run) if rejoin.generation() else {}))
    ranklog.say(f"hpcjobs: rank {env.rank}/{env.world_size} (local {env.local_rank}) on {os.uname().nodename}, "
                f"job {env.job_id} restart {env.restart}, rendezvous {env.master_addr}:{env.master_port}, "
                f"run folder {run.path}", every_rank=True)
    cap = contract.preemption.max_restarts
    row = restartcap.at_start(run, env.job_id, env.requeues, write=env.rank == 0)
    if row and restartcap.reached(row[:-1], cap):  # past the cap by a requeue no stop decided (the scheduler's)
        done = restartcap.progress(run)
        msg = f"{restartcap.line(cap, row[:-1], done, row[-1].cause)}: not training again"
        ranklog.say(f"hpcjobs: {msg}. The job ends failed.", every_rank=True)
        if env.rank == 0:
            run.write_final(FinalState.FAILED, msg, job_id=env.job_id)
        return 1
    rc = run_entry(ns.kind, ns.entry, list(ns.args), run, contract, env)
    if rc:
        record_failure(run, env, f"rank {env.rank} exited with code {rc} (log: {run.rank_log(env.restart, env.rank)})")
    elif env.rank == 0 and ns.kind != "task" and preemption.first_request() is None:
        # A user's own script has no trainer to say it finished: its rank 0 exiting 0, unasked to stop, does.
        run.write_final(FinalState.FINISHED, f"{ns.kind} {ns.entry} exited 0", job_id=env.job_id)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
