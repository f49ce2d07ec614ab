"""A rank's failure, recorded once: `RUN/failures.jsonl` (each failing rank's record) and `final.json`'s reason,
where the first failure of a start wins. The launcher and trainers.run (which records while the process group still
stands) both call these; hpcjobs.protocol.faultpolicy.diagnosis reads what they write. Torch-free."""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.folderlock import read_holder
from hpcjobs.protocol.runfolder import RunFolder, append_jsonl
from hpcjobs.protocol.states import FinalState
from trainers import runlock
from trainers.distenv import DistEnv


def one_line(e: BaseException, limit: int = 500) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "…"


def describe_failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {one_line(e)}" if str(e).strip() else type(e).__name__


def record_rank_failure(e: BaseException, env: DistEnv, run: RunFolder) -> bool:
    """Record `e` as this start's failure (see record_failure), once per exception; True if it is the one recorded.
    trainers.run calls it before the process group goes, so the peers that fail because this rank left find the
    first failure already written."""
    known = getattr(e, "_hpcjobs_recorded", None)
    if known is None:
        known = record_rank_error(describe_failure(e), env, run)
        with contextlib.suppress(AttributeError):
            e._hpcjobs_recorded = known  # type: ignore[attr-defined]
    return bool(known)


def record_rank_error(error: str, env: DistEnv, run: RunFolder, **extra: Any) -> bool:
    """This rank's failure line in failures.jsonl (`extra`: more fields, e.g. the hang watchdog's `step`) and, if it
    is the start's first, final.json's reason; True if final.json took it."""
    log_path = run.rank_log(env.restart, env.rank)
    append_jsonl(run.failures, {"time": time.time(), "job_id": env.job_id, "restart": env.restart, "rank": env.rank,
                                "host": os.uname().nodename, "error": error, "log": str(log_path), **extra})
    return record_failure(run, env, f"rank {env.rank} on {os.uname().nodename}: {error} (log: {log_path})")


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
    holder = read_holder(run)
    if holder is not None and runlock.same_start(holder, env):
        since = float(holder["time"])
    else:  # a rank 0 that never took it (late, or a filesystem that cannot lock): this rank's own start
        contract = LaunchContract.current()
        since = contract.start_time if contract else 0.0
    if isinstance(final, dict) and final.get("job_id") == env.job_id and float(final.get("time") or 0) >= since:
        return str(final.get("state"))
    return None
