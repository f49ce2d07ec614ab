"""One job at a time in a run folder: rank 0 holds an flock on RUN/.lock while its job runs.

A second job started on the same folder (a resubmission while the first still trains, two shells given one
--run-dir) would interleave checkpoints, metrics and logs with the first. Its rank 0 finds the lock taken and is
refused with one line naming the holder, before it writes anything in the folder. The kernel drops the lock when the
holding process dies, however it dies (SIGKILL included), so a lock is never stale; the holder's description in the
file (job id, host, pid, time) is only information and may outlive it.

The other ranks of a job write nothing in the run folder until the description names their own job (their rank 0
holds the lock): a refused job leaves no log lines in the running job's logs. Torch-free.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcjobs.protocol.errors import StartRefused
from hpcjobs.protocol.folderlock import busy_message, read_holder
from hpcjobs.protocol.runfolder import RunFolder
from trainers import ranklog
from trainers.distenv import DistEnv

WAIT_FOR_RANK0_S = 60.0
"""How long the other ranks wait for their rank 0 to hold the lock (at most; HPCJOBS_INIT_TIMEOUT if shorter). A
refused rank 0 exits at once and every launcher then stops the other ranks within a second or two (srun
--kill-on-bad-exit, torchrun, the local backend); a rank 0 later than this is left to the rendezvous to wait for,
and to report if it never comes."""
UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
"""flock errors of filesystems that do not lock (some Lustre and NFS mounts): the run goes on unguarded."""


class RunFolderBusy(StartRefused):
    """Another job holds the run folder; the message is the one line to print. A refused start (exit 2, nothing
    recorded as the run's end), said by trainers.launch's claim_run_folder."""


class RunFolderUnwritable(StartRefused):
    """The lock file cannot be made: the run folder is not writable (one line). A refused start, as RunFolderBusy."""


@dataclass
class RunLock:
    fd: int | None
    """Open (and locked) for as long as the process lives; None where the filesystem cannot lock."""


def holder_of(env: DistEnv) -> dict[str, Any]:
    """What the lock file says about its holder. job_id, restart and rendezvous together name one start of one job:
    the other ranks of that start recognise it by them."""
    return {"job_id": env.job_id, "restart": env.restart, "rendezvous": f"{env.master_addr}:{env.master_port}",
            "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


def same_start(holder: Any, env: DistEnv) -> bool:
    mine = holder_of(env)
    return isinstance(holder, dict) and all(holder.get(k) == mine[k] for k in ("job_id", "restart", "rendezvous"))


def take(run: RunFolder, env: DistEnv) -> RunLock:
    """Rank 0: lock the run folder and say who holds it. Raises RunFolderBusy or RunFolderUnwritable."""
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(run.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise RunFolderUnwritable(f"cannot write the run folder {run.path} ({e.strerror}). HINT: pick a writable "
                                  "--run-dir.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunFolderBusy(busy_message(run)) from None
    except OSError as e:
        if e.errno not in UNSUPPORTED:
            raise
        ranklog.warn(f"hpcjobs: the filesystem of {run.path} cannot lock files ({e.strerror}): nothing stops a second "
                     "job from using this run folder at the same time", every_rank=True)
    lock = RunLock(fd)
    restate(lock, env)
    return lock


def restate(lock: RunLock, env: DistEnv) -> None:
    """Say who holds the lock: this start's rank 0 (again, for a rank 0 that kept its process through a peer's
    replacement: the new start's ranks wait for it). Rewritten in place, never replaced: the lock belongs to the
    file's inode."""
    if lock.fd is None:
        return
    text = json.dumps(holder_of(env), sort_keys=True).encode()
    os.ftruncate(lock.fd, 0)
    os.pwrite(lock.fd, text, 0)


def wait_for_rank0(run: RunFolder, env: DistEnv, timeout_s: float, stop_requested: Callable[[], bool],
                   ) -> bool:
    """Ranks other than 0: wait until this start's rank 0 holds the lock. False when asked to stop first (this
    start's rank 0 was refused and the launcher stops the others) or after `timeout_s` (rank 0 is late)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.02
    while not same_start(read_holder(run), env):
        if stop_requested() or time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(0.5, pause * 1.5)  # quick while the ranks start together, gentle on a shared filesystem after
    return True
