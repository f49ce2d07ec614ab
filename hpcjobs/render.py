"""Pure renderers: a JobSpec becomes sbatch text, submitit parameters, or the launcher command every rank runs."""

from __future__ import annotations

import shlex
from typing import Any

import jinja2

from hpcjobs import __version__
from hpcjobs.contract import LaunchContract
from hpcjobs.ports import shell_port_expr
from hpcjobs.resources import data_dir
from hpcjobs.slurmtime import parse_mem_mb
from hpcjobs.spec import JobSpec

LAUNCHER_MODULE = "trainers.launch"
SBATCH_TEMPLATE = "sbatch.sh.j2"


def signal_guard(spec: JobSpec) -> list[str]:
    """Words that start a rank with the stop signals ignored (an ignored signal stays ignored across exec) until
    the launcher installs its handler. Slurm may send the time-limit signal at the first instant of a start (its
    check runs every 30 s and the signal may come up to a minute early); a Python rank still starting would be
    killed by it and the job would end FAILED (measured: `scancel --signal=USR2` 0.1 s into a start). Ignored
    there, the signal is lost instead, and the launcher stops at the time it was due (`preemption.install`)."""
    names = sorted({spec.profile.preemption.signal.upper().removeprefix("SIG"), "TERM"})
    return ["/bin/sh", "-c", f'trap "" {" ".join(names)}; exec "$@"', "hpcjobs-rank"]


def launch_contract(spec: JobSpec) -> LaunchContract:
    """The contract every rank reads (run folder pattern, preemption settings, time limit)."""
    return LaunchContract(run_dir=spec.run_dir, preemption=spec.profile.preemption, time_limit_s=spec.time_seconds)


def launcher_argv(spec: JobSpec) -> list[str]:
    """The command every rank runs, whichever way the job is started (sbatch, submitit, local)."""
    argv = [*signal_guard(spec), spec.python, "-u", "-m", LAUNCHER_MODULE, "--contract",
            launch_contract(spec).to_json(), "--kind", spec.entry.kind, "--", spec.entry.target]
    return argv + list(spec.entry.args)


def submitit_python(spec: JobSpec) -> str:
    """submitit's `python` (a shell command prefix): the same signal guard and interpreter as the other paths."""
    return " ".join(shlex.quote(w) for w in [*signal_guard(spec), spec.python])


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
    """sbatch flags shared by both paths (no log paths: each path puts its logs in its own place)."""
    p = spec.profile
    flags: dict[str, Any] = {
        "job-name": spec.name, "nodes": spec.nodes, "ntasks-per-node": spec.gpus_per_node,
        "cpus-per-task": p.cpus_per_gpu, "time": spec.time, "partition": spec.partition, "account": spec.account,
        "qos": spec.qos, "constraint": p.constraint, "exclusive": True if p.exclusive else None,
        "requeue": True, "signal": f"{p.preemption.signal}@{p.preemption.seconds_before}", "open-mode": "append",
        **gpu_flags(spec),
    }
    return {k: v for k, v in flags.items() if v is not None}


def _flag(key: str, value: Any) -> str:
    return f"--{key}" if value is True else f"--{key}={shlex.quote(str(value))}"


def environment_lines(spec: JobSpec) -> list[str]:
    """Shell lines exporting the rendezvous address/port and the profile's environment and NCCL variables."""
    lines = ['export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
             f"export MASTER_PORT={shell_port_expr()}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(spec.env.items())]
    return lines


def srun_flags(spec: JobSpec) -> list[str]:
    return ["--kill-on-bad-exit=1", *spec.profile.srun_args]


def slurm_log_dir(spec: JobSpec) -> str:
    """Where Slurm's own output of rendered scripts goes (it must exist before the job starts)."""
    return str(spec.profile.runs_path() / "slurm-logs")


def render_sbatch(spec: JobSpec) -> str:
    """The standalone sbatch script for this spec."""
    flags = slurm_flags(spec)
    flags["output"] = f"{slurm_log_dir(spec)}/%x-%j.out"
    flags["chdir"] = spec.workdir
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    return env.get_template(SBATCH_TEMPLATE).render(
        version=__version__, profile_name=spec.profile.name, profile_source=spec.profile.source,
        world=spec.world(), entry=spec.entry.describe().replace("\n", " "),
        directives=[_flag(k, v) for k, v in sorted(flags.items())], setup=list(spec.profile.setup),
        environment=environment_lines(spec), srun_flags=" ".join(shlex.quote(f) for f in srun_flags(spec)),
        launcher=" ".join(shlex.quote(w) for w in launcher_argv(spec)),
    )


def submitit_parameters(spec: JobSpec) -> dict[str, Any]:
    """Parameters for submitit's SlurmExecutor.update_parameters: the same flags as the sbatch script."""
    flags = slurm_flags(spec)
    known = {"job-name": "job_name", "nodes": "nodes", "ntasks-per-node": "ntasks_per_node",
             "cpus-per-task": "cpus_per_task", "partition": "partition", "account": "account", "qos": "qos",
             "constraint": "constraint", "exclusive": "exclusive", "gpus-per-node": "gpus_per_node", "gres": "gres",
             "mem-per-gpu": "mem_per_gpu", "mem": "mem"}
    params: dict[str, Any] = {known[k]: v for k, v in flags.items() if k in known}
    if "gpus_per_node" in params and isinstance(params["gpus_per_node"], str) and params["gpus_per_node"].isdigit():
        params["gpus_per_node"] = int(params["gpus_per_node"])
    params["time"] = max(1, -(-spec.time_seconds // 60))  # submitit takes minutes
    params["signal_delay_s"] = spec.profile.preemption.seconds_before
    # submitit always writes --signal=USR2@delay and --time in minutes; these come last and match the sbatch script.
    params["additional_parameters"] = {"requeue": True, "signal": flags["signal"], "time": flags["time"],
                                       "chdir": spec.workdir}
    params["setup"] = [*spec.profile.setup, *environment_lines(spec)]
    params["srun_args"] = srun_flags(spec)
    params["stderr_to_stdout"] = True
    return params
