"""Pure, scheduler-neutral renderers: what every rank runs, however it is started (a rendered sbatch script,
submitit, the local backend). The scheduler-specific renderers live with their backend (hpcjobs/backends/)."""

from __future__ import annotations

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.nodecall import LAUNCHER_MODULE
from hpcjobs.request.spec import JobSpec


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
    own = spec.snapshot is not None and spec.entry.kind != "task"  # a user's script: its relative paths, as given
    return LaunchContract(run_dir=spec.run_dir, preemption=spec.profile.preemption, recovery=spec.recovery,
                          time_limit_s=spec.time_seconds,
                          points=spec.points if spec.array else (),
                          submit_dir=spec.snapshot.origin(spec.workdir) if own and spec.snapshot else "")


def launcher_argv(spec: JobSpec, python: str | None = None) -> list[str]:
    """The command every rank runs, whichever way the job is started (sbatch, submitit, local); `python` replaces
    the spec's (a renderer that resolves it on the node)."""
    argv = [*signal_guard(spec), python or spec.python, "-u", "-m", LAUNCHER_MODULE, "--contract",
            launch_contract(spec).to_json(), "--kind", spec.entry.kind, "--", spec.entry.target]
    return argv + list(spec.entry.args)

