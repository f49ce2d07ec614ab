"""A stop the user asked for on the local profile, in the user's words, on both sides.

The launching process sees what the user did (Ctrl-C, SIGTERM, `hpcjobs cancel`, which sends it SIGTERM); a user's
script gets the profile's signal in its place (hpcjobs.backends.local.ranks.Stopper). The ranks' lines named that
internal signal ("stopped by SIGUSR2") and the launcher's first line described both kinds of script at once, the one
that commits a checkpoint and the one stopped with nothing saved, whichever was running (issue 37). So:

- the launcher writes what the user did into RUN/stop-asked.json before it passes the signal on (`ask`), and rank 0
  names it in its line (`asked_by`);
- `hpcjobs cancel` leaves its mark there before its SIGTERM (`cancel`), so the stop is told from a `kill`;
- rank 0 writes into RUN/joined.json whether the script takes part in the stop protocol now (`set_joined`: the
  shared trainer and a StopGuard from their start, the integrations for the length of `train()` / `fit()` / the
  loop), so the launcher's line says the case that applies (`case`).

Each record carries the job's id: a record left by an earlier job of the run folder is not read as this one's.
Torch-free: the launcher imports it.
"""

from __future__ import annotations

import json
import signal
from typing import Any

from hpcjobs.protocol.runfolder import RunFolder, write_json_atomic

CANCEL = "hpcjobs cancel"
"""The words for `hpcjobs cancel`, which reaches the launching process as SIGTERM."""


def words(signum: int, cancelled: bool = False) -> str:
    """What the user did, as they would say it."""
    if cancelled:
        return CANCEL
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _read(path: Any, job_id: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and data.get("job_id") == job_id else {}


def cancel(run: RunFolder, job_id: str) -> None:
    """`hpcjobs cancel`, before it sends the launching process SIGTERM."""
    write_json_atomic(run.stop_asked, {"job_id": job_id, "by": CANCEL, "sent": False})


def cancelled(run: RunFolder, job_id: str) -> bool:
    record = _read(run.stop_asked, job_id)
    return record.get("by") == CANCEL and not record.get("sent")


def ask(run: RunFolder, job_id: str, by: str) -> None:
    """The launching process, before it passes the user's stop on to the ranks."""
    write_json_atomic(run.stop_asked, {"job_id": job_id, "by": by, "sent": True})


def asked_by(run: RunFolder | None, job_id: str | None) -> str | None:
    """What the user did to stop this job, if the launcher said so (a local job); None otherwise."""
    if run is None or not job_id:
        return None
    record = _read(run.stop_asked, job_id)
    return str(record["by"]) if record.get("sent") and record.get("by") else None


def set_joined(run: RunFolder | None, job_id: str | None, joined: bool) -> None:
    """Rank 0: whether the script takes part in the stop protocol from now on (a local job only)."""
    if run is not None and job_id:
        try:
            write_json_atomic(run.joined, {"job_id": job_id, "joined": joined})
        except OSError:
            pass  # the launcher's line is then the general one; the stop itself is unchanged


def joined(run: RunFolder, job_id: str) -> bool:
    return bool(_read(run.joined, job_id).get("joined"))


def case(kind: str, joined_now: bool) -> str:
    """What the stop does to the ranks, for the case that applies."""
    if kind == "task":
        return "every rank commits a checkpoint at the next step, then exits"
    if joined_now:
        return "this script commits a checkpoint at its next step all ranks agree on, then exits"
    return "this script has not joined hpcjobs's stop protocol: it stops now, and hpcjobs saves nothing for it"
