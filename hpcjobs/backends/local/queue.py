"""The local backend's queue: which of a submission's jobs run now (`max_parallel` at once, a sweep's points in
order), each job's ranks started as processes, watched, restarted when a fault is nobody's bug
(hpcjobs.backends.local.ranks.recovered), warned and killed at a --time limit as Slurm would, and stopped on Ctrl-C
at a checkpoint (hpcjobs.backends.local.ranks.Stopper). What each rank gets (its environment and command) is here too:
the dry run shows the same (hpcjobs.backends.local.local.describe)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from hpcjobs.backends import Submitted
from hpcjobs.backends.local.ranks import Stopper, device_slice, group_code, rank_preexec, recovered
from hpcjobs.backends.local.replace import replace_lost, replaceable
from hpcjobs.backends.local.tiers import sweep_here
from hpcjobs.backends.start_env import clean
from hpcjobs.protocol import rejoin
from hpcjobs.protocol.ports import free_port
from hpcjobs.protocol.runfolder import RunFolder, append_jsonl, array_ids
from hpcjobs.protocol.tierfiles import remove_job_folder, tier_on
from hpcjobs.request.render import launcher_argv
from hpcjobs.request.spec import JobSpec

Ranks = list[subprocess.Popen[bytes]]


def rank_envs(spec: JobSpec, job_id: str, port: int, base: dict[str, str], restart: int = 0,
              ) -> list[dict[str, str]]:
    """Each rank's environment: this shell's without any job's identity, the profile's, and the rendezvous."""
    ids = {f"HPCJOBS_{k.removeprefix('SLURM_')}": v for k, v in array_ids(job_id).items() if "ARRAY" in k}
    common = {**clean(base), **spec.env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "WORLD_SIZE": str(spec.ranks), "LOCAL_WORLD_SIZE": str(spec.ranks), "HPCJOBS_JOB_ID": job_id,
              "HPCJOBS_RESTART": str(restart), **ids}
    if replaceable(spec, base):
        common.setdefault(rejoin.ON_ENV, "1")  # its ranks outlive a lost peer (hpcjobs.backends.local.replace)
    return [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(spec.ranks)]


def time_limit(spec: JobSpec) -> int | None:
    """The seconds a local job may run: its --time, enforced as Slurm does (the profile's signal `seconds_before`
    the end, so the time-limit path can be rehearsed here; killed at the end). A profile's default_time is not:
    a local run goes on for as long as it trains."""
    return spec.time_seconds if spec.time_from == "--time" else None


def ranks_argv(spec: JobSpec) -> list[str]:
    """What each rank runs; its contract has no time limit unless one is enforced (time_limit)."""
    return launcher_argv(spec if time_limit(spec) else replace(spec, time_seconds=0))


def ignored(spec: JobSpec) -> list[str]:
    """What of the profile the local backend does not do, said at the start rather than silently skipped."""
    if spec.profile.setup:
        return [f"profile {spec.profile.name}'s setup lines are for Slurm jobs and are not run here: the ranks get "
                "this shell's environment"]
    return []


def record_allocation(sub: Submitted, started: float, code: int) -> None:
    """RUN/allocations.jsonl: when this job's ranks were started and when the last of them ended, what sacct says
    of a Slurm job; `hpcjobs goodput` reads it."""
    append_jsonl(RunFolder(sub.run_dir).allocations, {"job_id": sub.job_id, "start": started, "end": time.time(),
                                                      "code": code})


class LocalQueue:
    """One submission's jobs, run here: `run()` returns their exit codes. Ctrl-C stops the running ones at a
    checkpoint and starts no more (those are left with code 130, never started)."""

    def __init__(self, spec: JobSpec, subs: list[Submitted], stdout_to_stderr: bool) -> None:
        self.spec, self.subs, self.stdout_to_stderr = spec, subs, stdout_to_stderr
        self.width = spec.max_parallel or 1
        self.codes: list[int | None] = [None] * len(subs)
        self.started: dict[int, float] = {}
        self.restarts: dict[int, int] = {}  # task -> the number of its running start
        self.running: dict[int, tuple[int, Ranks]] = {}  # task -> (slot, ranks)
        self.ports: dict[int, int] = {}  # task -> its running start's rendezvous port
        self.spares: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}  # task -> its warm spare and its file
        self.spare_due: dict[int, float] = {}  # task -> since when it wants a spare (hpcjobs.protocol.rejoin)
        self.began: dict[int, float] = {}  # monotonic, for the time limit
        self.warned: set[int] = set()
        self.limit = time_limit(spec)
        self.warn_signal = getattr(signal, f"SIG{spec.profile.preemption.signal}")
        self.replaces = replaceable(spec, dict(os.environ))
        self.stopper = Stopper([], self.warn_signal, spec.entry.kind,
                               lambda: [(RunFolder(subs[i].run_dir), subs[i].job_id, self.restarts[i])
                                        for i in self.running])

    def run(self) -> list[int]:
        old = {s: signal.signal(s, self.stopper.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        for said in ignored(self.spec):
            print(f"hpcjobs: {said}", file=sys.stderr, flush=True)
        sweep_here([sub.job_id for sub in self.subs], {**os.environ, **self.spec.env})  # folders killed jobs left
        try:
            pending = list(range(len(self.subs)))
            while pending or self.running:
                while pending and len(self.running) < self.width and not self.stopper.count:
                    i = pending.pop(0)
                    slot = min(set(range(self.width)) - {s for s, _ in self.running.values()})
                    self.started[i] = time.time()
                    self._start(i, slot)
                if self.stopper.count and not self.running:
                    break
                for i in list(self.running):
                    self._watch(i)
                time.sleep(0.2)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return [130 if c is None else c for c in self.codes]

    def _start(self, i: int, slot: int) -> None:
        self.restarts[i] = RunFolder(self.subs[i].run_dir).next_restart()
        self.ports[i] = free_port()
        self._end_spare(i)
        self.running[i] = slot, start_ranks(self.spec, self.subs[i], slot if self.width > 1 else None,
                                            self.stdout_to_stderr, self.restarts[i], self.ports[i])
        self.spare_due[i] = time.time()
        self.stopper.procs += self.running[i][1]
        self.began.setdefault(i, time.monotonic())

    def _one(self, i: int, rank: int, restart: int, gen: int) -> subprocess.Popen[bytes]:
        """Rank `rank` of job i, as start `restart` of generation `gen` (a lost rank's replacement): the warm spare
        when one is ready, else a new process; then a new spare for the next."""
        slot = self.running[i][0] if self.width > 1 else None
        env = rank_env(self.spec, self.subs[i], slot, restart, rank, self.ports[i])  # the rendezvous its peers know
        env[rejoin.GEN_ENV] = str(gen)
        spare = self.spares.pop(i, None)
        if spare is not None and spare[0].poll() is None:
            rejoin.assign(spare[1], env)
            p = spare[0]
        else:
            p = spawn(self.spec, env, self.stdout_to_stderr)
        self.stopper.procs.append(p)
        self.spare_due[i] = time.time()
        return p

    def _spare(self, i: int) -> None:
        """A warm spare for job i's next lost rank (hpcjobs.protocol.rejoin.SPARE_ENV): torch and the task imported,
        waiting. Started once the start's ranks have trained a step (startup.jsonl written since `spare_due`): its
        imports would otherwise compete with theirs for the node's cores."""
        due = self.spare_due.get(i)
        run = RunFolder(self.subs[i].run_dir)
        wanted = self.replaces and os.environ.get(rejoin.SPARE_ON_ENV) == "1"
        if not wanted or due is None or i in self.spares or not run.startup.is_file() or \
                run.startup.stat().st_mtime < due:
            return
        del self.spare_due[i]
        slot = self.running[i][0] if self.width > 1 else None
        path = rejoin.folder(run) / f"spare-{time.monotonic_ns()}.json"
        env = rank_env(self.spec, self.subs[i], slot, self.restarts[i], 0, self.ports[i])
        self.spares[i] = spawn(self.spec, {**env, rejoin.SPARE_ENV: str(path),
                                               rejoin.LAUNCHER_ENV: str(os.getpid())}, self.stdout_to_stderr), path

    def _end_spare(self, i: int) -> None:
        spare = self.spares.pop(i, None)
        if spare is not None and spare[0].poll() is None:
            spare[0].kill()
            spare[0].wait()

    def _watch(self, i: int) -> None:
        """One look at job i's ranks: the time limit's warning and end as Slurm's, then its end or its recovery."""
        procs = self.running[i][1]
        age = time.monotonic() - self.began[i]
        limit = self.limit
        if limit is not None and age >= limit:  # as Slurm at the time limit
            for p in procs:
                if p.poll() is None:
                    p.kill()
        elif limit is not None and age >= limit - self.spec.profile.preemption.seconds_before and \
                i not in self.warned:  # as Slurm's --signal: the ranks stop at a checkpoint
            self.warned.add(i)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(self.warn_signal)
        asked = self.stopper.count or (limit is not None and age >= limit)  # Ctrl-C, the time limit
        if not asked and self.replaces and (new := replace_lost(self.spec, self.subs[i], procs, self.restarts[i],
                                                                lambda r, n, g: self._one(i, r, n, g))) is not None:
            self.restarts[i] = new
            return
        if (code := group_code(procs)) is None:
            self._spare(i)
            return
        if code and not asked and recovered(self.spec, self.subs[i], self.restarts[i], code, procs):
            self._start(i, self.running[i][0])
            return
        self.codes[i] = self.stopper.exit_code(code)
        self._end_spare(i)
        self.spare_due.pop(i, None)
        del self.running[i]
        record_allocation(self.subs[i], self.started[i], code)
        remove_tier(self.spec, self.subs[i])


def remove_tier(spec: JobSpec, sub: Submitted) -> None:
    """The job ended for good (nothing requeues a local job): its node-local tier's folder goes
    (hpcjobs.protocol.tierfiles; a job that finished removed its files itself, a failed or stopped one did not)."""
    if tier_on(ranks_argv(spec)):
        remove_job_folder(sub.job_id, {**os.environ, **spec.env})


def start_ranks(spec: JobSpec, sub: Submitted, slot: int | None, stdout_to_stderr: bool, restart: int,
                port: int) -> Ranks:
    print(f"hpcjobs: job {sub.job_id}: running {spec.world()} locally; run folder {sub.run_dir}",
          file=sys.stderr, flush=True)
    rejoin.clear(RunFolder(sub.run_dir))  # every rank starts anew: no earlier generation's call is left
    return [spawn(spec, env, stdout_to_stderr) for env in slot_envs(spec, sub, slot, restart, port)]


def slot_envs(spec: JobSpec, sub: Submitted, slot: int | None, restart: int, port: int) -> list[dict[str, str]]:
    """Every rank's environment in this sweep slot (its GPUs): rank_envs over this shell's environment."""
    base = dict(os.environ)
    if slot is not None:
        base.update(device_slice(slot, spec.ranks, base))
    return rank_envs(spec, sub.job_id, port, base, restart)


def rank_env(spec: JobSpec, sub: Submitted, slot: int | None, restart: int, rank: int, port: int) -> dict[str, str]:
    return slot_envs(spec, sub, slot, restart, port)[rank]


def spawn(spec: JobSpec, env: dict[str, str], stdout_to_stderr: bool) -> subprocess.Popen[bytes]:
    """One rank's process. Each rank in a session of its own (rank_preexec says why not only a process group): the
    terminal's Ctrl-C reaches only this process, which turns it into one stop request per rank (a rank hit by the
    terminal's signal as well would get two)."""
    return subprocess.Popen(ranks_argv(spec), cwd=spec.workdir, env=env, preexec_fn=rank_preexec,
                            stdout=sys.stderr if stdout_to_stderr else None)
