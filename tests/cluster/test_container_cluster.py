"""Jobs inside an image on the test cluster (issue 29): every rank runs inside a root file system built here that
has no Slurm client, proves it (a file only the image has, copied out by each rank), and a job preempted or cut by
its time limit comes back and ends with weights bit-identical to an uninterrupted run.

charliecloud's `ch-run` takes Apptainer's place (Apptainer is not packaged for Debian; the measured facts are in the
shared containers doc): several ranks per node. Slurm's own `--container` (oci: runc, through the oci.conf that
testcluster.sh writes) starts one rank per node, in a bundle around the same image.

All four charliecloud cases passed on the test cluster; CI runs the preemption through submit (the requeue hand-off
from inside the image, both ranks per node inside), the other three run with -m slow. Likewise for oci: CI runs the
direct `srun --container` check and the preemption through submit."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from container_image import PREFIXES, build_bundle, build_rootfs

from conftest import REPO, slurm, wait_for_state, wait_for_step

pytestmark = pytest.mark.cluster
CH_RUN = pytest.mark.skipif(shutil.which("ch-run") is None and os.environ.get("CI") != "true",  # CI installs it
                            reason="charliecloud (ch-run) is not installed")
OCI = pytest.mark.skipif(shutil.which("runc") is None and os.environ.get("CI") != "true",  # CI installs it
                         reason="runc is not installed (the test cluster's oci.conf runs it)")


@pytest.fixture(scope="module")
def folder() -> Path:
    path = Path(f"/tmp/hpcjobs-container-{os.getpid()}")
    path.mkdir(exist_ok=True)
    path.chmod(0o755)
    return path


def container_profile(folder: Path, image: Path, env: dict[str, str] | None = None, runtime: str = "charliecloud",
                      **preemption: int) -> Path:
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data["runs_dir"] = str(folder / "runs")
    data["preemption"].update(preemption)
    data["env"].update({"USER": "root", "HPCJOBS_PROOF": str(folder / "proof"), **(env or {})})  # ch-run needs USER
    data["python"] = "/hpcjobs-python"
    data["container"] = {"runtime": runtime, "image": str(image)}
    if runtime == "charliecloud":  # oci takes no mounts: the bundle's config.json holds them (build_bundle)
        data["container"]["mounts"] = sorted({f"{p}:{p}" for p in PREFIXES})
    name = "-".join(f"{k}{v}" for k, v in preemption.items()) or "default"
    path = folder / f"profile-{runtime}-{name}{'-slow' if env else ''}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@CH_RUN
def test_the_image_has_no_slurm_client_and_every_rank_runs_inside(folder: Path) -> None:
    image = build_rootfs(folder)
    out = subprocess.run(["ch-run", str(image), "--", "/bin/sh", "-c", "command -v scontrol || echo none"],
                         capture_output=True, text=True, env={**os.environ, "USER": "root"})
    assert out.stdout.strip() == "none", out


@pytest.mark.parametrize("path,trigger", [
    ("submit", "preemption"),  # the test cluster sends the user signal at preemption
    pytest.param("sbatch", "preemption", marks=pytest.mark.slow),
    pytest.param("submit", "time-limit", marks=pytest.mark.slow),
    pytest.param("sbatch", "time-limit", marks=pytest.mark.slow),
])
@CH_RUN
def test_a_job_in_an_image_comes_back_bit_identical(path: str, trigger: str, folder: Path) -> None:
    from test_preemption import DONE, References, report, start, trigger_now, weights

    image = build_rootfs(folder)
    (folder / "proof").mkdir(exist_ok=True)
    reference = References(folder)("ddp")
    run = folder / f"container-{trigger}-{path}"
    if trigger == "time-limit":
        # As test_preemption's ddp case: each step made longer, so the run outlasts the signal (0-30 s into a start):
        # on the submitit path all 500 steps were done before it came.
        profile = container_profile(folder, image, {"HPCJOBS_FAULT_SLOW_STEP": "0.1"}, seconds_before=90,
                                    max_restarts=30)
        job = start(path, profile, run, folder, time_limit="2:00")
    else:
        job = start(path, container_profile(folder, image), run, folder)
        wait_for_step(run, 100)
        trigger_now(trigger, job)
    assert wait_for_state(job, DONE, timeout=900) == "COMPLETED"
    row = report(f"container-{trigger}", path, run, job)
    assert row["restarts"] >= 1, row
    got = weights(run)
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
    proofs = [p for p in (folder / "proof").glob("rank-*") if f"-job-{job}-" in p.name]
    assert {p.name.split("-")[1] for p in proofs} >= {"0", "1", "2", "3"}  # 2 nodes × 2 ranks, each in the image
    assert all(p.read_text() == "inside the test image\n" for p in proofs)


def oci_conf_adds_task_variables() -> bool:
    """Whether the cluster's oci.conf runs ociwrap.sh (HPCJOBS_CLUSTER_OCI_TASK_ENV=1), which gives the container the
    per-task variables Slurm 22.05 leaves out."""
    return "ociwrap.sh" in (Path(os.environ["HPCJOBS_TEST_CLUSTER"]) / "etc" / "slurm" / "oci.conf").read_text()


@OCI
def test_srun_container_starts_one_task_per_node_in_the_bundle(folder: Path) -> None:
    """The test cluster's oci.conf itself: each node's task sees the bundle's root (its marker, no scontrol), keeps
    the node's hostname, and (as Slurm 22.05 ships) gets no SLURM_PROCID: hpcjobs's OCI_IDENTITY is what gives a
    rank its index."""
    bundle = build_bundle(folder)
    out = slurm("srun", "-N2", "--ntasks-per-node=1", "--time=2", f"--container={bundle}", "/bin/sh", "-c",
                'echo "$(uname -n) $(cat /IMAGE_MARKER) $(command -v scontrol || echo no-scontrol) '
                'procid=${SLURM_PROCID:-none}"')
    procid = ("0", "1") if oci_conf_adds_task_variables() else ("none", "none")
    assert sorted(out.splitlines()) == [f"node{n + 1} inside the test image no-scontrol procid={procid[n]}"
                                        for n in range(2)], out


@pytest.fixture(scope="module")
def oci_reference(folder: Path) -> dict[str, torch.Tensor]:
    """An uninterrupted run on 2 nodes × 1 rank, outside any image (the oci cases' world size)."""
    from test_preemption import References

    return References(folder, gpus=1)("ddp")


@pytest.mark.parametrize("path,trigger", [
    ("submit", "preemption"),
    pytest.param("sbatch", "preemption", marks=pytest.mark.slow),
    pytest.param("submit", "time-limit", marks=pytest.mark.slow),
])
@OCI
def test_an_oci_bundle_runs_one_rank_per_node(path: str, trigger: str, folder: Path,
                                              oci_reference: dict[str, torch.Tensor]) -> None:
    """Slurm's own --container (runc): both ranks (one per node) run in the bundle, the job is preempted or cut by
    its time limit, comes back (the requeue from outside the bundle) and ends bit-identical to the uninterrupted
    run."""
    from test_preemption import DONE, report, start, trigger_now, weights

    bundle = build_bundle(folder)
    (folder / "proof").mkdir(exist_ok=True)
    run = folder / f"oci-{trigger}-{path}"
    if trigger == "time-limit":  # as the charliecloud case: each start cut 0-30 s in
        profile = container_profile(folder, bundle, {"HPCJOBS_FAULT_SLOW_STEP": "0.1"}, "oci", seconds_before=90,
                                    max_restarts=30)
        job = start(path, profile, run, folder, time_limit="2:00", gpus=1)
    else:
        job = start(path, container_profile(folder, bundle, runtime="oci"), run, folder, gpus=1)
        wait_for_step(run, 100)
        trigger_now(trigger, job)
    assert wait_for_state(job, DONE, timeout=900) == "COMPLETED", slurm("sacct", "-j", job, check=False)
    row = report(f"oci-{trigger}", path, run, job)
    assert row["restarts"] >= 1, row
    got = weights(run)
    assert got.keys() == oci_reference.keys() and all(torch.equal(got[k], oci_reference[k]) for k in got)
    proofs = [p for p in (folder / "proof").glob("rank-*") if f"-job-{job}-" in p.name]
    assert {p.name.split("-")[1] for p in proofs} >= {"0", "1"}  # 2 nodes × 1 rank, each in the bundle
    assert all(p.read_text() == "inside the test image\n" for p in proofs)
    cwd = {Path(p.read_text().strip()) for p in (folder / "proof").glob(f"cwd-*-job-{job}-*")}
    assert len(cwd) == 1 and next(iter(cwd)).parent == folder / ".snapshots", cwd  # the job's code snapshot
