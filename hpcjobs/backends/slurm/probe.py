"""`hpcjobs doctor --probe` on Slurm: a one-node, two-minute job that runs the profile's setup and the nodes' Python,
and reports what a rank would find there: torch and the entry importable, the GPUs torch sees, the network
interfaces the profile names, and whether a file written into the runs folder on the node is visible here.

`probe_script` and `probe_checks` are pure; `run_probe` is the one function that submits (and waits, and cleans up).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcjobs.backends.slurm.runtimes import check_prefix
from hpcjobs.backends.slurm.sbatch import environment_lines, gpu_flags, python_lines, sbatch_directive, shell_words
from hpcjobs.protocol.runfolder import JOB_ID
from hpcjobs.request.checks import Check, Result
from hpcjobs.request.spec import JobSpec
from hpcjobs.request.sweep import tasks_args

PROBE_TIME = "00:02:00"
PROBE_NAME = "hpcjobs-probe"
INTERFACE_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")

ARGUMENTS_BUDGET_S = 60
"""How long the probe spends on the entry's flags (a sweep's points one by one) before it reports what it checked."""

# What the nodes' Python reports, as JSON into the runs folder (argv[3]), written before the task is imported (a crash
# or hang there keeps the rest) and again after: the entry as the ranks import it, then for a task, each of the job's
# tasks' flags (TASKS, set above this text: a sweep's points can be more than one argument may hold) as a rank reads
# them, until ARGUMENTS_BUDGET_S is spent: trainers.run.check_task's None, or the line it would refuse them with.
REPORT = r'''
import importlib.util, json, os, socket, sys, time
kind, target, out = sys.argv[1], sys.argv[2], sys.argv[3]
torch = importlib.import_module("torch")  # on the node only

def write(report):
    with open(out + ".part", "w") as f:
        json.dump(report, f)
    os.replace(out + ".part", out)

def arguments():
    try:
        import trainers.run
    except ImportError as e:
        return {"failed": f"hpcjobs's trainers cannot be imported ({type(e).__name__}: {e})"}
    check = getattr(trainers.run, "check_task", None)
    if check is None:
        return {"skipped": "the nodes' hpcjobs is older than this one: its trainers cannot check flags"}
    refused, end = [], time.monotonic() + BUDGET
    for args in TASKS:
        if time.monotonic() > end:
            break
        refused.append(check(target, args))
    return {"refused": refused}

if kind == "script":
    entry = os.path.isfile(target)
else:
    sys.path.insert(0, os.getcwd())
    try:
        entry = importlib.util.find_spec(target.split(":")[0]) is not None
    except (ImportError, ValueError):  # a package on its way is missing
        entry = False
report = {"host": socket.gethostname(), "python": sys.executable, "torch": torch.__version__,
          "cuda": torch.cuda.is_available(), "gpus": torch.cuda.device_count(), "entry": entry,
          "interfaces": sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []}
write(report)
if kind == "task" and entry:
    report["arguments"] = arguments()
    write(report)
'''


def probe_folder(spec: JobSpec) -> Path:
    return spec.profile.runs_path() / "probe"


def probe_script(spec: JobSpec, report: Path) -> str:
    """The probe job: the job's own partition, account, QOS, GPUs of one node and setup; then the nodes' Python
    check (which ends the job with its one line), then the report; both inside the job's image when it has one
    (what is missing there is what the ranks would miss), with the probe's folder mounted (usually it is already:
    the runs folder's)."""
    folder = probe_folder(spec)
    if spec.container is not None and not any(folder.is_relative_to(m.split(":")[0]) for m in spec.container.mounts):
        spec = replace(spec, container=replace(spec.container, mounts=(*spec.container.mounts, f"{folder}:{folder}")))
    inside = shell_words(check_prefix(spec)) + " " if spec.container is not None else ""
    flags: dict[str, Any] = {"job-name": f"{PROBE_NAME}-{report.stem}", "nodes": 1, "ntasks": 1, "time": PROBE_TIME,
                             "partition": spec.partition, "account": spec.account, "qos": spec.qos,
                             "chdir": spec.workdir, "output": str(probe_folder(spec) / f"probe-{JOB_ID}.out"),
                             **gpu_flags(spec)}
    tasks = json.dumps([list(args) for args in tasks_args(spec.entry.args, spec.points)])
    lines = ["#!/bin/bash", *(f"#SBATCH {sbatch_directive(k, v)}" for k, v in sorted(flags.items()) if v is not None),
             "set -eo pipefail", *spec.profile.setup, *environment_lines(spec), *python_lines(spec),
             f'{inside}"$HPCJOBS_PYTHON" - {shlex.join([spec.entry.kind, spec.entry.target, str(report)])} '
             "<<'HPCJOBS_PROBE'", f"import json; TASKS, BUDGET = json.loads({ascii(tasks)}), {ARGUMENTS_BUDGET_S}",
             REPORT.strip(), "HPCJOBS_PROBE"]
    return "\n".join(lines) + "\n"


def interface_problems(env: dict[str, str], interfaces: list[str]) -> list[str]:
    """The profile's socket interface settings that name no interface of the node. NCCL's forms: a prefix, `=exact`,
    a comma list, `^` to exclude (which names none to check); gloo takes exact names only."""
    problems = []
    for var in INTERFACE_VARS:
        value = env.get(var, "")
        if not value or value.startswith("^"):
            continue
        exact = value.startswith("=") or var.startswith("GLOO")
        for name in value.removeprefix("=").split(","):
            found = name in interfaces if exact else any(i.startswith(name) for i in interfaces)
            if name and not found:
                problems.append(f"{var}={value}: no interface {name!r}")
    return problems


def probe_checks(spec: JobSpec, job: str, state: str, report: dict[str, Any] | None, said: str | None,
                 ) -> list[Check]:
    """The probe's rows, from the job's end state, its report (None: none was readable here) and its output (None:
    no output file here either: Slurm could not create it in the runs folder on the node, or it is not shared)."""
    if report is None and said is None:
        return [Check("probe", Result.FAIL, f"job {job} ended {state} and left neither its report nor its output in "
                      f"{probe_folder(spec)}: the runs folder is not writable on the nodes, or not the one they see",
                      "put runs_dir on a shared filesystem the nodes may write (check its permissions there)")]
    said = said or ""
    last = next((line for line in reversed(said.splitlines()) if line.strip()), "")
    if report is None:
        why = f"job {job} ended {state} without a report" + (f": {last}" if last else "")
        fix = ("the line above says what failed (the setup, or the nodes' Python); if the job COMPLETED, the runs "
               f"folder {probe_folder(spec)} is not the same on the nodes and here: put runs_dir on a shared "
               "filesystem")
        return [Check("probe", Result.FAIL, why, fix)]
    host = report["host"]
    rows = [Check("probe", Result.PASS, f"job {job} ran on {host}: {report['python']}, torch {report['torch']}"),
            Check("runs folder", Result.PASS, f"a file {host} wrote in {probe_folder(spec)} is readable here")]
    if spec.entry.kind != "script" or report["entry"]:
        rows.append(Check("entry", Result.PASS if report["entry"] else Result.FAIL,
                          f"{spec.entry.target} {'is' if report['entry'] else 'is not'} importable on {host} from "
                          f"{spec.workdir}", "run from the folder that holds it, or install it in the environment"))
    else:
        rows.append(Check("entry", Result.FAIL, f"{spec.entry.target} does not exist on {host}",
                          "put the script on a filesystem the nodes share"))
    rows.append(arguments_check(spec, report, host))
    wants = spec.gpus_per_node if spec.profile.gpu_request != "none" else 0
    if spec.env.get("HPCJOBS_BACKEND") == "gloo" or not wants:
        rows.append(Check("GPUs", Result.SKIP, f"not needed: {'HPCJOBS_BACKEND=gloo' if wants else 'no GPUs asked'}"
                                               f" (torch sees {report['gpus']} on {host})"))
    else:
        seen = report["gpus"] if report["cuda"] else 0
        rows.append(Check("GPUs", Result.PASS if seen >= wants else Result.FAIL,
                          f"torch sees {seen} CUDA GPU(s) on {host}; a node's ranks need {wants}",
                          "check the driver against torch's CUDA build (nvidia-smi on the node)"))
    problems = interface_problems(spec.env, report["interfaces"])
    named = [f"{v}={spec.env[v]}" for v in INTERFACE_VARS if spec.env.get(v)]
    if not named:
        rows.append(Check("interfaces", Result.SKIP, f"none named in the profile ({host} has "
                                                      f"{', '.join(report['interfaces'])})"))
    else:
        rows.append(Check("interfaces", Result.FAIL if problems else Result.PASS,
                          "; ".join(problems) + f" on {host} (it has {', '.join(report['interfaces'])})" if problems
                          else f"{', '.join(named)} on {host}", "name an interface the nodes have in the profile"))
    return rows


def arguments_check(spec: JobSpec, report: dict[str, Any], host: str) -> Check:
    """The entry's flags as a rank on `host` reads them, for each of the job's tasks (a sweep's points) the probe
    had time for: a task's (the trainer's and its own, its module imported there), or none for an own script, which
    reads its flags itself once it runs."""
    name, target = "arguments", spec.entry.target
    if spec.entry.kind != "task":
        return Check(name, Result.SKIP, "an own script reads its flags itself: not checked before it runs")
    if not report["entry"]:
        return Check(name, Result.SKIP, f"not checked: {target} is not importable on {host}")
    said = report.get("arguments")
    if said is None:
        return Check(name, Result.FAIL, f"importing {target} or reading its flags on {host} never finished (a crash "
                     "or a hang; the probe's output may say which)", "run `python -m trainers check "
                     f"{target} FLAGS...` on a node to see it")
    if "refused" not in said:
        return Check(name, Result.SKIP if "skipped" in said else Result.FAIL, said.get("skipped") or said["failed"],
                     "install the same hpcjobs in the nodes' Python as here")
    tasks = tasks_args(spec.entry.args, spec.points)
    refused = [(args, why) for args, why in zip(tasks, said["refused"], strict=False) if why is not None]
    if refused:
        (args, why), more = refused[0], len(refused) - 1
        return Check(name, Result.FAIL, f"a rank on {host} would refuse {' '.join(args) or 'its defaults'}: {why}"
                     + (f" (and {more} more of the {len(tasks)} points)" if more else ""),
                     f"fix the flag (`hpcjobs submit --profile {spec.profile.name} {target} --help` lists them), or "
                     "install what the task imports in the nodes' Python (the profile's python and setup)")
    checked = len(said["refused"])
    if not spec.array:
        given = " ".join(tasks[0]) or "its defaults"
    elif checked == len(tasks):
        given = f"each of its {len(tasks)} points' flags"
    else:
        given = (f"the first {checked} of its {len(tasks)} points' flags (the rest unchecked: the probe gives this "
                 f"{ARGUMENTS_BUDGET_S} s)")
    return Check(name, Result.PASS, f"{target} starts with {given} on {host}")


def run_probe(spec: JobSpec, wait_s: float) -> list[Check]:
    """Submit the probe, wait for its end (at most `wait_s`, then cancel it), read its report and output here."""
    folder = probe_folder(spec)
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / f"report-{uuid.uuid4().hex}.json"
    partial = report.with_name(report.name + ".part")  # REPORT writes there first, then renames it to `report`
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as f:
        f.write(probe_script(spec, report))
    t0, ended = time.monotonic(), False
    try:
        proc = subprocess.run(["sbatch", "--parsable", "--wait", f.name], capture_output=True, text=True,
                              timeout=wait_s)
        ended = True
        job, state = proc.stdout.strip().split(";")[0], "COMPLETED" if proc.returncode == 0 else "FAILED"
        if not job.isdigit():
            return [Check("probe", Result.FAIL, f"sbatch refused the probe: {proc.stderr.strip()[:300]}",
                          "see the request row")]
    except subprocess.TimeoutExpired:
        return [Check("probe", Result.SKIP, f"the probe did not end within {wait_s:.0f} s (cancelled): the queue is "
                                            "busy; the other rows still hold")]
    except FileNotFoundError:
        return [Check("probe", Result.FAIL, "no sbatch on this machine's PATH", "run doctor on a login node")]
    finally:
        Path(f.name).unlink()
        if not ended:  # timed out or interrupted: sbatch's job id may never have reached us, its unique name does
            subprocess.run(["scancel", "--name", f"{PROBE_NAME}-{report.stem}"], capture_output=True)
            for leftover in (report, partial):
                leftover.unlink(missing_ok=True)
    output = folder / f"probe-{job}.out"
    said = output.read_text(errors="replace") if output.exists() else None
    try:
        data = json.loads(report.read_text()) if report.exists() else None
    finally:
        for leftover in (report, output, partial):
            leftover.unlink(missing_ok=True)
    rows = probe_checks(spec, job, state, data, said)
    return [replace(rows[0], found=f"{rows[0].found} ({time.monotonic() - t0:.0f} s)"), *rows[1:]]
