"""A survivor's side of a rank's replacement (hpcjobs.protocol.rejoin says why and how the two sides meet): a rank
whose peer died leaves the broken group, waits for the launcher's call and joins the new generation's group in the
same process; the shared trainer then resumes as at any start (the node-local tier, else shared storage), and the
result is bit-identical to an uninterrupted run (tests/test_rejoin.py).

A rank takes this path only where the launcher replaces ranks (HPCJOBS_REJOIN=1) and the failure is a peer's loss in
the collectives' own words (hpcjobs.protocol.faultpolicy.kinds.PEER_LOST); anything else (the task's own error, a
hang the watchdog ended, a stop) ends the rank as before.

Measured (tests/test_rejoin.py's probe, 2 gloo ranks on the 2-core host): a survivor sees the peer's SIGKILL within
milliseconds (gloo: "Connection closed by peer"), leaves the group in under 1 ms and stands in a new one as soon as
the replacement has imported torch; bench/local_tier.py gives the fault → first resumed step.
"""

from __future__ import annotations

import datetime
from dataclasses import replace

import torch.distributed as dist

from hpcjobs.protocol import rejoin
from hpcjobs.protocol.faultpolicy.kinds import PEER_LOST
from hpcjobs.protocol.runfolder import RunFolder
from trainers import preemption, ranklog
from trainers.distenv import DistEnv
from trainers.failures import describe_failure


class PeerLost(Exception):
    """A survivor's failure, held back until the launcher has said whether it replaces the lost rank."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def expected(e: BaseException) -> bool:
    """Whether this rank may outlive `e`: a peer lost, with a launcher that replaces ranks."""
    return rejoin.on() and isinstance(e, Exception) and bool(PEER_LOST.search(describe_failure(e))) \
        and not preemption.signalled()


def next_call(run: RunFolder, env: DistEnv, gen: int, lost: PeerLost) -> tuple[rejoin.Call, DistEnv] | None:
    """The launcher's call after generation `gen` (None: it ends the start instead), and this rank's new DistEnv."""
    c = rejoin.await_call(run, gen, preemption.signalled)
    if c is None:
        return None
    ranklog.say(f"hpcjobs: rank {env.rank}: a peer was lost ({describe_failure(lost.cause)[:160]}); rank(s) "
                f"{', '.join(map(str, c.ranks))} replaced, this one keeps its process (restart {c.restart})",
                every_rank=True)
    return c, replace(env, restart=c.restart)


def store(run: RunFolder, env: DistEnv, gen: int, timeout_s: float) -> dist.Store:
    """Generation `gen`'s store: rank 0 opens it on a free port and says where; the others connect there."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if env.rank == 0:
        s = dist.TCPStore(env.master_addr, 0, env.world_size, True, timeout, wait_for_workers=False)
        rejoin.publish(run, gen, env.master_addr, s.port)
    else:
        where = rejoin.address(run, gen, timeout_s, preemption.signalled)
        if where is None:
            raise TimeoutError(f"rank {env.rank}: generation {gen}'s rank 0 did not say where it listens within "
                               f"{timeout_s:.0f} s")
        s = dist.TCPStore(where[0], where[1], env.world_size, False, timeout)
    return dist.PrefixStore(f"hpcjobs-rejoin-{gen}", s)


def joined(run: RunFolder, env: DistEnv, gen: int) -> None:
    """Generation `gen`'s group stands: rank 0 tells the launcher (another replacement may now be made)."""
    if gen and env.rank == 0:
        rejoin.mark_joined(run, gen)


def abort() -> None:
    """Leave a group a peer's loss broke: NCCL's communicators are aborted (destroying them would wait on the dead
    peer), gloo's need nothing more than destroy."""
    kill = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if dist.is_initialized() and kill is not None and "nccl" in str(dist.get_backend()):
        kill()
