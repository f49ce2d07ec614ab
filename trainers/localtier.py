"""The node-local checkpoint tier (`--local-ckpt-every N`, issue 40): a fault costs at most N steps of rework, not a
shared-checkpoint interval. Every N steps (`auto`, the default: measured, trainers.localtier_auto) each rank takes
its own part of the full training state (what the Checkpointer saves: its model and optimizer tensors, the small
states, its RNG streams, the position and step), a thread copies it to host memory while training goes on
(trainers.localtier_copy) and writes it as one file to node-local storage that outlives the process (/dev/shm,
HPCJOBS_LOCAL_CKPT_DIR to choose another node-local folder), then keeps a replica on a peer: the rank
ranks-per-node further on (mod world), sent over a gloo group of the tier's own. On one node there is no other
node: each rank writes its replica beside its own file, which covers a lost or corrupt file, not a lost node.

Layout: DIR/hpcjobs-JOB/RUNKEY/rank-R-of-W.step-N.pt (own) and peer-of-rank-R-of-W.step-N.pt (the replica a peer
holds), RUNKEY a hash of the run folder. Each file is torch.save's bytes followed by their SHA-256, written to a
`.tmp` name and renamed: a torn or altered file fails the check and is never used. After both files of step N are
written, the ranks all-reduce the step every rank completed (MIN, -1 when one failed) and only then remove their
older files, so at any time every rank holds the newest step all completed. The thread's collectives run on every
rank even when a write failed (a full /dev/shm says so on stderr and the tier goes on without that step).

Recovery (`resume`, at every start, before the shared checkpoint is looked at): the ranks gather which steps each
holds (own files and replicas, checked), pick the newest step S that every rank has in either, and use it when it is
newer than the newest finished shared checkpoint; a rank without its own file gets the replica (read here on one
node, sent by its holder otherwise). The same job and world size are required (the folder is the job's, the name
carries the world size); a requeue to other nodes finds nothing and resumes from shared storage.

Cost (bench/local_tier.py --cost: the classifier, 2 gloo ranks on the 2-core test host, load average 6-12 from other
work, steps 35-400, medians of interleaved rounds): every 5 steps 6.2 ms a step against 8.8 ms with the loop's copy
before (off 4.6 ms; 5 rounds); auto chose 7-458 steps (median 152) from saves measured at 1-47 ms, its step 1.07x
off's (median of 8 rounds' ratios, 0.80-1.53): the 2% target is not resolved on this host. No GPU node yet.
Host memory: up to two steps' own files and two replicas per rank (the newest all completed, and the one being
written), each the size of the rank's state (model + optimizer: ~3x the parameters in fp32 with AdamW).
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcjobs.protocol.settings.trainflags import ResumeError
from hpcjobs.protocol.tierfiles import DIR_ENV, job_folder_name, tier_base
from trainers import ranklog
from trainers.checkpoint import CheckpointRef, latest
from trainers.checkpoint.resume import Resumed, ResumeRule
from trainers.checkpoint.stateful import Stateful, gather
from trainers.dist import DistContext
from trainers.localtier_auto import FIRST, AutoInterval, room_for
from trainers.localtier_copy import HostCopy
from trainers.localtier_state import apply, decode, encode, intact, nbytes, same_shape, templates, write_atomic

LOCAL, REPLICA, SHARED = "local tier", "peer replica", "shared storage"
"""Which tier a start resumed from (the log line and startup.jsonl's `resumed_tier`)."""
NAME = re.compile(r"(peer-of-)?rank-(\d+)-of-(\d+)\.step-(\d+)\.pt")


def tier_root(job_id: str, run_dir: Path, environ: Mapping[str, str] = os.environ) -> Path:
    """The run's folder in the tier: the job's folder (hpcjobs.protocol.tierfiles names it for both sides: the end
    of a failed job removes it), then a key of the run folder."""
    key = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:10]
    return Path(tier_base(environ)) / job_folder_name(job_id) / key


def file_name(rank: int, world: int, step: int, replica: bool = False) -> str:
    return f"{'peer-of-' * replica}rank-{rank}-of-{world}.step-{step}.pt"


class LocalTier:
    """One rank's side of the tier: `save` every `every` steps, `resume` at a start, `close` at the job's end."""

    def __init__(self, every: int | str, ctx: DistContext, run_dir: Path, last_step: int) -> None:
        self.auto = every == "auto"
        self.every = FIRST if self.auto else int(every)
        """The interval in force (auto: FIRST until the ranks agree on a measured one, localtier_auto)."""
        self.ctx, self.last_step = ctx, last_step
        self.rank, self.world = ctx.rank, ctx.world_size
        self.root = tier_root(ctx.env.job_id, run_dir)
        self.per_node = max(1, ctx.env.local_world_size)
        self.one_node = self.per_node >= self.world
        self.peer, self.source = (self.rank + self.per_node) % self.world, (self.rank - self.per_node) % self.world
        self.holds = self.rank if self.one_node else self.source
        """Whose replica this rank keeps: its own on one node, else the rank ranks-per-node before it."""
        self.group = dist.new_group(backend="gloo") if self.every and self.world > 1 and dist.is_initialized() else None
        self.pending: threading.Thread | None = None
        self.used: str | None = None
        """Which tier this start resumed from (None: it started at step 0)."""
        self.tried = False
        self.warned = False
        self.copy = HostCopy(ctx.device)
        self.meter = AutoInterval()
        self.next_at: int | None = None  # auto: the step of the next save
        self.agreed: tuple[int, float, float] | None = None  # auto: (interval, cost s, step s) the ranks agreed on
        self.said = False

    def holder_of(self, rank: int) -> int:
        return rank if self.one_node else (rank + self.per_node) % self.world

    def due(self, step: int) -> bool:
        """Whether to save after `step` (called once after every step: auto times the steps here)."""
        if not self.every:
            return False
        if not self.auto:
            return step % self.every == 0 and step < self.last_step
        self.meter.tick(self.pending is not None and self.pending.is_alive())
        if self.next_at is None:
            self.next_at = step - 1 + FIRST
        return step == self.next_at and step < self.last_step

    def save(self, step: int, states: Mapping[str, Stateful], meta: Callable[[], dict[str, Any]]) -> None:
        """Take this rank's state for a thread to copy and write (localtier_copy: the loop does not wait for the copy
        of what only the optimizer's step changes). At most one write in flight: the next save waits for the one
        before."""
        self.join()
        parts = gather(states)
        if self.auto and self.meter.saves == 0 and not self.fits(parts.tensors):
            return
        proposal = self.plan_next(step) if self.auto else (0, 0.0, 0.0)
        payload = {"step": step, "world_size": self.world, "rank": self.rank,
                   "meta": {"world_size": self.world, "step": step, **meta()},
                   "tensors": self.copy.start(parts.tensors, parts.now, states),
                   "shared": copy.deepcopy(parts.shared), "own": copy.deepcopy(parts.own)}
        self.pending = threading.Thread(target=self.write, args=(step, payload, proposal),
                                        name=f"hpcjobs-local-{step}", daemon=True)
        self.pending.start()

    def plan_next(self, step: int) -> tuple[int, float, float]:
        """auto, at a save (every rank at the same step, the last writer joined): the interval agreed in the save
        before applied, the next save's step set, and this rank's proposal from its measured costs."""
        if self.agreed is not None:
            self.every, cost, step_s = self.agreed
            if not self.said:
                self.said = True
                ranklog.rank0(f"local checkpoints every {self.every} step(s) (--local-ckpt-every auto: a save costs "
                              f"the loop {cost * 1000:.1f} ms, a step takes {step_s * 1000:.1f} ms; slowest rank's: "
                              f"{cost / (self.every * step_s) * 100 if step_s else 0:.1f}% of the step time)",
                              self.rank)
        self.next_at = step + self.every
        proposal = self.meter.propose()
        self.meter.saved()
        return proposal

    def fits(self, tensors: dict[str, Any]) -> bool:
        """auto, at the first save: the tier's copies must fit the free space of its folder on every rank
        (localtier_auto.room_for), else the tier is off, said once."""
        mine, why = room_for(nbytes(tensors), self.per_node, self.root)
        ok = torch.tensor([int(mine)], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if not ok.item():
            self.every = 0
            ranklog.rank0(why or "--local-ckpt-every auto: the tier does not fit another rank's node: off", self.rank)
        return bool(ok.item())

    def write(self, step: int, payload: dict[str, Any], proposal: tuple[int, float, float]) -> None:
        data, ok = b"", True
        try:
            self.copy.finish()
            data = encode(payload)
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomic(self.root / file_name(self.rank, self.world, step), data)
        except Exception as e:  # noqa: BLE001 - the collectives below must run on every rank
            ok, data = self.failed(step, e), b""
        got = self.exchange(data)
        try:
            if got:
                write_atomic(self.root / file_name(self.holds, self.world, step, replica=True), got)
            ok = ok and bool(got)
        except Exception as e:  # noqa: BLE001
            ok = self.failed(step, e)
        agreed = self.agree(step if ok else -1, proposal)
        if agreed >= 0:
            self.prune(below=agreed)

    def failed(self, step: int, e: BaseException) -> bool:
        if not self.warned:
            self.warned = True
            ranklog.warn(f"hpcjobs: rank {self.rank}: local checkpoint step {step} not written to {self.root} ({e}); "
                         "the shared checkpoints are unchanged. HINT: free node memory, or HPCJOBS_LOCAL_CKPT_DIR="
                         "another node-local folder", every_rank=True)
        return False

    def exchange(self, data: bytes) -> bytes:
        """Send `data` to the peer and get the source's (on one node: `data` itself, kept beside it)."""
        if self.one_node or self.group is None:
            return data
        size, got = torch.tensor([len(data)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        self.swap(size, got)
        out = torch.empty(int(got.item()), dtype=torch.uint8)
        self.swap(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None, out if out.numel() else None)
        return out.numpy().tobytes()

    def swap(self, send: torch.Tensor | None, into: torch.Tensor | None) -> None:
        """Send to the peer and receive from the source at once (each rank is both: a ring)."""
        reqs = [dist.isend(send, self.peer, group=self.group)] if send is not None else []
        reqs += [dist.irecv(into, self.source, group=self.group)] if into is not None else []
        for r in reqs:
            if r is not None:
                r.wait()

    def agree(self, step: int, proposal: tuple[int, float, float]) -> int:
        """One all-reduce (MAX) over the ranks: the step every rank completed (MIN, as -MAX of its negation; -1
        when one failed), and for auto the interval the ranks proposed, the cost and step time (their MAX)."""
        every, cost, step_s = proposal
        t = torch.tensor([-step, every, round(cost * 1e6), round(step_s * 1e6)], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if t[1] > 0:
            self.agreed = (int(t[1]), int(t[2]) / 1e6, int(t[3]) / 1e6)
        return -int(t[0])

    def listing(self, check: bool = True) -> tuple[dict[int, Path], dict[int, Path]]:
        """This rank's own files and the replicas it holds, by step, of this world size: only whole ones (`check`:
        each read and its checksum computed; without, by name alone, for removing them)."""
        own: dict[int, Path] = {}
        held: dict[int, Path] = {}
        for path in self.root.glob("*.pt") if self.root.is_dir() else ():
            m = NAME.fullmatch(path.name)
            if not m or int(m[3]) != self.world or int(m[2]) != (self.holds if m[1] else self.rank):
                continue
            try:
                whole = not check or intact(path.read_bytes())
            except OSError:
                whole = False
            if whole:
                (held if m[1] else own)[int(m[4])] = path
        return own, held

    def prune(self, below: int) -> None:
        own, held = self.listing(check=False)
        for step, path in [*own.items(), *held.items()]:
            if step < below:
                path.unlink(missing_ok=True)

    def join(self) -> None:
        if self.pending is not None:
            self.pending.join()
            self.pending = None

    def everyones(self, mine: Any) -> list[Any]:
        if self.group is None:
            return [mine]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, mine, group=self.group)
        return out

    def newest(self, everyone: list[tuple[list[int], list[int]]]) -> int | None:
        """The newest step every rank has in its own file or in a replica its holder keeps."""
        def has(r: int, s: int) -> bool:
            return s in everyone[r][0] or s in everyone[self.holder_of(r)][1]
        steps = {s for own, held in everyone for s in (*own, *held)}
        return max((s for s in steps if all(has(r, s) for r in range(self.world))), default=None)

    def resume(self, checkpoints: Path, states: Mapping[str, Stateful], check: ResumeRule) -> Resumed | None:
        """Every rank: load the newest step every rank has in the tier, if newer than the newest finished shared
        checkpoint (rank 0's listing), and say which tier; None: resume from shared storage as before."""
        if not self.every:
            return None
        own, held = self.listing()
        shared = latest(checkpoints) if self.rank == 0 else None
        everyone = self.everyones((sorted(own), sorted(held), shared.step if shared else None))
        step, newest_shared = self.newest([(o, h) for o, h, _ in everyone]), everyone[0][2]
        if step is None or (newest_shared is not None and step <= newest_shared):
            return None
        data = self.fetch(step, own, held, [e[0] for e in everyone])
        self.tried = True  # templates() below gives a fresh optimizer its state: a fresh start must build anew
        try:
            payload = decode(data)
            if payload["step"] != step or payload["world_size"] != self.world:
                raise ValueError("another step or world size inside")
            check(payload["meta"], str(self.root))
            why = same_shape(templates(states), payload["tensors"])
        except ResumeError:
            raise
        except Exception as e:  # noqa: BLE001 - a torn payload: pickle raises many types
            why = f"rank {self.rank}: {e}"
        whys = [w for w in self.everyones(why) if w]
        if whys:
            ranklog.warn(f"hpcjobs: local checkpoint step {step} cannot be used ({'; '.join(whys)}): resuming from "
                         "shared storage", every_rank=True)
            return None
        apply(states, payload)
        self.used = LOCAL if all(step in e[0] for e in everyone) else REPLICA
        return Resumed(CheckpointRef(step, self.root), payload["meta"], payload["shared"], payload["own"])

    def say(self, step: int) -> None:
        """After a resume: the one line saying which tier it came from (with the tier on)."""
        self.used = self.used or SHARED
        if self.every:
            ranklog.rank0(f"resumed from step {step} ({self.used})", self.rank)

    def fetch(self, step: int, own: dict[int, Path], held: dict[int, Path], owns: list[list[int]]) -> bytes:
        """This rank's bytes of `step`: its own file, else a replica here, else the one its holder sends."""
        data = own[step].read_bytes() if step in own else b""
        if not data and self.holds == self.rank and step in held:
            data = held[step].read_bytes()
        for r in range(self.world):  # the same order on every rank: each transfer is one send and one receive
            holder = self.holder_of(r)
            if step in owns[r] or holder == r:
                continue
            size = torch.zeros(1, dtype=torch.int64)
            if self.rank == holder:
                sent = held[step].read_bytes()
                dist.send(torch.tensor([len(sent)], dtype=torch.int64), r, group=self.group)
                dist.send(torch.frombuffer(bytearray(sent), dtype=torch.uint8), r, group=self.group)
            elif self.rank == r:
                dist.recv(size, holder, group=self.group)
                buf = torch.empty(int(size.item()), dtype=torch.uint8)
                dist.recv(buf, holder, group=self.group)
                data = buf.numpy().tobytes()
        return data

    def close(self) -> None:
        """At the job's end (finished, or stopped at a shared checkpoint, which is newer): this rank's files go, and
        the job's folder once empty."""
        self.join()
        self.copy.close()
        if not self.every:
            return
        own, held = self.listing(check=False)
        for path in [*own.values(), *held.values(), *self.root.glob(".*.tmp")]:
            path.unlink(missing_ok=True)
        for folder in (self.root, self.root.parent):
            try:
                folder.rmdir()
            except OSError:
                pass  # another rank's files are still there: that rank removes them


__all__ = ["DIR_ENV", "LOCAL", "REPLICA", "SHARED", "LocalTier", "tier_root"]
