"""Following submitted jobs: state from squeue, then sacct where it exists, then the run folder's own markers.

Sites without accounting are common (sacct exits 1), and submitit's own state stays UNKNOWN there, so nothing here
depends on sacct: the run folder (final.json, heartbeat.json, restarts.jsonl) always has the last word on how a
training run ended.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from hpcjobs.errors import RuntimeFailure, UsageError
from hpcjobs.runfolder import RunFolder
from hpcjobs.store import JobRecord, JobStore

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
                   "DEADLINE", "STOPPED"}


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(list(argv), 124, "", f"{argv[0]}: timed out")


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    name: str
    profile: str
    nodes: int
    gpus_per_node: int
    state: str
    state_source: str
    """Where the state came from: squeue, sacct, run folder, store, or none."""
    restarts: int
    last_step: int | None
    last_step_age_s: float | None
    final_reason: str | None
    run_dir: str
    logs: dict[str, Any]
    submitted: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def squeue_state(job_id: str, run: Runner) -> str | None:
    out = run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"])  # finished ones too
    state = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    return state or None


def sacct_state(job_id: str, run: Runner) -> str | None:
    out = run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return out.stdout.strip().splitlines()[-1].split()[0]  # "CANCELLED by 0" -> CANCELLED


def folder_state(run: RunFolder) -> tuple[str | None, str | None]:
    final = run.read("final")
    if isinstance(final, dict):
        return ("COMPLETED" if final.get("state") == "finished" else "FAILED"), final.get("reason")
    return None, None


def restart_count(run: RunFolder) -> int:
    starts = [r.get("restart", 0) for r in run.read_restarts() if "stopped" not in r]
    return max(starts, default=0)


def status_of(rec: JobRecord, run_cmd: Runner = run_command) -> JobStatus:
    run = RunFolder(rec.run_dir)
    fstate, reason = folder_state(run)
    state, source = None, "none"
    if rec.scheduler == "slurm":
        state = squeue_state(rec.job_id, run_cmd)
        source = "squeue" if state else source
        if state is None:
            state = sacct_state(rec.job_id, run_cmd)
            source = "sacct" if state else source
    if state is None and fstate:
        state, source = fstate, "run folder"
    if state is None and rec.cancelled:
        state, source = "CANCELLED", "store"
    if state is None and rec.scheduler == "local" and run.heartbeat.exists():
        history = run.read_restarts()
        stopped = bool(history) and "stopped" in history[-1]  # Ctrl-C: checkpointed and stopped, resumable
        state, source = ("STOPPED" if stopped else "RUNNING"), "run folder"
    if state is None:
        state = "UNKNOWN"
    beat = run.read("heartbeat") or {}
    step = beat.get("step")
    age = time.time() - beat["time"] if "time" in beat else None
    return JobStatus(rec.job_id, rec.name, rec.profile, rec.nodes, rec.gpus_per_node, state, source,
                     restart_count(run), step, age, reason, rec.run_dir, rec.logs, rec.submitted)


def find(job_id: str, store: JobStore) -> JobRecord:
    rec = store.get(job_id)
    if rec is None:
        recent = ", ".join(r.job_id for r in store.recent(5)) or "none yet"
        raise UsageError(f"no job {job_id!r} was submitted with hpcjobs here (recent: {recent}).",
                         "`hpcjobs list` shows the jobs hpcjobs knows; HPCJOBS_HOME selects another record.")
    return rec


def log_path(rec: JobRecord, rank: int = 0, restart: int | None = None) -> Path:
    run = RunFolder(rec.run_dir)
    restarts = run.restart_dirs()
    if restart is None:
        if not restarts:
            raise UsageError(f"job {rec.job_id} has no logs yet in {run.logs} (it may still be pending).",
                             f"`hpcjobs status {rec.job_id}` shows its state.")
        restart = restarts[-1]
    path = run.rank_log(restart, rank)
    if not path.exists():
        ranks = sorted(p.stem.split("-")[1] for p in path.parent.glob("rank-*.log"))
        raise UsageError(f"job {rec.job_id} has no log for rank {rank} restart {restart}; restarts: "
                         f"{restarts or 'none'}, ranks of that restart: {', '.join(ranks) or 'none'}.",
                         "pick one of those with --rank and --restart.")
    return path


def follow(path: Path, out: Callable[[str], None], done: Callable[[], bool], poll_s: float = 0.5) -> None:
    """Print the file, then what is appended, until done() says the job ended."""
    with open(path, errors="replace") as f:
        while True:
            chunk = f.read()
            if chunk:
                out(chunk)
            elif done():
                out(f.read())
                return
            else:
                time.sleep(poll_s)


def cancel(rec: JobRecord, store: JobStore, run_cmd: Runner = run_command) -> str:
    """scancel the job (a no-op with a message when it already ended); record the cancel."""
    st = status_of(rec, run_cmd)
    if st.state in FINISHED_STATES:
        return f"job {rec.job_id} already ended ({st.state}); nothing to cancel"
    if rec.scheduler == "local":
        return f"job {rec.job_id} runs locally ({st.state}): stop it with Ctrl-C where it runs (it checkpoints first)"
    out = run_cmd(["scancel", rec.job_id])
    if out.returncode != 0:
        raise RuntimeFailure(f"scancel {rec.job_id} failed: {(out.stderr or out.stdout).strip()}",
                             "check that the job is yours and Slurm answers (`squeue --me`).")
    store.mark_cancelled(rec.job_id)
    return f"job {rec.job_id} cancelled (was {st.state})"
