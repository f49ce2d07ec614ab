"""Who holds a run folder: the reader's side of the lock its job's rank 0 takes (trainers.runlock, an flock on
RUN/.lock whose file describes the holder). The submit side asks before a local job writes anything (a refused start
must not rewrite the running job's records); the node side names the holder when it is refused. Torch-free."""

from __future__ import annotations

import fcntl
import json
import os
import time
from typing import Any

from hpcjobs.protocol.runfolder import RunFolder


def read_holder(run: RunFolder) -> dict[str, Any] | None:
    try:
        holder = json.loads(run.lock.read_text())
    except (OSError, ValueError):
        return None  # none yet, or being rewritten right now
    return holder if isinstance(holder, dict) else None


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another job (it has not said which yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("time", 0))))
    return f"job {holder.get('job_id')} (pid {holder.get('pid')} on {holder.get('host')}, since {since})"


def in_use(run: RunFolder) -> str | None:
    """The one line `take` would refuse with, asked before anything is written (the submit side of a job that
    starts now: a refused start must not rewrite the running job's spec.json or local-process.json); None when the
    folder is free, or its filesystem cannot lock. Holds the lock only for the instant it asks."""
    try:
        fd = os.open(run.lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file: no job ever ran here
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return busy_message(run)
    except OSError:
        return None
    finally:
        os.close(fd)
    return None


def busy_message(run: RunFolder) -> str:
    holder = None
    for _ in range(10):  # the holder may be rewriting its description this instant
        holder = read_holder(run)
        if holder:
            break
        time.sleep(0.05)
    job = holder.get("job_id") if holder else None
    stop = f"`hpcjobs cancel {job}`" if job else "stop it"
    return (f"run folder {run.path} is in use by {describe(holder)}; a second job there would mix its checkpoints "
            f"and logs with that one's. HINT: wait for it to end, {stop}, or pick another --run-dir.")
