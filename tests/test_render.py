"""The pure renderers: golden scripts, shell quoting of hostile strings, bash -n, submitit parameters."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPO
from hpcjobs.backends import backend_for
from hpcjobs.backends.slurm.sbatch import (
    ranks_step,
    render_sbatch,
    shell_words,
    submitit_parameters,
    submitit_python,
)
from hpcjobs.profiles.cluster_profile import load_profile
from hpcjobs.request.render import launcher_argv, signal_guard
from hpcjobs.request.spec import Request, build_spec

GOLDEN = REPO / "tests" / "golden"


def fixed_spec(profile_name: str, **req: object):
    profile = replace(load_profile(str(REPO / "cluster_profiles" / f"{profile_name}.yaml")),
                      source=f"cluster_profiles/{profile_name}.yaml", python="/opt/venv/bin/python")
    profile = replace(profile, runs_dir=profile.runs_dir.replace("$USER", "alice"))  # not this machine's user
    request = Request(entry="trainers.tasks.lm", args=("--size", "small", "--steps", "5000"), nodes=2, gpus=8,
                      snapshot=False,
                      time="4:00:00", **req)  # type: ignore[arg-type]
    return build_spec(profile, request, backend_for(profile.scheduler), workdir=Path("/work/proj"),
                      stamp="20260101-000000-0001", job_id_in_run_dir=True)


@pytest.mark.parametrize("profile", ["testcluster", "a100-ib", "h100"])
def test_golden_script(profile: str) -> None:
    text = render_sbatch(fixed_spec(profile))
    golden = GOLDEN / f"{profile}-2x8.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"rendered script differs from {golden}; UPDATE_GOLDEN=1 rewrites it"
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_gpu_request_forms() -> None:
    assert "#SBATCH --gpus-per-node=8" in render_sbatch(fixed_spec("testcluster"))
    assert "#SBATCH --gres=gpu:a100:8" in render_sbatch(fixed_spec("a100-ib"))
    assert "#SBATCH --gpus-per-node=h100:8" in render_sbatch(fixed_spec("h100"))


HOSTILE = "it's a \"run\"; rm -rf / $(reboot) `id`\nsecond line"


def test_hostile_strings_reach_the_ranks_unchanged(tmp_path: Path) -> None:
    """Run the rendered script in bash with srun/scontrol replaced by recorders: every word arrives intact, the
    nodes' Python too (a real one, which the script checks before srun, behind a folder named with the string)."""
    python = tmp_path / HOSTILE / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    python.chmod(0o755)
    one_line = HOSTILE.replace("\n", " ")  # a run folder with a newline is refused (it would end an #SBATCH line)
    spec = fixed_spec("testcluster", run_dir=f"/tmp/{one_line}-%j", env=(f"WEIRD={HOSTILE}",), name="q")
    spec = replace(spec, python=str(python), entry=replace(spec.entry, args=("--note", HOSTILE, ";", "&&")))
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    record = tmp_path / "argv"
    srun = tmp_path / "bin" / "srun"  # a program: the recovery (trainers/recover.py) runs it, not the shell
    srun.parent.mkdir()
    srun.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > "{record}"; printf "%s" "$WEIRD" > "{record}.env"\n')
    srun.chmod(0o755)
    stubs = 'scontrol() { echo node7; }\n'
    env = {**os.environ, "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[7-8]",
           "PATH": f"{srun.parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", stubs + f'source "{script}"'], check=True, env=env, cwd=tmp_path)
    words = record.read_bytes().decode().split("\0")[:-1]
    launcher = launcher_argv(spec)
    srun_flags = words[: words.index(launcher[0])]
    assert srun_flags == ["--kill-on-bad-exit=1", "--cpus-per-task=1"]
    assert words[len(srun_flags):] == launcher  # the run folder's %j travels in the contract, resolved by the rank
    assert (tmp_path / "argv.env").read_text() == HOSTILE


def test_rendezvous_lines_in_script() -> None:
    text = render_sbatch(fixed_spec("testcluster"))
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in text
    assert "export MASTER_PORT=$(( 15000 + SLURM_JOB_ID % 15000 ))" in text
    for flag in ("--requeue", "--signal=USR2@60", "--open-mode=append", "--ntasks-per-node=8", "--nodes=2"):
        assert f"#SBATCH {flag}\n" in text
    assert "srun --kill-on-bad-exit=1" in text


def test_submitit_parameters_match_the_script() -> None:
    spec = fixed_spec("a100-ib")
    params = submitit_parameters(spec)
    text = render_sbatch(spec)
    assert params["nodes"] == 2 and params["ntasks_per_node"] == 8 and params["gres"] == "gpu:a100:8"
    assert params["additional_parameters"]["signal"] == "USR2@180"
    assert f"#SBATCH --signal={params['additional_parameters']['signal']}" in text
    assert f"#SBATCH --time={params['additional_parameters']['time']}" in text
    assert params["setup"][:2] == ["module load cuda/12.4 nccl/2.21", "source ~/venvs/train/bin/activate"]
    missing = [line for line in params["setup"] if line not in text]  # submitit's check imports submitit too
    assert len(missing) == 1 and "sys.exit(problem); import trainers.launch, submitit'" in missing[0]
    # submitit runs SupervisedStep in the batch script (no srun of its own), which runs the very step the rendered
    # script runs under the recovery
    assert params["use_srun"] is False and "teardown" not in params
    step = text.split('"$HPCJOBS_PYTHON" -u -m trainers.recover -- ', 1)[1].rstrip("\n").replace(" \\\n  ", " ")
    assert shell_words(ranks_step(spec)) == step
    assert params["srun_args"] == ["--kill-on-bad-exit=1", "--cpus-per-task=12", "--cpu-bind=cores"]


def test_world_size_is_spelled_out() -> None:
    assert fixed_spec("testcluster").world() == "2 nodes × 8 GPUs = 16 ranks"
    assert "# 2 nodes × 8 GPUs = 16 ranks" in render_sbatch(fixed_spec("testcluster"))


# A rank that takes a while to start (imports, a container): it must not die of a stop signal that comes before
# its handler exists. The sleep stands for the startup; the handler is installed after it.
SLOW_RANK = ("import signal, sys, time; time.sleep(1.5); got = []; "
             "signal.signal(signal.SIGUSR1, lambda *a: got.append(1)); time.sleep(0.3); sys.exit(0)")


@pytest.mark.train
@pytest.mark.parametrize("guarded", [True, False])
def test_a_signal_in_a_ranks_first_instant_does_not_kill_it(guarded: bool) -> None:
    spec = fixed_spec("h100")  # its signal is USR1
    assert spec.profile.preemption.signal == "USR1"
    argv = [*(signal_guard(spec) if guarded else []), sys.executable, "-c", SLOW_RANK]
    proc = subprocess.Popen(argv)
    time.sleep(0.5)  # the guard (or the bare interpreter) is running, the rank's handler is not there yet
    proc.send_signal(signal.SIGUSR1)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert rc == (0 if guarded else -signal.SIGUSR1)


def test_every_path_starts_ranks_through_the_guard() -> None:
    spec = fixed_spec("testcluster")
    guard = signal_guard(spec)
    assert guard[:2] == ["/bin/sh", "-c"] and 'trap "" TERM USR2;' in guard[2]
    assert launcher_argv(spec)[: len(guard) + 1] == [*guard, spec.python]
    # submitit runs the ranks' srun step from the batch script (SupervisedStep), whose ranks start through the guard
    launcher = launcher_argv(spec, python='"$HPCJOBS_PYTHON"')
    assert submitit_python(spec) == '"$HPCJOBS_PYTHON"' and ranks_step(spec)[-len(launcher):] == launcher
    assert launcher[: len(guard)] == guard


def test_the_docs_show_the_script_as_rendered_today() -> None:
    golden = (GOLDEN / "testcluster-2x8.sbatch").read_text()
    page = REPO / "docs" / "reference" / "rendered-script.md"
    assert f"```bash\n{golden}```" in page.read_text(), f"{page.relative_to(REPO)}'s rendered script is stale"


def test_gloo_is_named_in_the_script_only_where_the_profile_names_it() -> None:
    """NCCL_SOCKET_IFNAME is a prefix that only the node can resolve to gloo's exact name (trainers.distenv, at each
    rank's start): the script carries gloo's interface only where the profile or --env names it."""
    assert "GLOO_SOCKET_IFNAME" not in render_sbatch(fixed_spec("h100"))  # NCCL_SOCKET_IFNAME: eth0 alone
    assert "GLOO_SOCKET_IFNAME" not in render_sbatch(fixed_spec("a100-ib"))
    assert "export GLOO_SOCKET_IFNAME=eth0" in render_sbatch(fixed_spec("testcluster"))  # the profile's own


CONTAINERS = {  # golden name: (profile, its container keys, GPUs per node)
    "pyxis": ("h100", {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.05-py3",
                       "mounts": ("/lustre/data:/data:ro",), "flags": ("--container-remap-root",)}, 8),
    "apptainer": ("a100-ib", {"runtime": "apptainer", "image": "/shared/images/train.sif",
                              "mounts": ("/scratch/data:/data:ro",)}, 8),
    "charliecloud": ("testcluster", {"runtime": "charliecloud", "image": "/shared/images/train"}, 8),
    "oci": ("testcluster", {"runtime": "oci", "image": "/shared/bundles/train"}, 1),
}


def container_spec(runtime: str, monkeypatch: pytest.MonkeyPatch, **req: object):
    """A fixed spec whose profile runs the ranks in an image (the image paths exist on the cluster, not here)."""
    import hpcjobs.profiles.container
    from hpcjobs.profiles.container import Container

    profile_name, keys, gpus = CONTAINERS[runtime]
    monkeypatch.setattr(hpcjobs.profiles.container, "_check_image", lambda *a: None)
    profile = replace(load_profile(str(REPO / "cluster_profiles" / f"{profile_name}.yaml")),
                      source=f"cluster_profiles/{profile_name}.yaml", container=Container(**keys))  # type: ignore[arg-type]
    profile = replace(profile, runs_dir=profile.runs_dir.replace("$USER", "alice"))
    request = Request(entry="trainers.tasks.lm", args=("--size", "small", "--steps", "5000"), nodes=2, gpus=gpus,
                      snapshot=False, time="4:00:00", **req)  # type: ignore[arg-type]
    return build_spec(profile, request, backend_for(profile.scheduler), workdir=Path("/work/proj"),
                      stamp="20260101-000000-0001", job_id_in_run_dir=True)


@pytest.mark.parametrize("runtime", sorted(CONTAINERS))
def test_golden_container_script(runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    text = render_sbatch(container_spec(runtime, monkeypatch))
    golden = GOLDEN / f"container-{runtime}.sbatch"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"rendered script differs from {golden}; UPDATE_GOLDEN=1 rewrites it"
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


STUBS = """
srun() {
  printf '%s\\0' "$@" > "$T/srun.argv"; [ -z "$ASK" ] || printf '%s' "$ASK" > "$HPCJOBS_REQUEUE_FILE"
  [ -z "$SIGTERM" ] || kill -TERM $$  # Slurm's SIGTERM reaches the batch shell too
  return "$RC"
}
ch-run() { printf '%s\\0' "$@" > "$T/check.argv"; return "$CHECK_RC"; }
scontrol() {
  case "$1 $2" in
    "show hostnames") echo node1 ;;
    "show job") echo "JobId=42 JobState=$STATE Reason=None PreemptTime=$PREEMPT" ;;
    "requeue "*) echo "$2" >> "$T/requeued" ;;
  esac
}
"""


def run_container_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ask: str = "", rc: int = 0,
                         preempt: str = "None", check_rc: int = 0, sigterm: bool = False,
                         state: str = "RUNNING") -> subprocess.CompletedProcess[str]:
    """The charliecloud script run in bash with srun, ch-run and scontrol replaced by recorders; the stub srun
    plays rank 0: it writes `ask` into the hand-off file and ends with `rc` (after a SIGTERM to the batch shell)."""
    spec = container_spec("charliecloud", monkeypatch, run_dir=str(tmp_path / "runs" / "lm-%j"))
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    env = {**os.environ, "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1", "T": str(tmp_path), "ASK": ask,
           "RC": str(rc), "PREEMPT": preempt, "CHECK_RC": str(check_rc), "SIGTERM": "1" if sigterm else "",
           "STATE": state}
    return subprocess.run(["bash", "-c", STUBS + f'. "{script}"'], env=env, cwd=tmp_path, text=True,
                          capture_output=True)


def test_a_container_rank_runs_in_the_image_and_its_check_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = run_container_script(tmp_path, monkeypatch)
    assert out.returncode == 0, out.stderr
    words = (tmp_path / "srun.argv").read_text().split("\0")[:-1]
    run_root = str(tmp_path / "runs")
    at = words.index("ch-run")
    assert words[at:at + 7] == ["ch-run", "-b", f"{run_root}:{run_root}", "-b", "/work/proj:/work/proj", "-c",
                                "/work/proj"]
    assert words[at + 7:at + 9] == ["/shared/images/train", "--"]
    assert words[at + 9:at + 13] == words[at - 4:at]  # the signal guard outside, and again inside the image
    check = (tmp_path / "check.argv").read_text().split("\0")[:-1]
    assert check[check.index("--") + 1:][:2] == ["python3", "-c"]
    assert not (tmp_path / "requeued").exists()


def test_rank_zeros_requeue_is_done_outside_the_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = run_container_script(tmp_path, monkeypatch, ask="requeue")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "requeued").read_text() == "42\n"
    assert "requeued job 42 (from outside the image)" in out.stdout
    assert not list((tmp_path / "runs").glob(".hpcjobs-requeue-*"))  # the hand-off file is gone


@pytest.mark.parametrize(("sigterm", "state", "preempt", "requeued"), [
    (True, "RUNNING", "None", False),              # a SIGTERM without a preemption (an outside requeue)
    (True, "CANCELLED", "None", False),            # scancel
    (True, "RUNNING", "2026-01-01T18:00:00", True),  # a preemption's GraceTime: the job must come back
    (False, "RUNNING", "2026-01-01T18:00:00", False),  # no SIGTERM reached the job: the ranks ended by themselves
])
def test_a_sigterm_stop_is_requeued_only_when_slurm_preempted_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigterm: bool, state: str, preempt: str,
        requeued: bool) -> None:
    out = run_container_script(tmp_path, monkeypatch, sigterm=sigterm, state=state, preempt=preempt)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "requeued").exists() == requeued


def test_the_ranks_exit_code_is_the_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_container_script(tmp_path, monkeypatch, rc=3).returncode == 3
    assert not (tmp_path / "requeued").exists()


def test_an_image_without_torch_ends_the_job_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = run_container_script(tmp_path, monkeypatch, check_rc=1)
    assert out.returncode == 2 and not (tmp_path / "srun.argv").exists()
    assert "hpcjobs: the image /shared/images/train (charliecloud) cannot start the ranks" in out.stderr


def test_submitit_runs_the_same_ranks_in_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    for runtime in CONTAINERS:
        spec = container_spec(runtime, monkeypatch)
        params, text = submitit_parameters(spec), render_sbatch(spec)
        assert f"srun {' '.join(shlex.quote(f) for f in params['srun_args'])} " in text
        assert params["teardown"][0] == "hpcjobs_rc=$?" and params["teardown"][-1] == 'exit "$hpcjobs_rc"'
        assert all(line in text for line in params["teardown"][1:])
        assert submitit_python(spec) in text  # the rank's prefix up to its Python: the same words


@pytest.mark.parametrize("runtime", sorted(CONTAINERS))
def test_doctors_probe_reports_from_inside_the_image(runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcjobs.backends.slurm.probe import probe_folder, probe_script

    spec = container_spec(runtime, monkeypatch)
    folder = str(probe_folder(spec))
    text = probe_script(spec, probe_folder(spec) / "r.json")
    report = next(line for line in text.splitlines() if "<<'HPCJOBS_PROBE'" in line)
    check = next(line for line in text.splitlines() if line.startswith("if ! hpcjobs_why="))
    inside = {"pyxis": "--container-image=", "oci": "--container=", "apptainer": "apptainer exec",
              "charliecloud": "ch-run "}[runtime]
    assert inside in report and inside in check and report.index(inside) < report.index('"$HPCJOBS_PYTHON" -')
    if runtime != "oci":  # the bundle's config.json holds an oci job's mounts; the runs folder holds the probe's
        runs = str(spec.profile.runs_path())
        assert f"{runs}:{runs}" in report and f"{folder}:{folder}" not in report
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_the_probes_folder_is_mounted_when_the_runs_folder_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcjobs.backends.slurm.probe import probe_folder, probe_script

    spec = container_spec("pyxis", monkeypatch, run_dir="/elsewhere/r-%j")
    folder = str(probe_folder(spec))
    assert f"{folder}:{folder}" in probe_script(spec, probe_folder(spec) / "r.json")


def oci_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    """An oci rank's words as srun starts them inside the bundle, run here up to a command that prints what the
    rank's Python would see: its index and the folder it starts in (the spec's working folder is `tmp_path/proj`)."""
    from hpcjobs.backends.slurm.runtimes import rank_argv

    spec = container_spec("oci", monkeypatch)
    (tmp_path / "proj").mkdir(parents=True)
    spec = replace(spec, container=replace(spec.container, workdir=str(tmp_path / "proj")))
    argv = rank_argv(spec, [*signal_guard(spec), "/bin/sh", "-c", 'echo "$SLURM_PROCID $SLURM_NODEID $(pwd)"'])
    out = subprocess.run(argv, env={"PATH": os.environ["PATH"], **env}, cwd="/", text=True, capture_output=True)
    return out.stdout.strip() + out.stderr.strip()


def test_an_oci_rank_starts_in_the_jobs_working_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm starts an --container step in the bundle config.json's cwd (`/`), not the step's --chdir (measured on
    the test cluster): the rank goes to the code snapshot itself."""
    nodes = f"elsewhere {os.uname().nodename}"
    assert oci_rank(tmp_path, monkeypatch, {"HPCJOBS_NODES": nodes}) == f"1 1 {tmp_path / 'proj'}"


def test_an_oci_rank_ignores_the_batch_steps_rank_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a batch job, every --container task gets the batch step's SLURM_PROCID=0 and SLURM_NODEID=0 (measured
    on the test cluster): the index is the host's place in the job's host list, or one line when it is not there."""
    leaked = {"SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "elsewhere"}
    nodes = f"elsewhere {os.uname().nodename}"
    assert oci_rank(tmp_path, monkeypatch, {"HPCJOBS_NODES": nodes, **leaked}) == f"1 1 {tmp_path / 'proj'}"
    said = oci_rank(tmp_path / "b", monkeypatch, {"HPCJOBS_NODES": "elsewhere other", **leaked})
    assert said.startswith("hpcjobs: this rank's host name") and "HINT: remove the uts namespace" in said, said
