"""`hpcjobs compare`: a sweep's runs side by side (one row per run folder: its point, state, steps, restarts, last
and best loss) and, with --plot, their loss curves in one picture.

Everything comes from the run folders (spec.json's `point`, metrics.jsonl, the markers), so runs can be compared
wherever their folders can be read, with or without the job store or a scheduler; a job record, when one is known,
only makes the state better (status_of asks the scheduler). Torch-free; the --plot picture is plot.py's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcjobs.follow.status import folder_state, last_step, restart_count, status_of
from hpcjobs.jobs.store import JobRecord, JobStore
from hpcjobs.protocol.errors import RuntimeFailure, UsageError
from hpcjobs.protocol.runfolder import RunFolder, read_jsonl
from hpcjobs.protocol.states import JobState, StopReason

Curve = tuple[tuple[int, float], ...]
"""(step, value) pairs in step order, one per step."""

RUN_FOLDER_HOLDS = "a run folder holds spec.json (written at submit) and metrics.jsonl (written as it trains)"


@dataclass(frozen=True)
class Row:
    """One run of the comparison. `best` is the lowest val_loss when the run evaluated at all (the training loss
    flatters a run that overfits), else the lowest training loss; `best_metric` says which."""

    run_dir: str
    job_id: str | None
    point: dict[str, str]
    state: str
    state_source: str
    steps: int | None
    restarts: int
    last_loss: float | None
    best: float | None
    best_metric: str
    best_step: int | None
    ettr: float | None = None
    """Productive training time / allocated time (hpcjobs.goodput.buckets), when any start is recorded."""
    goodput_s: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    """Seconds per goodput bucket (what --plot draws; `hpcjobs goodput --json` has them all)."""
    loss_curve: Curve = field(default=(), repr=False, compare=False)
    val_curve: Curve = field(default=(), repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe: no curves (metrics.jsonl has them), non-finite losses as null (JSON has no NaN)."""
        out = asdict(self)
        del out["loss_curve"], out["val_curve"], out["goodput_s"]
        for key in ("last_loss", "best"):
            out[key] = out[key] if out[key] is None or math.isfinite(out[key]) else None
        return out

    @property
    def label(self) -> str:
        """What a plot's legend calls the run: its point, which is what differs across a sweep."""
        return " ".join(f"{k}={v}" for k, v in sorted(self.point.items())) or Path(self.run_dir).name


# --- reading a run folder -------------------------------------------------------------------------------------------

def curves(run: RunFolder) -> tuple[Curve, Curve]:
    """The loss and val_loss curves. A resumed run logs the steps after its checkpoint again (trim_metrics drops the
    first start's lines only once the resumed one starts logging), so the last record of a step wins."""
    loss: dict[int, float] = {}
    val: dict[int, float] = {}
    for rec in read_jsonl(run.metrics):
        step = rec.get("step") if isinstance(rec, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, into in (("loss", loss), ("val_loss", val)):
            value = rec.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                into[step] = float(value)
    return tuple(sorted(loss.items())), tuple(sorted(val.items()))


def best_of(loss: Curve, val: Curve) -> tuple[float | None, str, int | None]:
    """The lowest finite value (the earliest step on a tie), of val_loss when evaluated, else of loss."""
    metric, curve = ("val_loss", val) if val else ("loss", loss)
    finite = [(value, step) for step, value in curve if math.isfinite(value)]
    if not finite:
        return None, metric, None
    value, step = min(finite)
    return value, metric, step


def point_of(run: RunFolder, record: JobRecord | None) -> dict[str, str]:
    """spec.json's `point` (a sweep's parameters for this run), else the job record's, else the one its first start
    recorded; {} outside a sweep."""
    spec = run.read("spec")
    point = spec.get("point") if isinstance(spec, dict) else None
    if not isinstance(point, dict) and record is not None:
        point = record.spec.get("point")
    if not isinstance(point, dict):  # a rendered array run with sbatch has no spec.json: its starts name the point
        point = next((r["point"] for r in run.read_restarts() if isinstance(r.get("point"), dict)), None)
    return {str(k): str(v) for k, v in point.items()} if isinstance(point, dict) else {}


def folder_only_state(run: RunFolder) -> tuple[JobState, str]:
    """The state when no job record is known: final.json's word, else a stop at a checkpoint, else nothing can tell
    a run that is still going from one that was killed (only the scheduler or the launching process knows)."""
    final = run.read("final")
    if isinstance(final, dict) and (state := folder_state(run, str(final.get("job_id")))[0]) is not None:
        return state, "run folder (final.json)"  # not a failure the job recovered from: it started again since
    history = run.read_restarts()
    if history and "stopped" in history[-1] and history[-1]["stopped"] != StopReason.FAULT:  # a fault: recovering
        return JobState.STOPPED, f"run folder (stopped: {history[-1]['stopped']}; resumable)"
    return JobState.UNKNOWN, "run folder (no job record and no final word: running, or killed)"


def check_run_folder(path: Path, job_id: str | None = None) -> None:
    """A folder given to compare must be a run folder; a typo must not become a row of dashes."""
    whose = f" (job {job_id})" if job_id else ""
    if not path.is_dir():
        why = "is a file, not a folder" if path.exists() else "does not exist"
        raise UsageError(f"run folder {path}{whose} {why}.",
                         f"{RUN_FOLDER_HOLDS}; `hpcjobs list` shows jobs and `hpcjobs status ID` their folders.")
    run = RunFolder(path)
    if not run.spec.is_file() and not run.metrics.is_file():
        raise UsageError(f"{path}{whose} is not a run folder: it holds neither spec.json nor metrics.jsonl.",
                         f"{RUN_FOLDER_HOLDS}; give the run folder itself (e.g. runs/lm-...), not its parent.")


def row_for(path: str | os.PathLike[str], record: JobRecord | None = None) -> Row:
    """A run folder's row; with its job record the state is status_of's (scheduler, then run folder)."""
    run = RunFolder(path)
    if record is not None:
        st = status_of(record)
        state, source = st.state, st.state_source
    else:
        state, source = folder_only_state(run)
    loss, val = curves(run)
    best, metric, at = best_of(loss, val)
    step = last_step(run)[0]
    if step is None and (loss or val):
        step = max(s for s, _ in (*loss, *val))
    return Row(os.path.abspath(path), record.job_id if record else None, point_of(run, record), str(state), source,
               step, restart_count(run), loss[-1][1] if loss else None, best, metric, at,
               *goodput_of(run, record, state), loss, val)


def goodput_of(run: RunFolder, record: JobRecord | None, state: JobState) -> tuple[float | None, dict[str, float]]:
    """The run's ETTR and goodput buckets over every job that ran in its folder (`record`: the newest, whose state
    is `state`); no buckets before a start."""
    from hpcjobs.goodput.buckets import total
    from hpcjobs.goodput.report import folder_goodput

    parts = folder_goodput(run, record, state)
    whole = total(parts, str(run.path))
    return whole.ettr, dict(whole.buckets) if parts else {}


def records_by_folder(store: JobStore) -> dict[str, JobRecord]:
    """The newest job record of each run folder, so a folder given by path still gets the scheduler's state. A job
    store that cannot be read leaves the run folders alone to answer."""
    try:
        records = store.recent(2**62)
    except RuntimeFailure:
        return {}
    found: dict[str, JobRecord] = {}
    for rec in records:  # newest first
        found.setdefault(os.path.realpath(rec.run_dir), rec)
    return found


def rows_for(runs: Iterable[str | os.PathLike[str] | JobRecord], store: JobStore | None = None) -> list[Row]:
    """One row per run (a run folder, or a job record whose run folder it is), in sweep order (point, then folder);
    a folder given twice counts once. With `store`, a folder given by path is matched to its newest job record."""
    runs = list(runs)
    paths_given = any(not isinstance(item, JobRecord) for item in runs)
    by_folder = records_by_folder(store) if store is not None and paths_given else {}
    chosen: dict[str, tuple[Path, JobRecord | None]] = {}
    for item in runs:
        record = item if isinstance(item, JobRecord) else None
        path = Path(item.run_dir if isinstance(item, JobRecord) else item)
        key = os.path.realpath(path)
        if record is None:
            check_run_folder(path)
            record = by_folder.get(key)
        elif path.exists():
            check_run_folder(path, record.job_id)  # a pending job's folder may not exist yet: its row says so
        if key not in chosen or chosen[key][1] is None:
            chosen[key] = (path, record)
    rows = [row_for(path, record) for path, record in chosen.values()]
    keys = point_keys(rows)
    return sorted(rows, key=lambda r: (point_order(r.point, keys), r.run_dir))


# --- the table --------------------------------------------------------------------------------------------------------

def point_keys(rows: Sequence[Row]) -> list[str]:
    return sorted({k for r in rows for k in r.point})


def point_order(point: Mapping[str, str], keys: Sequence[str]) -> tuple[tuple[int, float, str], ...]:
    """Numbers by value (1e-4 before 3e-4 before 1e-3, which text order gets wrong), then text; a missing key last."""
    def one(value: str | None) -> tuple[int, float, str]:
        if value is None:
            return 2, 0.0, ""
        try:
            number = float(value)
        except ValueError:
            return 1, 0.0, value
        return (0, number, value) if math.isfinite(number) else (1, 0.0, value)
    return tuple(one(point.get(k)) for k in keys)


def number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if value == 0 or 0.01 <= abs(value) < 1e5 or not math.isfinite(value) else f"{value:.3e}"


def shown_path(path: str) -> str:
    """Relative to here when below here (short, and still unambiguous for `sweep-ID/N` folders)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def table(rows: Sequence[Row]) -> tuple[list[str], list[tuple[str, ...]]]:
    """Header and cells: one column per point key (over all runs), then the run and how it did."""
    keys = point_keys(rows)
    metrics = {r.best_metric for r in rows}
    best_header = f"best {metrics.pop()}" if len(metrics) == 1 else "best (metric)"
    header = [*keys, "run", "job", "state", "steps", "restarts", "last loss", best_header, "ETTR"]
    cells = []
    for r in rows:
        best = number(r.best) if len(metrics) <= 1 or r.best is None else f"{number(r.best)} ({r.best_metric})"
        cells.append((*(r.point.get(k, "-") for k in keys), shown_path(r.run_dir), r.job_id or "-", r.state,
                      "-" if r.steps is None else str(r.steps), str(r.restarts), number(r.last_loss), best,
                      "-" if r.ettr is None else f"{r.ettr:.0%}"))
    return header, cells
