"""Pure Slurm renderers: a JobSpec becomes sbatch flags, then either the standalone sbatch text or submitit's
parameters. Both come from the one flag table `slurm_flags`: a flag added there reaches both paths.
"""

from __future__ import annotations

import shlex
import urllib.parse
from dataclasses import fields
from typing import Any

import jinja2

from hpcjobs import __version__
from hpcjobs.backends.slurm.runtimes import (
    check_prefix,
    container_lines,
    rank_argv,
    requeue_lines,
    srun_container_flags,
)
from hpcjobs.profiles.cluster_profile import ClusterProfile
from hpcjobs.profiles.shipped import data_dir
from hpcjobs.profiles.slurmtime import parse_mem_mb
from hpcjobs.protocol.nodecall import NODE_PYTHON, RECOVERY_MODULE
from hpcjobs.protocol.points import array_spec
from hpcjobs.protocol.ports import shell_port_expr
from hpcjobs.protocol.runfolder import ARRAY_TASK_DIR, JOB_ID
from hpcjobs.protocol.versions import CHECK as TORCH_CHECK
from hpcjobs.protocol.versions import FLOOR_TEXT
from hpcjobs.request.after import dependency
from hpcjobs.request.credentials import check_lines
from hpcjobs.request.render import launcher_argv, signal_guard
from hpcjobs.request.rundir import snapshot_root
from hpcjobs.request.spec import JobSpec

SBATCH_TEMPLATE = "sbatch.sh.j2"
SUBMITIT_NATIVE = frozenset({
    "job_name", "partition", "nodes", "ntasks_per_node", "cpus_per_task", "gpus_per_node", "qos", "mem",
    "mem_per_gpu", "comment", "constraint", "account", "gres", "exclusive"})
"""sbatch flags that submitit's SlurmExecutor takes as keywords with the same value format as sbatch (a test checks
that each is one of submitit's parameters). Every other flag goes in `additional_parameters`, which submitit writes
as `#SBATCH --key=value` after replacing its own line of the same name (`time` and `signal` are submitit keywords
too, but in other units, so they go there as well)."""
SUBMITIT_DROPPED = ("wckey",)
"""Lines submitit writes by default that the sbatch path does not have: removed by passing None."""
SUBMITIT_DASHED = frozenset({"open-mode"})
"""submitit's own default lines keyed with a dash: an override must use the same key, or the line appears twice."""


def gpu_flags(spec: JobSpec) -> dict[str, Any]:
    p = spec.profile
    typed = f"{p.gpu_type}:" if p.gpu_type else ""
    if p.gpu_request == "gpus-per-node":
        flags: dict[str, Any] = {"gpus-per-node": f"{typed}{spec.gpus_per_node}"}
    elif p.gpu_request == "gres":
        flags = {"gres": f"gpu:{typed}{spec.gpus_per_node}"}
    else:
        flags = {}
    if p.mem_per_gpu:
        if flags:
            flags["mem-per-gpu"] = f"{parse_mem_mb(p.mem_per_gpu)}M"
        else:  # no GPU request: the same memory, asked for per node
            flags["mem"] = f"{parse_mem_mb(p.mem_per_gpu) * spec.gpus_per_node}M"
    return flags


def slurm_flags(spec: JobSpec) -> dict[str, Any]:
    """Every sbatch flag of the job, for both paths; only the log path differs (each path logs in its own place).
    A flag the profile passes through is a field of ClusterProfile naming it; any other flag is added here."""
    p = spec.profile
    flags: dict[str, Any] = {
        "job-name": spec.name, "nodes": spec.nodes + spec.recovery.spare_nodes, "ntasks-per-node": spec.gpus_per_node,
        "time": spec.time,
        "partition": spec.partition, "account": spec.account, "qos": spec.qos,  # flags of the same name override
        "requeue": True, "signal": f"{p.preemption.signal}@{p.preemption.seconds_before}", "open-mode": "append",
        "chdir": spec.workdir, **gpu_flags(spec), **profile_flags(p),
    }
    flags["comment"] = job_comment(spec.run_dir)
    if spec.recovery.spare_nodes:  # a node that fails leaves the job running on the others (trainers/recover.py)
        flags["no-kill"] = True
    if spec.array:  # a sweep: one array task per point, each requeued alone (it has its own SLURM_JOB_ID)
        flags["array"] = array_spec(len(spec.points), spec.max_parallel)
    if spec.after:  # Slurm cancels a dependent whose upstream ended so that it can never start (hpcjobs.request.after)
        flags["dependency"] = dependency(spec.after)
        flags["kill-on-invalid-dep"] = "yes"
    return {k: v for k, v in flags.items() if v is not None}


COMMENT_TAG = "hpcjobs:run="
"""Every job carries its run folder in its Slurm comment, so `hpcjobs status ID` finds any hpcjobs job (one started
from a rendered script with plain sbatch too, or after the job store was lost) and never takes another job that
got the same id (a rebuilt cluster) for it."""


def job_comment(run_dir: str) -> str:
    """The tag and the run folder pattern, percent-encoded: no quote, space or newline of a hostile path can reach
    the #SBATCH line."""
    return COMMENT_TAG + urllib.parse.quote(run_dir, safe="/")


def run_dir_of_comment(comment: str) -> str | None:
    """The run folder pattern a job's comment names, None if hpcjobs did not submit it."""
    return urllib.parse.unquote(comment[len(COMMENT_TAG):]) if comment.startswith(COMMENT_TAG) else None


def profile_flags(profile: ClusterProfile) -> dict[str, Any]:
    """The profile's pass-through sbatch flags: its fields whose metadata names one (see ClusterProfile)."""
    values = {f.metadata["sbatch"]: getattr(profile, f.name) for f in fields(profile) if "sbatch" in f.metadata}
    return {flag: value for flag, value in values.items() if value is not None and value is not False}


def sbatch_directive(key: str, value: Any) -> str:
    return f"--{key}" if value is True else f"--{key}={shlex.quote(str(value))}"


def environment_lines(spec: JobSpec) -> list[str]:
    """Shell lines exporting the rendezvous address/port and the profile's environment and NCCL variables."""
    lines = ['export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
             f"export MASTER_PORT={shell_port_expr()}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(spec.env.items())]
    lines += check_lines(spec.secrets)  # their values come from sbatch's environment, never from this file
    return lines


PYTHON_VAR = "HPCJOBS_PYTHON"
"""The nodes' Python in a job script: resolved by `python_lines` after the setup, then used by every rank."""


def python_lines(spec: JobSpec, modules: str = "trainers.launch") -> list[str]:
    """Shell lines (after the setup and the environment) that find the nodes' Python and end the job with one line,
    before any rank starts, when it cannot import `modules` or finds no torch at the floor version (by its metadata:
    importing torch here would add seconds to every start): otherwise every rank would fail alone, or the wrong
    environment would train. `python3` after the setup is tried first when the profile names no Python, then the
    Python hpcjobs ran from (a setup that only loads modules, with the environment on a shared filesystem), saying
    so in the job's log. With an image, the check runs inside it (`image_python_lines`)."""
    check = f"{TORCH_CHECK}; import {modules}"
    if spec.container is not None:
        return image_python_lines(spec, check)
    tried = "$hpcjobs_python -> ${HPCJOBS_PYTHON:-not found}: $(printf '%s' \"$hpcjobs_why\" | tail -n 1)"
    candidates = [spec.python, *([spec.python_fallback] if spec.python_fallback else [])]
    return [
        'hpcjobs_tried=""',
        f"for hpcjobs_python in {' '.join(shlex.quote(c) for c in candidates)}; do",
        f'  {PYTHON_VAR}="$(command -v "$hpcjobs_python" || true)"',
        f'  if hpcjobs_why="$("${{{PYTHON_VAR}:-$hpcjobs_python}}" -c {shlex.quote(check)} 2>&1)"; then break; fi',
        f'  hpcjobs_tried="${{hpcjobs_tried:+$hpcjobs_tried; then }}{tried}"',
        f'  {PYTHON_VAR}=""',
        "done",
        f'if [ -z "${PYTHON_VAR}" ]; then',
        '  echo "hpcjobs: the nodes\' Python on $(hostname) cannot start the ranks ($hpcjobs_tried); valid: a Python '
        f'with torch >= {FLOOR_TEXT} and hpcjobs installed. HINT: set python: in the profile, or make its setup '
        'activate that environment" >&2',
        "  exit 2",
        "fi",
        f'[ -z "$hpcjobs_tried" ] || echo "hpcjobs: $hpcjobs_tried; the ranks run ${PYTHON_VAR} instead (the Python '
        'hpcjobs ran from)" >&2',
        f"export {PYTHON_VAR}",
    ]


def image_python_lines(spec: JobSpec, check: str) -> list[str]:
    """The nodes' Python check run inside the image (one task on the batch node: the image's own Python, torch and
    hpcjobs; the project is mounted), ending the job with one line that says what is missing there."""
    image = spec.container
    assert image is not None
    run = shell_words([*check_prefix(spec), NODE_PYTHON, "-c", check])
    return [
        f"{PYTHON_VAR}={shlex.quote(spec.python)}",
        f'if ! hpcjobs_why="$({run} 2>&1)"; then',
        f'  echo "hpcjobs: the image {image.image} ({image.runtime}) cannot start the ranks on $(hostname): '
        f'${PYTHON_VAR}: $(printf \'%s\' "$hpcjobs_why" | tail -n 1); valid: an image with {spec.python}, torch >= '
        f'{FLOOR_TEXT} and hpcjobs installed. HINT: install them in the image, or set python: in the profile" >&2',
        "  exit 2",
        "fi",
        f"export {PYTHON_VAR}",
    ]


def handoff_lines(spec: JobSpec) -> list[str]:
    """The lines before srun an image needs (the requeue hand-off, in the run folder's parent): see
    hpcjobs.backends.slurm.runtimes."""
    return container_lines(spec, str(snapshot_root(spec.run_dir)))


def shell_words(words: list[str]) -> str:
    """Words quoted for the job script, except the nodes' Python, which the script's shell expands."""
    return " ".join(w if w == NODE_PYTHON else shlex.quote(w) for w in words)


def srun_flags(spec: JobSpec) -> list[str]:
    """Every rank's srun flags. --cpus-per-task again: Slurm 22.05 to 23.02 do not pass sbatch's to srun, and each
    rank would run its `cpus_per_gpu` threads on one core."""
    spare = [f"--nodes={spec.nodes}", f"--ntasks={spec.ranks}"] if spec.recovery.spare_nodes else []
    return ["--kill-on-bad-exit=1", f"--cpus-per-task={spec.profile.cpus_per_gpu}", *spare, *spec.profile.srun_args,
            *srun_container_flags(spec.container)]


ANNOUNCE = ('echo "hpcjobs: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST, rendezvous '
            '$MASTER_ADDR:$MASTER_PORT"')
"""The batch script's line before the ranks' first step, on both paths."""


def recovering(spec: JobSpec) -> bool:
    """Whether the batch script runs the ranks' step under trainers/recover.py. Not with an image: the recovery runs
    outside srun, where only the image has the nodes' Python (the requeue still brings such a job back)."""
    return spec.container is None


RECOVER_COMMAND = f"{NODE_PYTHON} -u -m {RECOVERY_MODULE} --"
"""The rendered script's command that runs the ranks' srun step and recovers from faults in the allocation; `srun
FLAGS RANK-COMMAND` follows it (submitit's path runs the same through hpcjobs.protocol.nodecall.SupervisedStep)."""


def ranks_step(spec: JobSpec) -> list[str]:
    """The ranks' srun step as the rendered script and the recovery run it."""
    return ["srun", *srun_flags(spec), *rank_argv(spec, launcher_argv(spec, python=NODE_PYTHON))]


def slurm_log_dir(spec: JobSpec) -> str:
    """Where Slurm's own output of rendered scripts goes (it must exist before the job starts)."""
    return str(spec.profile.runs_path() / "slurm-logs")


def render_sbatch(spec: JobSpec) -> str:
    """The standalone sbatch script for this spec."""
    flags = {**slurm_flags(spec), "output": f"{slurm_log_dir(spec)}/%x-{ARRAY_TASK_DIR if spec.array else JOB_ID}.out"}
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.get_template(SBATCH_TEMPLATE).render(
        version=__version__, profile_name=spec.profile.name, profile_source=spec.profile.source,
        world=spec.world(), entry=spec.entry.describe().replace("\n", " "),
        directives=[sbatch_directive(k, v) for k, v in sorted(flags.items())], setup=list(spec.profile.setup),
        python=python_lines(spec), environment=environment_lines(spec) + handoff_lines(spec),
        srun_flags=" ".join(shlex.quote(f) for f in srun_flags(spec)),
        recover=RECOVER_COMMAND + " " if recovering(spec) else "", announce=ANNOUNCE,
        launcher=shell_words(rank_argv(spec, launcher_argv(spec, python=NODE_PYTHON))) + "".join(
            f"\n{line}" for line in requeue_lines(spec)).replace("\n", " || hpcjobs_rc=$?\n", 1),
    )


def submitit_python(spec: JobSpec) -> str:
    """submitit's `python` (a shell command prefix): the same signal guard and interpreter as the other paths; for
    a job recovered in its allocation, the nodes' Python alone: submitit runs it in the batch script."""
    if recovering(spec):
        return NODE_PYTHON
    return shell_words(rank_argv(spec, [*signal_guard(spec), NODE_PYTHON]))


def submitit_parameters(spec: JobSpec) -> dict[str, Any]:
    """Keywords for submitit's SlurmExecutor.update_parameters: the very flags of `slurm_flags`, split into
    submitit's native keywords and `additional_parameters` (see SUBMITIT_NATIVE), plus the same setup, environment
    and srun flags as the sbatch script."""
    params: dict[str, Any] = {name: None for name in SUBMITIT_DROPPED}
    extra: dict[str, Any] = {}
    flags = slurm_flags(spec)
    if flags.pop("array", None):  # submitit writes --array itself, from the tasks submitted in one batch
        params["array_parallelism"] = spec.max_parallel or len(spec.points)
    for key, value in flags.items():
        name = key.replace("-", "_")
        if name in SUBMITIT_NATIVE:
            params[name] = value
        else:
            extra[key if key in SUBMITIT_DASHED else name] = value
    params["signal_delay_s"] = spec.profile.preemption.seconds_before
    params["additional_parameters"] = extra
    params["setup"] = [*spec.profile.setup, *environment_lines(spec), *handoff_lines(spec),
                       *python_lines(spec, "trainers.launch, submitit")]
    if recovering(spec):  # submitit runs hpcjobs.protocol.nodecall.SupervisedStep in the batch script: it runs srun
        params["setup"].append(ANNOUNCE)
        params["use_srun"] = False
    else:  # submitit writes these after its srun line: $? is srun's
        params["teardown"] = ["hpcjobs_rc=$?", *requeue_lines(spec)]
    params["srun_args"] = srun_flags(spec)
    params["stderr_to_stdout"] = True
    return params
