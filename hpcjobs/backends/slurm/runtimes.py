"""A Slurm job's ranks inside an image (hpcjobs.profiles.container): the srun flags or the command prefix of each
runtime, the nodes' Python check run inside the image, and the requeue hand-off. Pure; both submit paths (the rendered
script and submitit's) take these words, so they cannot differ.

The requeue hand-off: an image has no Slurm client (`scontrol: not found` in the test cluster's bundle, and in
most images: pytorch-lightning#21404), so rank 0 cannot run `scontrol requeue` itself. The batch script, which runs
outside the image where Slurm is, exports HPCJOBS_REQUEUE_FILE (a path in the run folder's parent, mounted at its
own path); rank 0 writes `requeue` there instead of running scontrol (the profile's signal: the time limit, a
preemption with preempt_send_user_signal), the ranks exit, and the script requeues the job after srun returned.
A SIGTERM needs no word from the ranks: inside the image they cannot ask Slurm whether it was a preemption (they stop
and exit 0, leaving the decision to Slurm), so the batch shell, which got the same SIGTERM, asks after srun returned:
still RUNNING with a PreemptTime is a preemption's GraceTime (a job that ended in time would end COMPLETED and never
come back: trainers/jobenv/slurm.py's preempted_with_sigterm), and it requeues; a `scancel` has made it CANCELLED.
The trap only records the SIGTERM (bash runs it once srun returned): the batch shell is never deaf to it, and
`scancel`'s SIGKILL after KillWait still ends it.
"""

from __future__ import annotations

import shlex

from hpcjobs.profiles.container import Image
from hpcjobs.protocol.contract import REQUEUE_FILE_VAR
from hpcjobs.request.spec import JobSpec

REQUEUE_FILE = REQUEUE_FILE_VAR  # the file rank 0 writes to ask the batch script for a requeue (the module's doc)
NODES_VAR = "HPCJOBS_NODES"
"""oci only: the job's hosts in order, from which each rank finds its node index (see OCI_IDENTITY)."""
OCI_IDENTITY = ('hpcjobs_at=""; i=0; for n in $HPCJOBS_NODES; do '
                'if [ "$n" = "$(uname -n)" ]; then hpcjobs_at=$i; break; fi; i=$((i+1)); done; '
                'if [ -z "$hpcjobs_at" ]; then echo "hpcjobs: this rank\'s host name $(uname -n) is not one of the '
                'job\'s nodes ($HPCJOBS_NODES), so it cannot know its rank; valid: a bundle that keeps the node\'s '
                'host name. HINT: remove the uts namespace and hostname from the bundle\'s config.json" >&2; exit 2; '
                'fi; export SLURM_PROCID=$hpcjobs_at SLURM_NODEID=$hpcjobs_at SLURM_LOCALID=0; ')
"""Slurm 22.05 gives an --container step no per-task variables of its own (SLURM_PROCID, SLURM_LOCALID,
SLURM_NODEID): the container gets the srun's environment, and inside a batch job that holds the batch step's
SLURM_PROCID=0, SLURM_NODEID=0 and SLURMD_NODENAME of the first node, on every node (measured on the test cluster:
both ranks took rank 0). With one task per node, a rank's index is its host's place in the job's host list, always
(a site's ociwrap that sets them per task gives the same index)."""


def oci_chdir(image: Image) -> str:
    """oci only: shell words that enter the job's working folder (the code snapshot) inside the bundle. Slurm runs
    the container in its config.json's process.cwd (`/` from `runc spec`), not in the step's --chdir: the generated
    config.json takes the bundle's own (22.05; measured on the test cluster), so a rank would import the project from
    wherever its Python finds it instead of the snapshot, and a script's relative paths would point into `/`."""
    return f"cd {shlex.quote(image.workdir)} || exit 2; "


def mounts(image: Image, sep: str = ",") -> str:
    return sep.join(image.mounts)


def srun_container_flags(image: Image | None) -> list[str]:
    """srun flags that start each rank inside the image (pyxis, oci); [] for exec wrappers and no container."""
    if image is None or image.wrapper:
        return []
    if image.runtime == "oci":
        return [f"--container={image.image}"]
    flags = [f"--container-image={image.image}", f"--container-workdir={image.workdir}"]
    return flags + ([f"--container-mounts={mounts(image)}"] if image.mounts else []) + list(image.flags)


def wrapper_prefix(spec: JobSpec, image: Image) -> list[str]:
    """The exec wrapper's words before the rank's command (apptainer, charliecloud)."""
    if image.runtime == "apptainer":
        nv = ["--nv"] if spec.gpu_ranks else []  # the host's driver and /dev/nvidia* inside; CUDA_VISIBLE_DEVICES kept
        binds = ["--bind", mounts(image)] if image.mounts else []
        return ["apptainer", "exec", *nv, *binds, "--pwd", image.workdir, *image.flags, image.image]
    binds = [w for m in image.mounts for w in ("-b", m)]
    return ["ch-run", *binds, "-c", image.workdir, *image.flags, image.image, "--"]


def rank_argv(spec: JobSpec, argv: list[str]) -> list[str]:
    """A rank's command (`argv` starts with hpcjobs.request.render.signal_guard) as it runs with the spec's image. An
    exec wrapper starts under the same guard (ch-run execs in place: an ignored signal stays ignored) and the guard
    runs again inside, before Python (apptainer's starter forwards signals to a new process)."""
    image = spec.container
    if image is None:
        return argv
    if image.runtime == "oci":
        return [*argv[:2], OCI_IDENTITY + oci_chdir(image) + argv[2], *argv[3:]]
    if image.wrapper:
        return [*argv[:4], *wrapper_prefix(spec, image), *argv]
    return argv


def check_prefix(spec: JobSpec) -> list[str]:
    """Words before `"$HPCJOBS_PYTHON" -c CHECK` that run the check inside the image, once, on the batch node."""
    image = spec.container
    assert image is not None
    if image.wrapper:
        return wrapper_prefix(spec, image)
    inside = ["/bin/sh", "-c", oci_chdir(image) + 'exec "$@"', "hpcjobs-check"] if image.runtime == "oci" else []
    return ["srun", "--nodes=1", "--ntasks=1", f"--cpus-per-task={spec.profile.cpus_per_gpu}",
            *srun_container_flags(image), *inside]


def container_lines(spec: JobSpec, handoff_dir: str) -> list[str]:
    """Lines before srun (after the environment): the requeue hand-off's file and the batch shell's SIGTERM trap,
    and for oci the host list. [] without an image."""
    if spec.container is None:
        return []
    where = shlex.quote(f"{handoff_dir}/.hpcjobs-requeue-")
    lines = [f'export {REQUEUE_FILE}={where}"$SLURM_JOB_ID"',
             f'mkdir -p {shlex.quote(handoff_dir)} && rm -f "${REQUEUE_FILE}"',
             "trap 'hpcjobs_term=1' TERM",
             "hpcjobs_rc=0 hpcjobs_term=0"]
    if spec.container.runtime == "oci":
        lines.append(f'export {NODES_VAR}="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr "\\n" " ")"')
    return lines


def requeue_lines(spec: JobSpec) -> list[str]:
    """Lines after srun (its exit code in hpcjobs_rc): the requeue rank 0 asked for, done here where scontrol is;
    the script then exits with srun's code (or 1 when the requeue failed: the job must not end COMPLETED)."""
    if spec.container is None:
        return []
    return [
        f'hpcjobs_ask="$(cat "${REQUEUE_FILE}" 2>/dev/null || true)"; rm -f "${REQUEUE_FILE}"',
        'hpcjobs_job="$(scontrol show job -o "$SLURM_JOB_ID" || true)"',
        'hpcjobs_running="${hpcjobs_job##*JobState=RUNNING*}" hpcjobs_preempted="${hpcjobs_job##*PreemptTime=None*}"',
        'if [ "$hpcjobs_term" = 1 ] && [ -z "$hpcjobs_running" ] && [ -n "$hpcjobs_preempted" ]; then',
        '  hpcjobs_ask="requeue"  # a preemption\'s SIGTERM: the ranks saved and left the decision to this script',
        "fi",
        'if [ "$hpcjobs_ask" = requeue ]; then',
        '  if scontrol requeue "$SLURM_JOB_ID"; then',
        '    echo "hpcjobs: requeued job $SLURM_JOB_ID (from outside the image)"',
        '  elif [ -z "$hpcjobs_running" ]; then',
        '    echo "hpcjobs: the requeue of job $SLURM_JOB_ID failed; the job ends failed" >&2; hpcjobs_rc=1',
        "  fi",
        "fi",
        'exit "$hpcjobs_rc"',
    ]
