"""Everything the commands print, in one place: JSON records, tables (rich on a terminal, aligned text otherwise),
the dry run, the submitted and ended lines, a job's status rows and a sweep's, the doctor's header. The commands
decide what to show; this module decides how it reads."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import yaml

from hpcjobs.request.credentials import states

if TYPE_CHECKING:
    from pathlib import Path

    from hpcjobs.backends import SubmitRequest, Submitted
    from hpcjobs.follow.status import JobStatus
    from hpcjobs.goodput.buckets import Goodput
    from hpcjobs.goodput.compare import Row
    from hpcjobs.protocol.states import JobState
    from hpcjobs.request.after import After
    from hpcjobs.request.checks import Check
    from hpcjobs.request.spec import JobSpec


def print_json(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def table(header: list[str], rows: Sequence[tuple[object, ...]]) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        shown = Table(*header)
        for row in rows:
            shown.add_row(*(str(c) for c in row))
        Console().print(shown)
        return
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in [tuple(header), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


# --- submit / render ----------------------------------------------------------------------------------------------

def memory_text(spec: JobSpec, tasks_args: list[tuple[str, ...]]) -> str:
    """The memory plan's line for each task of the job (hpcjobs.request.gpu_fit), for the dry run."""
    from hpcjobs.request.gpu_fit import plan_line

    lines = [plan_line(spec.profile, spec.entry.target, args, spec.ranks, spec.gpus_per_node) for args in tasks_args]
    known = f"# memory plan: none: a {spec.entry.kind}'s model is known on the node only"
    return "\n".join(dict.fromkeys(lines)) or known


def memory_plans(spec: JobSpec, tasks_args: list[tuple[str, ...]]) -> list[dict[str, object] | None]:
    """The memory plan of each task of the job in bytes (None: not known on this side), for `--dry-run --json`."""
    from hpcjobs.request.gpu_fit import job_plan

    found = [job_plan(spec.entry.target, args, spec.ranks) for args in tasks_args]
    return [None if f is None else {"what": f.what(), **f.plan.as_dict()} for f in found]


def brief(recorded: dict[str, Any]) -> dict[str, Any]:
    """A spec as a person reads it: the snapshot's diff counted, not shown (spec.json keeps it)."""
    snap = recorded.get("snapshot")
    if not snap or not snap.get("git_diff"):
        return recorded
    lines = snap["git_diff"].count("\n")
    return {**recorded, "snapshot": {**snap, "git_diff": f"{lines} lines (kept in the run folder's spec.json)"}}


def points_text(spec: JobSpec) -> str:
    """A sweep's points, one line each, as the array tasks will get them."""
    from hpcjobs.protocol.points import as_args

    if not spec.array:
        return ""
    head = f"# --- {len(spec.points)} points, one array task each" + (
        f", at most {spec.max_parallel} at once" if spec.max_parallel else "") + " ---\n"
    return head + "".join(f"task {i}: {' '.join(as_args(p))}\n" for i, p in enumerate(spec.points))


def dry_run(spec: JobSpec, request: SubmitRequest, tasks_args: list[tuple[str, ...]], as_json: bool,
            model_plan: dict[str, Any] | None = None) -> None:
    """What `submit --dry-run` shows: the world, the memory plan, the spec, a sweep's points and the request;
    `model_plan`: `--model config.json`'s (hpcjobs.request.hf_plan.model_plan_record), in the JSON record."""
    if as_json:
        print_json({"dry_run": True, "world": spec.world(), "spec": spec.as_dict(), "request": request.text,
                    "points": [dict(p) for p in spec.points], "memory_plan": memory_plans(spec, tasks_args),
                    **({"model_plan": model_plan} if model_plan is not None else {}),
                    **({"secrets": states(spec.secrets)} if spec.secrets else {})})
        return
    print(f"# dry run: {spec.world()}; nothing submitted")
    if spec.secrets:
        print("# secrets, from this shell's environment (never written): "
              + ", ".join(f"{n} {s}" for n, s in states(spec.secrets).items()))
    print(memory_text(spec, tasks_args))
    print(yaml.safe_dump(brief(spec.as_dict()), sort_keys=True).rstrip())
    print(points_text(spec), end="")
    print(f"# --- the request the {spec.profile.scheduler} backend would submit ---")
    print(request.text, end="")


def ended_line(sub: Submitted) -> str:
    """How a foreground (local) job ended, in one line: its run folder's final word when it failed, if this job
    wrote it (a refused resume ends with an earlier job's final.json in place)."""
    from hpcjobs.follow.status import folder_state
    from hpcjobs.protocol.runfolder import RunFolder

    _, reason = folder_state(RunFolder(sub.run_dir), sub.job_id)
    why = f": {reason}" if sub.returncode and reason else ""
    return f"Job {sub.job_id} ended with code {sub.returncode}{why}; run folder {sub.run_dir}"


def submitted(spec: JobSpec, sub: Submitted, as_json: bool) -> None:
    """What `submit` says of a job it queued (how to follow it), or of one that ran in the foreground (how each
    ended)."""
    if as_json:
        print_json({**sub.as_dict(), "world": spec.world(), "name": spec.name, "profile": spec.profile.name})
    elif sub.returncode is None:
        tasks = f", an array of {len(sub.tasks)} tasks {sub.job_id}_0 to {sub.job_id}_{len(sub.tasks) - 1}"
        print(f"Submitted job {sub.job_id} ({spec.name}: {spec.world()}{tasks if sub.tasks else ''})")
        print(f"  run folder: {sub.run_dir}")
        logs = f"{sub.job_id}_0" if sub.tasks else sub.job_id
        print(f"  follow:     hpcjobs status {sub.job_id}  |  hpcjobs logs {logs} --follow")
    else:
        for done in sub.tasks or (sub,):
            print(ended_line(done))


def chain_planned(rows: Sequence[tuple[str, str, str, list[str]]], as_json: bool) -> None:
    """A chain's dry run: each step (name, entry, world, what it waits for) in the order it would be queued."""
    if as_json:
        print_json({"steps": [{"step": n, "entry": e, "world": w, "after": a} for n, e, w, a in rows]})
        return
    for name, entry, world, after in rows:
        print(f"step {name}: {entry} on {world}" + (f", after {', '.join(after)}" if after else ""))


def chain_submitted(ids: Mapping[str, str | None], as_json: bool) -> None:
    """Each step's job id (None: not started)."""
    if as_json:
        print_json({"steps": [{"step": name, "job_id": job} for name, job in ids.items()]})
        return
    for name, job in ids.items():
        print(f"step {name}: {'job ' + job if job else 'not started'}")
    started = [job for job in ids.values() if job]
    if started:
        print(f"  follow: hpcjobs status {started[-1]}  (each step's `after:` row says what it waits for)")


def rendered(path: Path, spec: JobSpec) -> None:
    print(f"Wrote {path} ({spec.world()}); submit it with: sbatch {path}", file=sys.stderr)


def yaml_text(mapping: Mapping[str, object]) -> None:
    """A mapping as YAML in its own order (a resolved profile)."""
    print(yaml.safe_dump(mapping, sort_keys=False).rstrip())


# --- status / list ------------------------------------------------------------------------------------------------

def waits_for(st: JobStatus, after: Sequence[tuple[After, JobState]]) -> str:
    """The `after` row: each upstream job, its condition and state, and what that means for this job."""
    parts = []
    for a, state in after:
        met = a.met_by(state)
        what = ("met" if met else "never met: this job will not start" if met is False and not st.state.finished
                else "not met" if met is False else "waiting for it to end")
        parts.append(f"{a.job_id} ({a.condition}): {state}, {what}")
    return "; ".join(parts)


def status(st: JobStatus, goodput: Goodput | None, after: Sequence[tuple[After, JobState]] = ()) -> None:
    """One job's status, a row per fact."""
    from hpcjobs.goodput.report import status_line

    rows: list[tuple[str, object]] = [
        ("job", f"{st.job_id} ({st.name}, profile {st.profile}, {st.nodes}×{st.gpus_per_node})"),
        ("state", f"{st.state} (from {st.state_source})"), ("restarts", restarts_text(st)),
        ("last step", f"{st.last_step if st.last_step is not None else '-'} ({age(st.last_step_age_s)} ago)"),
        ("run folder", st.run_dir), ("logs", f"hpcjobs logs {st.job_id} [--rank R] [--restart N]")]
    if st.final_reason:
        rows.insert(2, ("refused" if st.state == "REFUSED" else "ended", st.final_reason))  # JobState: a str
    if st.first_failure:
        rows.insert(3, ("failed first", st.first_failure))
        rows.insert(4, ("its log", "\n".join([str(st.failure_log), *(f"{'':13}| {line}" for line in st.failure_tail)])))
    if goodput:
        rows.insert(-2, ("goodput", status_line(goodput)))
    if after:
        rows.insert(2, ("after", waits_for(st, after)))
    at = next(i for i, (key, _) in enumerate(rows) if key == "restarts") + 1
    rows[at:at] = [("node failed", fault) for fault in st.node_faults] + (
        [("recoveries", f"{st.recoveries}; the last {st.last_recovery}")] if st.recoveries else [])
    if st.nccl_traces:
        rows.append(("nccl trace", f"{st.nccl_traces} (NCCL's flight recorder: which rank stopped in which "
                                   "collective; torchfrtrace reads it)"))
    for key, value in rows:
        print(f"{key + ':':12} {value}")


def restarts_text(st: JobStatus) -> str:
    """The restart count, and the scheduler's own where it counts otherwise (recoveries in the allocation are
    starts it never saw; a requeued job counts its next start while it waits)."""
    theirs = st.scheduler_restarts
    return f"{st.restarts}" + (f" (the scheduler requeued it {theirs} time{'s' if theirs != 1 else ''})"
                               if theirs and theirs != st.restarts else "")


def array_status(array_id: str, statuses: list[JobStatus], points: Sequence[Mapping[str, object] | None],
                 as_json: bool) -> None:
    """A sweep's array: one row per task, then how many are in each state."""
    from collections import Counter

    if as_json:
        print_json({"array": array_id, "tasks": [{**s.as_dict(), "point": p} for s, p in zip(statuses, points,
                                                                                            strict=True)]})
        return
    table(["task", "point", "state", "restarts", "step", "run folder"],
          [(s.job_id, " ".join(f"{k}={v}" for k, v in (p or {}).items()) or "-", s.state, s.restarts,
            "-" if s.last_step is None else s.last_step, s.run_dir) for s, p in zip(statuses, points, strict=True)])
    counts = Counter(str(s.state) for s in statuses)
    print(f"array {array_id}: {len(statuses)} tasks: " + ", ".join(f"{n} {state}" for state, n in sorted(
        counts.items())) + f". One task: hpcjobs status {array_id}_N")


def jobs(statuses: list[JobStatus]) -> None:
    """`hpcjobs list`: one row per job, newest first."""
    now = time.time()
    table(["job", "name", "profile", "nodes×gpus", "state", "restarts", "step", "age"],
          [(s.job_id, s.name, s.profile, f"{s.nodes}×{s.gpus_per_node}", s.state, s.restarts,
            "-" if s.last_step is None else s.last_step, age(now - s.submitted)) for s in statuses])


# --- doctor / compare ---------------------------------------------------------------------------------------------

def doctor(spec: JobSpec, checks: list[Check], as_json: bool) -> None:
    """The doctor's checks: a header naming the request, then one row per check (or JSON)."""
    from hpcjobs.request.checks import exit_code
    from hpcjobs.request.checks import table as checks_table

    if as_json:
        print_json({"world": spec.world(), "profile": spec.profile.name, "checks": [c.as_dict() for c in checks],
                    "ok": exit_code(checks) == 0})
        return
    print(f"hpcjobs doctor: {spec.world()}, profile {spec.profile.name}, --time {spec.time}")
    print(checks_table(checks))


def plotted(path: Path, runs: int) -> None:
    print(f"Wrote {path} (loss curves of {runs} run(s))", file=sys.stderr)


def compared(rows: list[Row], as_json: bool) -> None:
    """`hpcjobs compare`'s rows, side by side or as JSON."""
    from hpcjobs.goodput import compare

    if as_json:
        print_json([r.as_dict() for r in rows])
    else:
        table(*compare.table(rows))
