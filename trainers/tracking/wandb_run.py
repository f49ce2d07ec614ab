"""Weights & Biases: one wandb run per training run, offline without credentials (see trainers/tracking/__init__.py)."""

from __future__ import annotations

import netrc
import os
import re
import secrets
import string
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpcjobs.protocol.runfolder import RunFolder
from trainers.tracking.common import Job, TrackerFile, import_package, say

WANDB_FINISH_TIMEOUT_S = 30.0
"""The longest a wandb run's finish waits for its upload (see wandb_settings)."""


class WandbTracker:
    """One wandb run per training run: its id is chosen here (W&B's own alphabet) and recorded before `wandb.init`,
    so a start that dies inside init still leaves the id the next start resumes."""

    def __init__(self, run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any]) -> None:
        wandb = import_package("wandb")
        entry = state.entry("wandb")
        if not isinstance(entry.get("id"), str):
            entry["id"] = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))
            state.save()
        mode = wandb_mode(os.environ)
        if mode is not None:
            say(f"tracker wandb: no WANDB_MODE and no W&B credentials: logging offline into {run.path / 'wandb'} "
                f"(upload with `wandb sync {run.path / 'wandb'}/offline-run-*`, or set WANDB_MODE=online)")
        first = not entry.get("config_logged")
        self.run = wandb.init(id=entry["id"], resume="allow", dir=str(run.path),
                              project=os.environ.get("WANDB_PROJECT") or wandb_project(job.name),
                              name=job.run_name, config=config if first else None, mode=mode,
                              settings=wandb_settings(wandb))
        if first:
            entry["config_logged"] = True
            state.save()

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def close(self, finished: bool) -> None:
        """A start that ends before the run does marks it preempting and exits non-zero: W&B shows it preempted,
        not finished, until the next start resumes it."""
        if not finished:
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if finished else 1)


def wandb_settings(wandb: Any) -> Any:
    """Console capture off (the rank logs are RUN/logs), and `finish` bounded: a stop closes the trackers after its
    checkpoint and before it requeues the job, within the time the profile's signal leaves; what is not uploaded by
    then stays in RUN/wandb for `wandb sync`. A wandb without finish_timeout (older ones) blocks until uploaded."""
    try:
        return wandb.Settings(console="off", finish_timeout=WANDB_FINISH_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - an older wandb refuses the unknown setting
        return wandb.Settings(console="off")


def wandb_mode(environ: Mapping[str, str]) -> str | None:
    """"offline" when nothing says how to reach W&B (no WANDB_MODE, no credentials): wandb would otherwise fail the
    start asking for a login on a compute node that cannot answer. None: wandb decides (WANDB_MODE, or online)."""
    if any(environ.get(v) for v in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")):
        return None
    host = urllib.parse.urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    path = environ.get("NETRC") or str(Path(environ.get("HOME") or Path.home()) / ".netrc")
    try:
        found = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    return None if found else "offline"


def wandb_project(name: str) -> str:
    """W&B refuses project names with /, \\, #, ?, %, : and over 128 characters."""
    return re.sub(r"[/\\#?%:\s]+", "-", name)[:128] or "hpcjobs"


LOGS_ONCE = True
"""Whether a step already in the tracker's run is left out on a resume (a step below the run's current one is
dropped by wandb)."""


def open_run(run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any],
             start_step: int) -> WandbTracker:
    return WandbTracker(run, state, job, config)
