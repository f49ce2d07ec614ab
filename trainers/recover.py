"""Recovery inside the allocation: the batch script runs the ranks' srun step through this module, on the job's
first node, outside srun. When a step ends badly and it was nobody's bug (hpcjobs.protocol.faultpolicy.kinds: a rank
killed by a signal, a peer lost, a hang, a node that failed, a device error), the ranks start again as a new step of the
same job, from the newest finished checkpoint, without going back to the queue: a requeue waits for the scheduler and,
on Slurm's defaults, holds the job 121 s before it may start (cred_expire), where a new step starts at once. A node
that Slurm says is down, draining or not responding is left out; with spare nodes (`--spare-nodes K`, the
allocation is K nodes larger than the ranks need, and `--no-kill` keeps it when a node fails) one stands in. When
too few good nodes are left, the job is requeued with the bad ones excluded.

Bounded: a job that finishes no new checkpoint across `max_recoveries` recoveries in a row ends failed, with one
line naming the cause that repeats. A task's own exception is never recovered: it would fail the same way again.
Each recovery is a `stopped: fault` line in RUN/restarts.jsonl and a line in the job's log; each start gets its own
number (RunFolder.next_restart, exported as HPCJOBS_RESTART), so no two starts share their logs.

When the job ends for good here (failed, or ended by its ranks' own error; not a recovery, not a requeue, not a job
Slurm is ending or requeueing), a job run with the node-local tier (`--local-ckpt-every N`) has its tier's files
removed on every node of the allocation Slurm says is up (remove_tier: one `srun --overlap` step of `rm -rf`): its
ranks remove their own only when they finish or stop at a shared checkpoint, and a failed job would leave up to 4
copies of each rank's whole training state in /dev/shm until the node reboots. With the tier off nothing is run.

Torch-free (it runs beside the ranks, in the batch step); the only Slurm words are in trainers/jobenv/slurm.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from hpcjobs.protocol.contract import ContractError, LaunchContract
from hpcjobs.protocol.faultpolicy.diagnosis import Failure
from hpcjobs.protocol.faultpolicy.recoverable import REFUSED_EXIT, Decision, all_said, judge, record
from hpcjobs.protocol.faultpolicy.srunwords import srun_failures
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.states import FinalState
from hpcjobs.protocol.tierfiles import job_folder, tier_on
from trainers.jobenv.base import Runner
from trainers.jobenv.slurm import (
    SlurmJobEnv,
    allocation,
    job_fields,
    on_each_node,
    requeue_excluding,
    stated_end_env,
    step_again,
    unhealthy_nodes,
)

NOT_RUNNING = "the job is no longer RUNNING"
"""Why the loop ends when Slurm ended, preempted or requeued the job while its step ended: its tier's files stay (a
requeue may start it on the same nodes)."""
CLEAN_TIMEOUT_S = 60
"""How long the tier's removal step may take (srun's start, an `rm -rf` of a few files in memory)."""


@dataclass
class Allocation:
    """What the loop knows of the job: its id, nodes and spare count, and the nodes it has left out so far."""

    job_id: str
    nodes: list[str]
    spare: int
    excluded: set[str] = field(default_factory=set)

    @classmethod
    def of(cls, env: Mapping[str, str], spare: int) -> Allocation:
        return cls(*allocation(env), spare)


def decide(run: RunFolder, contract: LaunchContract, alloc: Allocation, restart: int, rc: int,
           runner: Runner = subprocess.run, said: Sequence[Failure] = ()) -> Decision:
    """What to do after the step of start `restart` ended with `rc`; `said`: srun's words about its tasks."""
    d = judge(run, contract.recovery, alloc.job_id, restart, rc, said)
    if d.action != "relaunch":
        return d
    if job_fields(alloc.job_id, runner).get("JobState") != "RUNNING":
        # Cancelled, preempted, requeued or timed out while the step ended (Slurm decides), or no answer: a job
        # scancelled while its step waited was relaunched when a failed scontrol was taken for RUNNING
        return Decision("end", NOT_RUNNING)
    down = unhealthy_nodes(alloc.nodes, runner)
    if down:  # a node that failed is the cause; its ranks' peers only noticed
        d = replace(d, why="; ".join(f"node {n} is {state}" for n, state in down.items()) + f" ({d.why})")
    bad = set(down) | alloc.excluded
    good = [n for n in alloc.nodes if n not in bad]
    unsure = [n for n in good if n in d.silent]
    if unsure and len(good) - len(unsure) >= len(alloc.nodes) - alloc.spare:  # a spare stands in for it
        d = replace(d, why=f"{', '.join(unsure)}: its ranks went silent ({d.why})")
        bad, good = bad | set(unsure), [n for n in good if n not in unsure]
    if len(good) >= len(alloc.nodes) - alloc.spare:
        return replace(d, exclude=tuple(sorted(bad)))
    return replace(d, action="requeue", exclude=tuple(sorted(bad)))


def step_argv(argv: Sequence[str], alloc: Allocation, exclude: Sequence[str]) -> list[str]:
    """The step's command line with every node left out so far."""
    alloc.excluded.update(exclude)
    return step_again(list(argv), alloc.excluded)


def contract_of(argv: Sequence[str]) -> LaunchContract:
    """The launch contract the ranks' command line carries (`--contract JSON`), resolved for this job."""
    text = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--contract"), None)
    if text is None:
        raise ContractError(f"no --contract in the ranks' command line {' '.join(argv)[:200]!r}")
    return LaunchContract.from_json(text).started(os.environ, time.time())


def supervise(argv: Sequence[str], runner: Runner = subprocess.run) -> int:
    """Run the step, then recover until it ends for good; the exit code the job ends with."""
    contract = contract_of(argv)
    run = RunFolder(contract.run_dir)
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):  # the job is being ended (scancel, preemption): srun hears it too
        signal.signal(getattr(signal, name), _ending)
    alloc = Allocation.of(os.environ, contract.recovery.spare_nodes)
    restart = run.next_restart()
    output = Output.of_stderr()
    output.step_begins()
    rc = launch(argv, restart, run, alloc.job_id)
    while True:
        said = output.srun_said()
        d = decide(run, contract, alloc, restart, rc, runner, said) if not _ended else Decision("end")
        if d.action == "end":
            if rc != 0 and not _ended and d.why != NOT_RUNNING:
                remove_tier(argv, alloc, runner)
            return rc
        if d.action == "fail":
            print(f"hpcjobs: job {alloc.job_id} ends failed: {d.why}", file=sys.stderr, flush=True)
            run.write_final(FinalState.FAILED, d.why, job_id=alloc.job_id)
            remove_tier(argv, alloc, runner)
            return rc
        record(run, alloc.job_id, restart, d)
        if d.action == "requeue":
            complaint = requeue_excluding(alloc.job_id, list(d.exclude), runner)
            if complaint:
                print(f"hpcjobs: the requeue failed ({complaint}); the job ends failed", file=sys.stderr, flush=True)
                remove_tier(argv, alloc, runner)
                return rc
            return 0
        restart = run.next_restart()
        output.step_begins()
        rc = launch(step_argv(argv, alloc, d.exclude), restart, run, alloc.job_id, job_end_env(contract, alloc, runner))


def remove_tier(argv: Sequence[str], alloc: Allocation, runner: Runner) -> None:
    """The job ends for good: its node-local tier's folder goes on every node of the allocation that is up (a down
    node's memory went with it, or goes at its reboot). Nothing is run when the ranks' command has the tier off."""
    if not tier_on(argv):
        return
    down = unhealthy_nodes(alloc.nodes, runner)
    nodes = [n for n in alloc.nodes if n not in down]
    if not nodes:
        return
    folder = job_folder(SlurmJobEnv(os.environ).job_id())
    try:
        out = runner(on_each_node(nodes, ["rm", "-rf", "--", str(folder)]), capture_output=True, text=True,
                     timeout=CLEAN_TIMEOUT_S)
        complaint = str(out.stderr).strip()[:200] if out.returncode else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        complaint = str(e)
    if complaint:
        print(f"hpcjobs: the node-local tier's {folder} may be left on a node ({complaint})", file=sys.stderr,
              flush=True)


@dataclass
class Output:
    """The batch step's own output file (its stderr, where srun writes `srun: error: node2: task 3: Killed`), and
    where the running step's part of it begins."""

    path: str | None
    since: int | None = None

    @classmethod
    def of_stderr(cls) -> Output:
        try:
            path = os.readlink("/proc/self/fd/2")
            return cls(path if stat.S_ISREG(os.stat(path).st_mode) else None)
        except OSError:
            return cls(None)

    def step_begins(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.since = os.stat(self.path).st_size

    def srun_said(self) -> list[Failure]:
        if self.path is None:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.since or 0)
                text = f.read().decode(errors="replace")
        except OSError:
            return []
        return srun_failures(text)


_ended: list[int] = []


def _ending(signum: int, _frame: object) -> None:
    """Slurm is ending the job (it signals the batch step as well as the ranks): no recovery after this step."""
    _ended.append(signum)


STUCK_S = 5.0
"""How long a step may go on after one of its ranks recorded a failure before the recovery ends it. srun ends the
rest within seconds of a task's bad exit (--kill-on-bad-exit), except for the tasks of a node that stopped
answering: for those it waits until Slurm declares the node dead (measured on the test cluster: about 40 s after
the peers' 15 s collective timeout, with SlurmdTimeout 60 s; Slurm's default SlurmdTimeout is 300 s). With a hung
(SIGSTOPped) rank the step went on past 10 s after its peers' timeouts in one run of two (bench/fault_recovery.py:
fault → recovery 25.6 s against 15.9): 5 s."""

SAID_S = 1.0
"""Once every rank that can still speak has recorded its failure (recovery.all_said: the ranks of a silent node
never will), the step is ended after this long instead of STUCK_S: nothing more is coming, and a dead node's
tasks would hold srun until Slurm declares the node dead."""

ABORT_S = 3.0
"""How long srun gets to leave after its abort (two SIGINTs) before it is killed: with a node that does not
answer it waits for that node's tasks (they are gone; Slurm cleans up the step when it declares the node dead)."""


def job_end_env(contract: LaunchContract, alloc: Allocation, runner: Runner) -> dict[str, str]:
    """The job's end for a relaunched step where the scheduler states none in the environment (Slurm 22.05): its
    ranks would count the time limit from their own start (LaunchContract.job_end) and stop minutes after Slurm ends
    the job, their stop checkpoint lost. Slurm's EndTime, else this supervisor's start plus the limit."""
    return stated_end_env(alloc.job_id, os.environ, contract.job_end(None), runner)


def launch(argv: Sequence[str], restart: int, run: RunFolder, job_id: str, env: Mapping[str, str] | None = None) -> int:
    """One step of the ranks, numbered `restart` (their logs and records); its exit code. A step that goes on after
    a rank recorded its failure is ended as a double Ctrl-C ends it (srun's own abort), then killed: SAID_S after
    every rank that can still speak has said why, STUCK_S after the first did."""
    step = subprocess.Popen(list(argv), env={**os.environ, **(env or {}), "HPCJOBS_RESTART": str(restart)})
    noticed: float | None = None
    said: float | None = None
    while True:
        try:
            return step.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if noticed is None:
            if not any(str(f.get("job_id")) == job_id and f.get("restart") == restart for f in run.read_failures()):
                continue
            noticed = time.monotonic()
        if said is None and all_said(run, job_id, restart):
            said = time.monotonic()
        now = time.monotonic()
        if (said is not None and now - said > SAID_S) or now - noticed > STUCK_S:
            print(f"hpcjobs: a rank of restart {restart} failed {now - noticed:.0f} s ago and the step goes on (a "
                  "node that does not answer?): ending it", file=sys.stderr, flush=True)
            return end_step(step)


def end_step(step: subprocess.Popen[bytes]) -> int:
    """srun's abort (two SIGINTs within a second: it kills the tasks it can reach and leaves), then SIGKILL."""
    for _ in range(2):
        step.send_signal(signal.SIGINT)
        time.sleep(0.2)
    try:
        return step.wait(timeout=ABORT_S)
    except subprocess.TimeoutExpired:
        step.kill()
        return step.wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainers.recover", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("step", nargs=argparse.REMAINDER, help="-- srun FLAGS RANK-COMMAND")
    ns = p.parse_args(argv)
    step = ns.step[1:] if ns.step[:1] == ["--"] else ns.step
    try:
        return supervise(step)
    except ContractError as e:
        print(f"hpcjobs: {e}", file=sys.stderr, flush=True)
        return REFUSED_EXIT


if __name__ == "__main__":
    raise SystemExit(main())
