"""The job the flags of submit, render and doctor describe: the checked spec (the profile, the request, the
backend's own check), the refusals that come before anything is made, and the entry's own help."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.settings.helpflags import asks_help

if TYPE_CHECKING:
    from hpcjobs.backends import Backend
    from hpcjobs.request.spec import JobSpec


def checked_spec(ns: argparse.Namespace, job_id_in_run_dir: bool = False, snapshot: bool = True,
                 same_command: Callable[[str, str], str | None] | None = None) -> tuple[JobSpec, Backend]:
    """The spec the flags ask for, checked by the profile's backend too, and that backend. `same_command`: submit's
    run folder of the same command (hpcjobs.request.spec.build_spec)."""
    from hpcjobs.backends import backend_for
    from hpcjobs.profiles.cluster_profile import load_profile
    from hpcjobs.request.spec import Request, build_spec

    refuse_empty(ns)
    profile = load_profile(ns.profile)
    private(profile.group)
    backend = backend_for(profile.scheduler)
    req = Request(entry=ns.entry, args=tuple(ns.args), module=ns.module, nodes=ns.nodes, gpus=ns.gpus,
                  time=ns.time, name=ns.name, partition=ns.partition, account=ns.account, qos=ns.qos,
                  run_dir=ns.run_dir, env=tuple(ns.env), sweep=tuple(ns.sweep), sweep_file=ns.sweep_file,
                  max_parallel=ns.max_parallel, snapshot=ns.snapshot and snapshot, after=tuple(ns.after),
                  container=ns.container, max_recoveries=ns.max_recoveries, spare_nodes=ns.spare_nodes,
                  allow_secret_values=ns.allow_secret_values)
    spec = build_spec(profile, req, backend, job_id_in_run_dir=job_id_in_run_dir, same_command=same_command)
    backend.check(spec)
    from hpcjobs.request.resumecheck import check_resume

    check_resume(spec)  # a resume the checkpoint's settings contradict: refused here, not by the started ranks
    return spec, backend


def private(group: str | None) -> None:
    """What this command makes (run folders, snapshots, the store, the ranks' files) is the owner's alone, or also
    the profile's group's, whatever the umask (hpcjobs.protocol.access)."""
    from hpcjobs.protocol.access import tighten, umask_for
    from hpcjobs.request.credentials import group_id

    group_id(group)  # a group this machine lacks: one line before anything is made
    tighten(umask_for(group))


EMPTY_HINTS = {
    "run_dir": "a shell variable that is not set gives '' (`--run-dir \"$RUN\"`): set it to the run folder to "
               "resume, or leave --run-dir out to start a new run.",
    "name": "leave --name out to name the job after its entry, or give one, e.g. --name gpt-small.",
}


def refuse_empty(ns: argparse.Namespace) -> None:
    """A flag given an empty value (`--run-dir "$RUN"` with RUN unset) was taken as not given: a user meaning to
    resume a run started a new one without a word. Refused, as every flag whose value is a name or a path."""
    for dest in ("run_dir", "name", "partition", "account", "qos", "time", "container", "sweep_file"):
        value = getattr(ns, dest, None)
        if value is not None and not value.strip():
            flag = "--" + dest.replace("_", "-")
            raise UsageError(f"{flag} {value!r} is empty; valid: a non-empty value, or no {flag} at all.",
                             EMPTY_HINTS.get(dest, f"leave {flag} out for the profile's, or give one."))


def refuse_array_patterns(spec: JobSpec, command: str) -> None:
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


def entry_help(spec: JobSpec) -> int | None:
    """`hpcjobs submit|render ... ENTRY --help` asks for the entry's flags: show them here (the shared trainer's and
    the task's for a task; a script's or module's as its source declares them, without running it) and submit
    nothing. None when help was not asked for."""
    if not asks_help(spec.entry.args):
        return None
    if spec.entry.kind != "task":  # the user's own code never runs on the submit host (hpcjobs/cli/entryhelp.py)
        from hpcjobs.cli.entryhelp import text

        print(text(spec.entry.kind, spec.entry.target, Path(spec.workdir)))
        return 0
    import subprocess

    return subprocess.run([sys.executable, "-m", "trainers", "help", spec.entry.target], cwd=spec.workdir).returncode


def tasks_args(spec: JobSpec) -> list[tuple[str, ...]]:
    """A task's arguments at each point of the job (one for a job that is not a sweep); [] for a script or module."""
    from hpcjobs.request.sweep import tasks_args

    return tasks_args(spec.entry.args, spec.points) if spec.entry.kind == "task" else []
