"""The `hpcjobs` command: one small add/run pair per subcommand and one error boundary (main).

argparse, deliberately: it is in the standard library (nothing to import on a login node but what we use), it passes
an entry's own arguments through untouched (REMAINDER), and its help is easy to extend with examples.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import yaml

from hpcjobs import __version__
from hpcjobs.protocol.errors import HpcjobsError, UsageError
from hpcjobs.protocol.helpflags import HELP_FLAGS, asks_help

EXAMPLES = {
    "submit": """examples:
  hpcjobs submit --profile mycluster --nodes 2 --gpus 8 --time 4:00:00 trainers.tasks.lm --size small --steps 5000
  hpcjobs submit --profile mycluster --nodes 2 --gpus 8 train.py --config configs/x.yaml   # your own script
  hpcjobs submit --profile mycluster -m mypkg.train --lr 3e-4                               # python -m style
  hpcjobs submit --profile local --gpus 2 trainers.tasks.lm --steps 50                     # this machine
  hpcjobs submit --profile mycluster --nodes 2 --gpus 8 --dry-run trainers.tasks.lm        # show, submit nothing
  hpcjobs submit --profile mycluster --sweep lr=1e-3,3e-4 --sweep seed=1,2,3 --max-parallel 2 trainers.tasks.lm
                                                          # a 6-point grid: one array task (and run folder) each""",
    "doctor": """examples:
  hpcjobs doctor --profile mycluster --nodes 2 --gpus 8 --time 4:00:00    # ✓/✗ per check, exit 0 if none failed
  hpcjobs doctor --profile mycluster --nodes 2 --gpus 8 --json trainers.tasks.lm --size small""",
    "render": """examples:
  hpcjobs render --profile mycluster --nodes 2 --gpus 8 -o train.sbatch trainers.tasks.lm --size small
  sbatch train.sbatch""",
    "profiles": """examples:
  hpcjobs profiles              # names, where each came from
  hpcjobs profiles show local   # the resolved profile with every key""",
    "status": "examples:\n  hpcjobs status 1234\n  hpcjobs status 1234 --json\n"
              "  hpcjobs status 1240      # a sweep: one row per task\n  hpcjobs status 1240_3    # one task",
    "list": "examples:\n  hpcjobs list\n  hpcjobs list --state RUNNING --profile mycluster --json",
    "logs": "examples:\n  hpcjobs logs 1234                 # rank 0, latest restart\n"
            "  hpcjobs logs 1234 --rank 5 --restart 0\n  hpcjobs logs 1234 --follow",
    "export": "examples:\n  hpcjobs export 4242 -o model.safetensors\n  hpcjobs export runs/lm-x --step 2000 -o m.pt",
    "cancel": "examples:\n  hpcjobs cancel 1234 1235\n  hpcjobs cancel 1240     # every task of a sweep",
    "goodput": "examples:\n  hpcjobs goodput 1234\n  hpcjobs goodput 1240 --json   # a sweep: each task and the total\n"
               "  hpcjobs goodput runs/lm-x     # every job that ran in a run folder",
    "compare": """examples:
  hpcjobs compare RUN_OR_ID... [--plot loss.png] [--json]
  hpcjobs compare 1234 --plot loss.png          # every task of sweep (job array) 1234, and their loss curves
  hpcjobs compare runs/lm-a runs/lm-b --json    # run folders, as JSON rows""",
}


class Parser(argparse.ArgumentParser):
    """Usage errors as one line with a hint, exit code 2; long options only as typed in full (a prefix of one of
    ours must never swallow a flag meant for the entry)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # argparse quotes unrecognized arguments as typed, newlines and all
        stop = "" if message.endswith(("?", ".")) else "."
        self.exit(2, f"{self.prog}: error: {message}{stop} HINT: {self.prog} --help shows the flags and examples.\n")


def _parser(sub: Any, name: str, help_: str, **kw: Any) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_, description=help_, epilog=EXAMPLES.get(name),
                          formatter_class=argparse.RawDescriptionHelpFormatter, **kw)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


SQLITE_MAX = 2**63 - 1
"""The largest integer the job store's sqlite takes (a larger --limit overflowed it)."""


def _limit(text: str) -> int:
    count = _int(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count}: valid: 1 or more")
    return min(count, SQLITE_MAX)  # more than sqlite counts is all of them


def _job_state(text: str) -> Any:
    from hpcjobs.protocol.states import JobState

    state = JobState.parse(text)
    if state is JobState.UNKNOWN and text.strip().upper() != "UNKNOWN":
        raise argparse.ArgumentTypeError(f"{text!r} is not a job state; valid: {', '.join(s.value for s in JobState)}")
    return state


def _job_flags(entry_optional: bool = False) -> argparse.ArgumentParser:
    p = Parser(add_help=False)
    p.add_argument("--profile", required=True, help="cluster profile: a name (`hpcjobs profiles`) or a .yaml path")
    p.add_argument("--nodes", type=_int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus", type=_int, default=None,
                   help="GPUs per node, one rank per GPU (like torchrun's --nproc_per_node); ranks = nodes × gpus. "
                        "Default: all of a node's GPUs per the profile")
    p.add_argument("--time", help="time limit in Slurm notation, e.g. 4:00:00 or 1-00:00:00 (default: profile's)")
    p.add_argument("--name", help="job name (default: from the entry)")
    p.add_argument("--partition", help="override the profile's partition")
    p.add_argument("--account", help="override the profile's account")
    p.add_argument("--qos", help="override the profile's qos")
    p.add_argument("--run-dir", help="run folder (checkpoints, metrics, logs); an existing one is resumed")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="extra environment (repeat)")
    p.add_argument("-m", "--module", action="store_true", help="ENTRY is a module run like `python -m ENTRY`")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="sweep a flag of the entry (repeat: the grid of all): one Slurm array task per point, each "
                        "with its own run folder, the point passed as --KEY VALUE")
    p.add_argument("--sweep-file", metavar="YAML", help="the sweep's points from a file: `grid:` (a mapping of "
                   "lists) and/or `points:` (a list of mappings)")
    p.add_argument("--max-parallel", type=_int, metavar="K", help="a sweep's most tasks running at once")
    p.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                   help="run from the working tree instead of a copy of the project's code taken at submission "
                        "(the copy is what every restart runs, whatever is edited after)")
    p.add_argument("entry", metavar="ENTRY", nargs="?" if entry_optional else None, default=DOCTOR_ENTRY,
                   help="a task module (trainers.tasks.lm, pkg.mod:make_task), a .py script, or with -m a module"
                        + (f" (default: {DOCTOR_ENTRY}, to check the request alone)" if entry_optional else ""))
    rest = p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the entry unchanged")
    rest.required = False  # argparse counts a REMAINDER as required: a missing entry said "required: ENTRY, ARGS"
    return p


def _option_strings(p: argparse.ArgumentParser) -> frozenset[str]:
    """A subcommand's own flags, less -h/--help (after the entry, a request for the entry's help)."""
    return frozenset(o for a in p._actions for o in a.option_strings) - set(HELP_FLAGS)


def entry_args_as_typed(argv: Sequence[str], entry: str, args: Sequence[str]) -> tuple[list[str], bool]:
    """The entry's arguments as the user typed them, and whether a `--` set them apart (argparse drops a `--`
    right after the entry, so only the raw argv tells)."""
    for i in range(len(argv) - 1, -1, -1):
        if argv[i] != entry:
            continue
        tail = list(argv[i + 1:])
        if tail == list(args):
            return tail, i > 0 and argv[i - 1] == "--"
        if tail[:1] == ["--"] and tail[1:] == list(args):
            return tail[1:], True
    return list(args), True  # cannot tell where the entry was typed: never refuse then


def refuse_own_flags_after_entry(argv: Sequence[str], ns: argparse.Namespace) -> None:
    """`hpcjobs submit ... ENTRY --steps 40 --dry-run` must not submit: an hpcjobs flag typed after the entry would
    silently go to the entry. Everything after a `--` is the entry's, so `ENTRY -- --name x` passes `--name x`."""
    args, separated = entry_args_as_typed(argv, ns.entry, ns.args)
    if separated:
        return
    for word in args[:args.index("--")] if "--" in args else args:
        flag = word.split("=", 1)[0] if word.startswith("--") else word
        if flag in ns.own_flags:
            raise UsageError(
                f"{word!r} comes after the entry {ns.entry}, so it would go to the entry, but it is an hpcjobs "
                f"{ns.command} flag; nothing was submitted.",
                f"move it before the entry (hpcjobs {ns.command} {flag} ... {ns.entry} ...), or pass it to the "
                f"entry on purpose after a `--` ({ns.entry} -- {word}).")


def _spec(ns: argparse.Namespace, job_id_in_run_dir: bool = False, snapshot: bool = True) -> Any:
    from hpcjobs.backends import backend_for
    from hpcjobs.profiles import load_profile
    from hpcjobs.spec import Request, build_spec

    profile = load_profile(ns.profile)
    backend = backend_for(profile.scheduler)
    req = Request(entry=ns.entry, args=tuple(ns.args), module=ns.module, nodes=ns.nodes, gpus=ns.gpus,
                  time=ns.time, name=ns.name, partition=ns.partition, account=ns.account, qos=ns.qos,
                  run_dir=ns.run_dir, env=tuple(ns.env), sweep=tuple(ns.sweep), sweep_file=ns.sweep_file,
                  max_parallel=ns.max_parallel, snapshot=ns.snapshot and snapshot)
    spec = build_spec(profile, req, backend, job_id_in_run_dir=job_id_in_run_dir)
    backend.check(spec)
    return spec


def refuse_array_patterns(spec: Any, command: str) -> None:
    """hpcjobs starts single jobs: a run folder's %A or %a (a job array's ids, for a rendered script run with
    `sbatch --array`) has nothing to become, and resolving it failed only once the job was queued."""
    from hpcjobs.protocol.runfolder import RunDirPatternError, resolve_run_dir

    if spec.array:
        return
    try:
        resolve_run_dir(spec.run_dir, {"SLURM_JOB_ID": "1", "HPCJOBS_JOB_ID": "1"})
    except RunDirPatternError as e:
        raise UsageError(f"{e}: hpcjobs {command} starts one job here, not a job array (only %j names it); "
                         "nothing was submitted.", "use %j (e.g. --run-dir runs/x-%j), or sweep: --sweep KEY=V1,V2 "
                         "makes an array, one task per point.") from None


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


# --- submit / render ----------------------------------------------------------------------------------------------

def add_submit(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "submit", "Submit a training job (through submitit on Slurm; in the foreground for `local`).",
                parents=[common])
    p.add_argument("--dry-run", action="store_true", help="print the spec and the script; submit nothing")
    p.add_argument("--json", action="store_true", help="print a machine-readable record")
    p.set_defaults(run=run_submit, own_flags=_option_strings(p))


def entry_help(spec: Any) -> int | None:
    """`hpcjobs submit|render ... ENTRY --help` asks for the entry's flags: show them here (the shared trainer's and
    the task's for a task, the script's own otherwise) and submit nothing. None when help was not asked for."""
    if not asks_help(spec.entry.args):
        return None
    import subprocess

    how = {"task": ["-m", "trainers", "help", spec.entry.target], "module": ["-m", spec.entry.target, "--help"],
           "script": [spec.entry.target, "--help"]}[spec.entry.kind]
    return subprocess.run([sys.executable, *how], cwd=spec.workdir).returncode


def run_submit(ns: argparse.Namespace) -> int:
    from hpcjobs.backends import backend_for

    spec = _spec(ns, snapshot=not asks_help(ns.args))  # the entry's help runs from the working tree
    refuse_array_patterns(spec, "submit")
    helped = entry_help(spec)
    if helped is not None:
        return helped
    request = backend_for(spec.profile.scheduler).dry_run(spec)
    if ns.dry_run:
        if ns.json:
            _print_json({"dry_run": True, "world": spec.world(), "spec": spec.as_dict(), "request": request.text,
                         "points": [dict(p) for p in spec.points], "memory_plan": memory_plans(spec)})
        else:
            print(f"# dry run: {spec.world()}; nothing submitted")
            print(memory_text(spec))
            print(yaml.safe_dump(brief(spec.as_dict()), sort_keys=True).rstrip())
            print(points_text(spec), end="")
            print(f"# --- the request the {spec.profile.scheduler} backend would submit ---")
            print(request.text, end="")
        return 0
    from hpcjobs.submit import submit

    if ns.json:  # stdout is for the record alone; a foreground job's own output goes to stderr
        request = replace(request, params={**request.params, "stdout_to_stderr": True})
    sub = submit(request)
    if ns.json:
        _print_json({**sub.as_dict(), "world": spec.world(), "name": spec.name, "profile": spec.profile.name})
    elif sub.returncode is None:
        tasks = f", an array of {len(sub.tasks)} tasks {sub.job_id}_0 to {sub.job_id}_{len(sub.tasks) - 1}"
        print(f"Submitted job {sub.job_id} ({spec.name}: {spec.world()}{tasks if sub.tasks else ''})")
        print(f"  run folder: {sub.run_dir}")
        logs = f"{sub.job_id}_0" if sub.tasks else sub.job_id
        print(f"  follow:     hpcjobs status {sub.job_id}  |  hpcjobs logs {logs} --follow")
    else:
        for done in sub.tasks or (sub,):
            print(ended_line(done))
    return sub.returncode or 0


def _tasks_args(spec: Any) -> list[tuple[str, ...]]:
    from hpcjobs.sweep import tasks_args

    return tasks_args(spec.entry.args, spec.points) if spec.entry.kind == "task" else []


def memory_text(spec: Any) -> str:
    """The memory plan's line for each task of the job (hpcjobs.memfit), for the dry run."""
    from hpcjobs.memfit import plan_line

    lines = [plan_line(spec.profile, spec.entry.target, args, spec.ranks) for args in _tasks_args(spec)]
    known = f"# memory plan: none: a {spec.entry.kind}'s model is known on the node only"
    return "\n".join(dict.fromkeys(lines)) or known


def memory_plans(spec: Any) -> list[dict[str, Any] | None]:
    """The memory plan of each task of the job in bytes (None: not known on this side), for `--dry-run --json`."""
    from hpcjobs.memfit import job_plan

    found = [job_plan(spec.entry.target, args, spec.ranks) for args in _tasks_args(spec)]
    return [None if f is None else {"what": f.what(), **f.plan.as_dict()} for f in found]


def brief(recorded: dict[str, Any]) -> dict[str, Any]:
    """A spec as a person reads it: the snapshot's diff counted, not shown (spec.json keeps it)."""
    snap = recorded.get("snapshot")
    if not snap or not snap.get("git_diff"):
        return recorded
    lines = snap["git_diff"].count("\n")
    return {**recorded, "snapshot": {**snap, "git_diff": f"{lines} lines (kept in the run folder's spec.json)"}}


def points_text(spec: Any) -> str:
    """A sweep's points, one line each, as the array tasks will get them."""
    from hpcjobs.protocol.points import as_args

    if not spec.array:
        return ""
    head = f"# --- {len(spec.points)} points, one array task each" + (
        f", at most {spec.max_parallel} at once" if spec.max_parallel else "") + " ---\n"
    return head + "".join(f"task {i}: {' '.join(as_args(p))}\n" for i, p in enumerate(spec.points))


def ended_line(sub: Any) -> str:
    """How a foreground (local) job ended, in one line: its run folder's final word when it failed, if this job
    wrote it (a refused resume ends with an earlier job's final.json in place)."""
    from hpcjobs.jobs import folder_state
    from hpcjobs.protocol.runfolder import RunFolder

    _, reason = folder_state(RunFolder(sub.run_dir), sub.job_id)
    why = f": {reason}" if sub.returncode and reason else ""
    return f"Job {sub.job_id} ended with code {sub.returncode}{why}; run folder {sub.run_dir}"


def add_render(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "render", "Write a standalone sbatch script for the same job (for people who run sbatch).",
                parents=[common])
    p.add_argument("-o", "--output", help="write the script here (default: print it)")
    p.add_argument("--force", action="store_true", help="overwrite an existing -o file")
    p.set_defaults(run=run_render, own_flags=_option_strings(p))


def run_render(ns: argparse.Namespace) -> int:
    from hpcjobs.backends import backend_for

    spec = _spec(ns, job_id_in_run_dir=True, snapshot=not asks_help(ns.args))
    helped = entry_help(spec)
    if helped is not None:
        return helped
    script = backend_for(spec.profile.scheduler).script(spec)
    from hpcjobs.protocol.paths import refuse_output
    from hpcjobs.submit import take_snapshot, write_script

    if ns.output:
        refuse_output(Path(ns.output), ns.force)  # before the snapshot: a refused render copies nothing
    take_snapshot(spec)  # the script runs the code as it is now, however long it waits to be submitted
    if not ns.output:
        print(script.text, end="")
        return 0
    path = write_script(script, Path(ns.output), ns.force)
    print(f"Wrote {path} ({spec.world()}); submit it with: sbatch {path}", file=sys.stderr)
    return 0


# --- profiles ---------------------------------------------------------------------------------------------------

def add_profiles(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "profiles", "List cluster profiles, or show one resolved.")
    p.add_argument("action", nargs="?", choices=["list", "show"], default="list")
    p.add_argument("name", nargs="?", help="with show: the profile name or path")
    p.set_defaults(run=run_profiles)


def run_profiles(ns: argparse.Namespace) -> int:
    from hpcjobs.profiles import available_profiles, load_profile, profile_as_dict

    if ns.action == "show":
        if not ns.name:
            raise UsageError("profiles show needs a NAME.", "e.g. hpcjobs profiles show local")
        print(yaml.safe_dump(profile_as_dict(load_profile(ns.name)), sort_keys=False).rstrip())
        return 0
    rows = [(name, origin, str(path)) for name, origin, path in available_profiles()]
    _table(["profile", "from", "path"], rows)
    return 0


# --- status / list / logs / cancel --------------------------------------------------------------------------------

def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _table(header: list[str], rows: list[tuple[Any, ...]]) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(*header)
        for row in rows:
            table.add_row(*(str(c) for c in row))
        Console().print(table)
        return
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in [tuple(header), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def add_status(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "status", "A job's state (squeue, then sacct, then its run folder), restarts and last step.")
    p.add_argument("job", nargs="?", help="job id (default: the newest job)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_status)


def run_status(ns: argparse.Namespace) -> int:
    from hpcjobs.goodput_report import job_goodput, status_line
    from hpcjobs.jobs import records_for, status_of
    from hpcjobs.protocol.runfolder import split_task_id
    from hpcjobs.store import JobStore

    store = JobStore()
    if ns.job is None:
        recent = store.recent(1)
        if not recent:
            raise UsageError("no job was submitted with hpcjobs here yet.", "hpcjobs submit --help")
        newest = recent[0]  # a sweep's newest task stands for its array
        ns.job = split_task_id(newest.job_id)[0] if newest.spec.get("array_task") is not None else newest.job_id
    records = records_for(ns.job, store)
    if len(records) > 1:
        return array_status(ns.job, [status_of(r) for r in records], [r.spec.get("point") for r in records], ns.json)
    st = status_of(records[0])
    goodput = job_goodput(records[0], st.state, store)
    if ns.json:
        _print_json({**st.as_dict(), "goodput": goodput.as_dict() if goodput else None})
        return 0
    rows = [("job", f"{st.job_id} ({st.name}, profile {st.profile}, {st.nodes}×{st.gpus_per_node})"),
            ("state", f"{st.state} (from {st.state_source})"), ("restarts", st.restarts),
            ("last step", f"{st.last_step if st.last_step is not None else '-'} ({_age(st.last_step_age_s)} ago)"),
            ("run folder", st.run_dir), ("logs", f"hpcjobs logs {st.job_id} [--rank R] [--restart N]")]
    if st.final_reason:
        rows.insert(2, ("ended", st.final_reason))
    if st.first_failure:
        rows.insert(3, ("failed first", st.first_failure))
        rows.insert(4, ("its log", "\n".join([str(st.failure_log), *(f"{'':13}| {line}" for line in st.failure_tail)])))
    if goodput:
        rows.insert(-2, ("goodput", status_line(goodput)))
    if st.nccl_traces:
        rows.append(("nccl trace", f"{st.nccl_traces} (NCCL's flight recorder: which rank stopped in which "
                                   "collective; torchfrtrace reads it)"))
    for key, value in rows:
        print(f"{key + ':':12} {value}")
    return 0


def array_status(array_id: str, statuses: list[Any], points: list[Any], as_json: bool) -> int:
    """A sweep's array: one row per task, then how many are in each state."""
    from collections import Counter

    if as_json:
        _print_json({"array": array_id, "tasks": [{**s.as_dict(), "point": p} for s, p in zip(statuses, points,
                                                                                             strict=True)]})
        return 0
    _table(["task", "point", "state", "restarts", "step", "run folder"],
           [(s.job_id, " ".join(f"{k}={v}" for k, v in (p or {}).items()) or "-", s.state, s.restarts,
             "-" if s.last_step is None else s.last_step, s.run_dir) for s, p in zip(statuses, points, strict=True)])
    counts = Counter(str(s.state) for s in statuses)
    print(f"array {array_id}: {len(statuses)} tasks: " + ", ".join(f"{n} {state}" for state, n in sorted(
        counts.items())) + f". One task: hpcjobs status {array_id}_N")
    return 0


def add_list(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "list", "Recent jobs submitted with hpcjobs.")
    p.add_argument("--state", type=_job_state, help="only jobs in this state (e.g. RUNNING, COMPLETED)")
    p.add_argument("--profile", help="only jobs of this profile")
    p.add_argument("--limit", type=_limit, default=20)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_list)


def run_list(ns: argparse.Namespace) -> int:
    from hpcjobs.jobs import status_of
    from hpcjobs.store import JobStore

    statuses = [status_of(r) for r in JobStore().recent(ns.limit, ns.profile)]
    if ns.state:
        statuses = [s for s in statuses if s.state == ns.state]
    if ns.json:
        _print_json([s.as_dict() for s in statuses])
        return 0
    now = time.time()
    _table(["job", "name", "profile", "nodes×gpus", "state", "restarts", "step", "age"],
           [(s.job_id, s.name, s.profile, f"{s.nodes}×{s.gpus_per_node}", s.state, s.restarts,
             "-" if s.last_step is None else s.last_step, _age(now - s.submitted)) for s in statuses])
    return 0


def add_logs(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "logs", "Print a rank's log of a restart (rank 0 of the latest restart by default).")
    p.add_argument("job")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--restart", type=int, default=None)
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(run=run_logs)


def run_logs(ns: argparse.Namespace) -> int:
    from hpcjobs.jobs import follow, log_path, status_of

    rec = one_record(ns.job, "logs")
    path = log_path(rec, ns.rank, ns.restart)
    if not ns.follow:
        sys.stdout.write(path.read_text(errors="replace"))
        return 0
    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    follow(path, out, lambda: status_of(rec).state.finished)
    return 0


def one_record(job_id: str, command: str) -> Any:
    """The record of a job or one array task; an array's id is refused, naming its tasks."""
    from hpcjobs.jobs import records_for
    from hpcjobs.store import JobStore

    records = records_for(job_id, JobStore())
    if len(records) > 1:
        raise UsageError(f"job {job_id} is a sweep's array of {len(records)} tasks; valid: one task, "
                         f"{records[0].job_id} to {records[-1].job_id}.", f"e.g. hpcjobs {command} {records[0].job_id}")
    return records[0]


def add_cancel(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "cancel", "Cancel jobs (scancel) and record it.")
    p.add_argument("jobs", nargs="+")
    p.set_defaults(run=run_cancel)


def run_cancel(ns: argparse.Namespace) -> int:
    from hpcjobs.jobs import cancel, records_for
    from hpcjobs.store import JobStore

    store = JobStore()
    records = [r for j in ns.jobs for r in records_for(j, store)]  # every id checked before anything is cancelled
    for rec in records:
        print(cancel(rec, store))
    return 0


# --- compare ------------------------------------------------------------------------------------------------------

def add_compare(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "compare", "Runs side by side (a sweep's points): state, steps, restarts, last and best loss; "
                "--plot draws their loss curves.")
    p.add_argument("runs", nargs="+", metavar="RUN_OR_ID",
                   help="a run folder, or a job id (a sweep's array id stands for all its tasks)")
    p.add_argument("--plot", metavar="FILE", help="also draw the loss curves into FILE (.png, .pdf or .svg; needs "
                   "matplotlib: pip install 'hpcjobs[plot]')")
    p.add_argument("--force", action="store_true", help="overwrite an existing --plot file")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(run=run_compare)


def compare_targets(args: Sequence[str], store: Any) -> list[Any]:
    """Each argument as a run folder (an existing directory, or anything path-like, which compare then checks) or
    the job records of a job id. Every argument is resolved before anything is read: one typo fails at once."""
    targets: list[Any] = []
    for arg in args:
        if Path(arg).is_dir() or "/" in arg or Path(arg).exists():
            targets.append(arg)
            continue
        try:
            from hpcjobs.jobs import records_for

            targets += records_for(arg, store)
        except UsageError as e:
            raise UsageError(f"{arg!r} is neither a folder here nor a job hpcjobs knows ({e.message.rstrip('.')}).",
                             "give run folders (RUN/ holds spec.json and metrics.jsonl) or job ids from "
                             "`hpcjobs list`.") from None
    return targets


def run_compare(ns: argparse.Namespace) -> int:
    from hpcjobs import compare
    from hpcjobs.store import JobStore

    if ns.plot:
        compare.plot_format(ns.plot, ns.force)
        compare.require_matplotlib()
    store = JobStore()
    rows = compare.rows_for(compare_targets(ns.runs, store), store)
    if ns.plot:
        path = compare.plot(rows, ns.plot, ns.force)
        print(f"Wrote {path} (loss curves of {len(rows)} run(s))", file=sys.stderr)
    if ns.json:
        _print_json([r.as_dict() for r in rows])
    else:
        _table(*compare.table(rows))
    return 0


def add_goodput(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "goodput", "Where a job's wall time and GPU-hours went (queue, start-up, productive training, "
                "checkpoints, rework, requeue hold, recovery) and its ETTR, with advice.")
    p.add_argument("target", metavar="ID|RUN_FOLDER", help="a job id (a sweep's array id: every task) or a run folder")
    p.add_argument("--json", action="store_true", help="print the buckets as JSON")
    p.set_defaults(run=run_goodput)


def run_goodput(ns: argparse.Namespace) -> int:
    from hpcjobs.goodput_report import run

    return run(ns.target, ns.json)


# --- doctor -------------------------------------------------------------------------------------------------------

DOCTOR_ENTRY = "trainers.tasks.lm"
"""What doctor checks the request with when no entry is given (it must exist, like any entry)."""


def add_doctor(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "doctor", "Check the exact request against the cluster before it queues (one row per check).",
                parents=[_job_flags(entry_optional=True)])
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--probe", action="store_true", help="also run a one-node, two-minute job that runs the setup and "
                   "checks the node side: torch and the entry import, the entry's flags as a rank reads them, "
                   "GPUs, interfaces, the runs folder")
    p.add_argument("--probe-wait", type=_int, default=300, metavar="SECONDS",
                   help="how long --probe waits for its job to start and end (default 300; then it is cancelled)")
    p.set_defaults(run=run_doctor, own_flags=_option_strings(p))


def run_doctor(ns: argparse.Namespace) -> int:
    from hpcjobs.backends import backend_for
    from hpcjobs.doctor import exit_code, table

    if ns.probe and not 10 <= ns.probe_wait <= 86400:
        raise UsageError(f"--probe-wait {ns.probe_wait}: valid: 10 to 86400 seconds.", "e.g. --probe-wait 600")
    spec = _spec(ns, snapshot=False)  # as submit builds it, but checked against the working tree: nothing copied
    refuse_array_patterns(spec, "doctor")
    checks = backend_for(spec.profile.scheduler).doctor(spec, ns.probe_wait if ns.probe else None)
    if spec.entry.kind == "task":
        from hpcjobs.memfit import doctor_check

        checks.append(doctor_check(spec.profile, spec.entry.target, _tasks_args(spec), spec.ranks))
    if ns.json:
        _print_json({"world": spec.world(), "profile": spec.profile.name, "checks": [c.as_dict() for c in checks],
                     "ok": exit_code(checks) == 0})
    else:
        print(f"hpcjobs doctor: {spec.world()}, profile {spec.profile.name}, --time {spec.time}")
        print(table(checks))
    return exit_code(checks)


# --- export -------------------------------------------------------------------------------------------------------

def add_export(sub: Any, common: argparse.ArgumentParser) -> None:
    p = _parser(sub, "export", "One file of a run's model weights from its newest (or --step) finished checkpoint; "
                "offline, no GPU.")
    p.add_argument("target", metavar="RUN_OR_ID", help="a run folder, or a job id (an array task: ID_N)")
    p.add_argument("--step", type=_int, help="the checkpoint of this step (default: the newest finished one)")
    p.add_argument("-o", "--output", required=True, help="the file: .pt/.pth (torch.save) or .safetensors")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(run=run_export)


def run_export(ns: argparse.Namespace) -> int:
    """The reading is the node side's (trainers.export, which imports torch): run there, in this Python."""
    import subprocess

    run_dir = ns.target if Path(ns.target).is_dir() else one_record(ns.target, "export").run_dir
    # "--output=" and "--": an -o or RUN that starts with "-" stays a value there, as it was here
    argv = [f"--output={ns.output}", *(["--step", str(ns.step)] if ns.step is not None else []),
            *(["--force"] if ns.force else []), "--", run_dir]
    return subprocess.run([sys.executable, "-m", "trainers.export", *argv]).returncode


COMMANDS: list[Callable[[Any, argparse.ArgumentParser], None]] = [
    add_submit, add_render, add_doctor, add_profiles, add_status, add_list, add_logs, add_cancel, add_compare,
    add_goodput, add_export]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="hpcjobs", description="Take a PyTorch training job from this machine to a multi-node Slurm "
               "cluster; survive preemption; resume exactly.", epilog=EXAMPLES["submit"],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"hpcjobs {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    common = _job_flags()
    for add in COMMANDS:
        add(sub, common)
    return p


def unrecognized(parser: argparse.ArgumentParser, ns: argparse.Namespace, extras: list[str]) -> NoReturn:
    """Arguments no parser took, refused by the subcommand's parser (its name and help in the line) with the
    nearest of its flags: `--gpu 2` means --gpus."""
    import difflib

    subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    p: argparse.ArgumentParser = subs.choices.get(ns.command, parser) if subs is not None and ns.command else parser
    known = sorted(_option_strings(p))
    close = [m for w in extras if w.startswith("--")
             for m in difflib.get_close_matches(w.split("=", 1)[0], known, n=1)]
    p.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {', '.join(close)}?" if close else ""))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns, extras = parser.parse_known_args(argv)
    if extras:
        unrecognized(parser, ns, extras)
    if not getattr(ns, "run", None):
        parser.print_help()
        return 2
    try:
        if getattr(ns, "own_flags", None):
            refuse_own_flags_after_entry(argv, ns)
        code = int(ns.run(ns))
        sys.stdout.flush()  # here, not at exit: a reader that left (`| head -1`) is then caught below
        return code
    except HpcjobsError as e:
        print(f"hpcjobs {ns.command}: error: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of stdout is gone: stop quietly, as a command killed by SIGPIPE does. stdout goes to
        # /dev/null so the interpreter's own flush at exit has nothing left to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())
