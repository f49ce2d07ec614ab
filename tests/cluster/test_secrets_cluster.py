"""Secrets on the real cluster (issue 39): a canary passed by name (`--env NAME`, a profile's `secrets:`) reaches
every rank on both nodes through submitit's sbatch and through a rendered script under plain sbatch, and is found in
no file of the run folder, the snapshot, the job store, the script, and in no output; the run folders and
the ranks' logs are the owner's alone though sbatch ran under umask 022: another, unprivileged user cannot list the
run folders nor read a log or the job store."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from test_secrets import as_nobody

from conftest import REPO, hpcjobs, wait_for_state

pytestmark = pytest.mark.cluster
NAME = "HPCJOBS_CANARY_TOKEN"
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def found_in(canary: str, folders: list[Path], outputs: list[subprocess.CompletedProcess[str]]) -> list[str]:
    needle = canary.encode()
    hits = [str(p) for f in folders for p in f.rglob("*") if p.is_file() and needle in p.read_bytes()]
    return hits + [" ".join(map(str, o.args[:3])) for o in outputs if canary in o.stdout + o.stderr]


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def rank_digests(run: Path) -> dict[str, str]:
    return {log.name: log.read_text() for log in sorted((run / "logs" / "restart-0").glob("rank-*.log"))}


@pytest.mark.train
def test_a_secret_reaches_both_nodes_and_is_written_nowhere(shared_tmp: Path, hpcjobs_home: Path) -> None:
    canary = f"canary-{uuid.uuid4().hex}"
    digest = hashlib.sha256(canary.encode()).hexdigest()
    work = shared_tmp / "work"  # outside git: the snapshot copies the folder, the profiles with it
    work.mkdir()
    shutil.copy(REPO / "tests" / "scripts" / "secret_hash.py", work / "secret_hash.py")
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data.update(runs_dir=str(shared_tmp / "runs"), python=str(REPO / ".venv" / "bin" / "python"))
    (work / "by-flag.yaml").write_text(yaml.safe_dump(data))
    (work / "by-profile.yaml").write_text(yaml.safe_dump({**data, "secrets": [NAME]}))
    env = {NAME: canary, "HPCJOBS_TEST_SECRET_NAME": NAME}
    common = ["--nodes", "2", "--gpus", "1", "--time", "5:00"]
    outputs: list[subprocess.CompletedProcess[str]] = []
    runs: list[tuple[str, Path]] = []
    for flags in (["--profile", str(work / "by-flag.yaml"), "--env", NAME],
                  ["--profile", str(work / "by-profile.yaml")]):
        dry = hpcjobs("submit", *flags, *common, "--dry-run", "secret_hash.py", cwd=work, env=env)
        out = hpcjobs("submit", *flags, *common, "--json", "secret_hash.py", cwd=work, env=env)
        assert out.returncode == 0 and dry.returncode == 0, out.stderr + dry.stderr
        assert f"{NAME} set" in dry.stdout
        rec = json.loads(out.stdout)
        runs.append((rec["job_id"], Path(rec["run_dir"])))
        outputs += [dry, out]
    script = shared_tmp / "job.sbatch"
    out = hpcjobs("render", "--profile", str(work / "by-flag.yaml"), "--env", NAME, *common, "-o", str(script),
                  "secret_hash.py", cwd=work, env=env)
    assert out.returncode == 0, out.stderr
    sb = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd=work,
                        env={**os.environ, **env}, preexec_fn=lambda: os.umask(0o022))
    assert sb.returncode == 0, sb.stderr
    job = sb.stdout.strip().split(";")[0]
    for job_id, run in runs:
        assert wait_for_state(job_id, DONE) == "COMPLETED"
        outputs += [hpcjobs("status", job_id), hpcjobs("status", "--json", job_id)]
        logs = rank_digests(run)
        assert sorted(logs) == ["rank-0.log", "rank-1.log"], logs
        assert all(f"{NAME} sha256 {digest}" in text for text in logs.values()), logs
        assert mode(run) == 0o700 and {mode(p) for p in (run / "logs" / "restart-0").iterdir()} == {0o600}
    assert wait_for_state(job, DONE) == "COMPLETED"
    rendered_run = next((shared_tmp / "runs").glob(f"*-{job}"))
    logs = rank_digests(rendered_run)
    assert len(logs) == 2 and all(f"{NAME} sha256 {digest}" in t for t in logs.values()), logs
    assert mode(rendered_run) == 0o700  # made on the node by the first rank, under sbatch's umask 022
    outputs.append(hpcjobs("list", "--json"))
    assert found_in(canary, [shared_tmp, hpcjobs_home], outputs) == []
    if os.geteuid() == 0 and shutil.which("runuser"):  # another, unprivileged user of the cluster (as CI runs)
        for _, run in [*runs, (job, rendered_run)]:
            assert as_nobody("ls", str(run)) != 0
            assert as_nobody("cat", str(run / "logs" / "restart-0" / "rank-0.log")) != 0
        assert as_nobody("test", "-r", str(hpcjobs_home / "jobs.sqlite")) != 0


@pytest.mark.train
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser"), reason="needs root to act as nobody")
def test_a_tracker_key_reaches_both_nodes_and_a_group_shares_the_run(shared_tmp: Path, hpcjobs_home: Path) -> None:
    """The canary's third way, a tracker's key (WANDB_API_KEY in the profile's secrets): both nodes' ranks get it,
    rank 0's wandb run (offline, into the run folder) writes it nowhere; and with the profile's `group:` another
    user of that group reads the run folder and its logs (without it, the test above: nothing)."""
    pytest.importorskip("wandb")
    canary = uuid.uuid4().hex + uuid.uuid4().hex[:8]  # 40 characters, as W&B's keys
    work = shared_tmp / "work"
    work.mkdir()
    shutil.copy(REPO / "tests" / "scripts" / "tracker_key.py", work / "tracker_key.py")
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data.update(runs_dir=str(shared_tmp / "runs"), python=str(REPO / ".venv" / "bin" / "python"),
                secrets=["WANDB_API_KEY"], group="nogroup")  # nobody's group
    (work / "team.yaml").write_text(yaml.safe_dump(data))
    env = {"WANDB_API_KEY": canary, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = hpcjobs("submit", "--profile", str(work / "team.yaml"), "--nodes", "2", "--gpus", "1", "--time", "5:00",
                  "--json", "tracker_key.py", cwd=work, env=env)
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    run = Path(rec["run_dir"])
    assert wait_for_state(rec["job_id"], DONE) == "COMPLETED"
    digest = hashlib.sha256(canary.encode()).hexdigest()
    logs = rank_digests(run)
    assert len(logs) == 2 and all(f"WANDB_API_KEY sha256 {digest}" in t for t in logs.values()), logs
    assert list(run.rglob("*.wandb")), "the tracker wrote no run"
    assert found_in(canary, [shared_tmp, hpcjobs_home], [out, hpcjobs("status", "--json", rec["job_id"])]) == []
    assert as_nobody("ls", str(run)) == 0 and as_nobody("cat", str(run / "logs" / "restart-0" / "rank-0.log")) == 0
