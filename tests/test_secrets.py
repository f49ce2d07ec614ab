"""Secrets by name, never by value (issue 39, docs/how-to/secrets.md): a canary passed as `--env NAME` or through a
profile's `secrets:` reaches every rank (each prints its sha256: tests/scripts/secret_hash.py) and is found in no file
and no output; a value that looks like a credential is refused before anything is written; run folders and the job
store are the owner's alone, whatever the umask."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, hpcjobs, newest_log

NAME = "HPCJOBS_CANARY_TOKEN"
SCRIPT = REPO / "tests" / "scripts" / "secret_hash.py"


def local_profile(folder: Path, base: str = "local", **keys: object) -> Path:
    data = yaml.safe_load((REPO / "cluster_profiles" / f"{base}.yaml").read_text())
    data.update(runs_dir=str(folder / "runs"), **keys)
    path = folder / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def found_in(canary: str, folders: list[Path], outputs: list[subprocess.CompletedProcess[str]]) -> list[str]:
    """Every file under `folders` and every output that holds the canary's bytes."""
    needle = canary.encode()
    hits = [str(p) for f in folders for p in f.rglob("*") if p.is_file() and needle in p.read_bytes()]
    return hits + [" ".join(map(str, o.args[:3])) for o in outputs if canary in o.stdout + o.stderr]


@pytest.mark.train
@pytest.mark.parametrize("way", ["--env", "secrets"])
def test_a_secret_reaches_every_rank_and_is_written_nowhere(tmp_path: Path, hpcjobs_home: Path, way: str) -> None:
    canary = f"canary-{uuid.uuid4().hex}"
    work = tmp_path / "work"  # outside git: the snapshot copies the folder, the profile with it
    work.mkdir()
    shutil.copy(SCRIPT, work / "secret_hash.py")
    profile = local_profile(work, secrets=[NAME]) if way == "secrets" else local_profile(work)
    flags = ["--profile", str(profile), "--gpus", "2", *(["--env", NAME] if way == "--env" else [])]
    env = {NAME: canary, "HPCJOBS_TEST_SECRET_NAME": NAME}
    dry = hpcjobs("submit", *flags, "--dry-run", "secret_hash.py", cwd=work, env=env)
    dry_json = hpcjobs("submit", *flags, "--dry-run", "--json", "secret_hash.py", cwd=work, env=env)
    assert dry.returncode == 0 and dry_json.returncode == 0, dry.stderr + dry_json.stderr
    assert f"{NAME} set" in dry.stdout and json.loads(dry_json.stdout)["secrets"] == {NAME: "set"}
    out = hpcjobs("submit", *flags, "--json", "secret_hash.py", cwd=work, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    run = Path(job["run_dir"])
    digest = hashlib.sha256(canary.encode()).hexdigest()
    for rank in (0, 1):
        assert f"rank {rank} {NAME} sha256 {digest}" in newest_log(run, rank)
    outputs = [dry, dry_json, out, hpcjobs("status", job["job_id"]), hpcjobs("status", "--json", job["job_id"]),
               hpcjobs("list", "--json")]
    assert all(o.returncode == 0 for o in outputs), [o.stderr for o in outputs]
    doctor = hpcjobs("doctor", *flags, "secret_hash.py", cwd=work, env=env)
    assert re.search(rf"✓ secret {NAME} +set", doctor.stdout), doctor.stdout
    assert found_in(canary, [work, hpcjobs_home], [*outputs, doctor]) == []


def test_render_names_each_secret_and_a_missing_one_stops_the_job_in_one_line(tmp_path: Path) -> None:
    profile = local_profile(tmp_path)
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data.update(runs_dir=str(tmp_path / "runs"), secrets=["HF_TOKEN"])
    profile = tmp_path / "slurm.yaml"
    profile.write_text(yaml.safe_dump(data))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", NAME)}
    out = subprocess.run([str(BIN / "hpcjobs"), "render", "--profile", str(profile), "--env",
                          NAME, "--no-snapshot", "trainers.tasks.lm"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    checks = [ln for ln in out.stdout.splitlines() if ln.startswith(': "${')]
    assert [c.split(":?")[0] for c in checks] == [': "${HF_TOKEN', f': "${{{NAME}']
    ran = subprocess.run(["bash", "-c", "\n".join(checks)], capture_output=True, text=True, env=env)
    assert ran.returncode != 0 and len(ran.stderr.strip().splitlines()) == 1 and "HF_TOKEN" in ran.stderr


def test_a_secret_missing_at_submit_is_one_line_and_nothing_is_written(tmp_path: Path, hpcjobs_home: Path) -> None:
    profile = local_profile(tmp_path, secrets=["HF_TOKEN"])
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    out = subprocess.run([str(BIN / "hpcjobs"), "submit", "--profile", str(profile),
                          "trainers.tasks.lm"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "HF_TOKEN" in out.stderr
    assert not (tmp_path / "runs").exists() and not hpcjobs_home.exists()


REFUSED = [
    (["--env", "WANDB_API_KEY=0123456789abcdef0123456789abcdef01234567"], {}, "WANDB_API_KEY=012…"),
    (["--env", "MY_SETTING=hf_abcdefghijklmnopqrstuvwxyz0123"], {}, "MY_SETTING=hf_…"),
    (["--env", "X=sk-proj-abcdefghijklmnop0123456789"], {}, "X=sk-…"),
    (["--env", "GH=ghp_abcdefghijklmnopqrstuvwxyz0123456789"], {}, "GH=ghp…"),
    (["--env", "AWS_ID=AKIAABCDEFGHIJKLMNOP"], {}, "AWS_ID=AKI…"),
    (["--env", "MLFLOW_TRACKING_PASSWORD=hunter2hunter2"], {}, "MLFLOW_TRACKING_PASSWORD=hun…"),
    (["--env", "AWS_SECRET_ACCESS_KEY=abc"], {}, "AWS_SECRET_ACCESS_KEY=…"),
    ([], {"env": {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz0123"}}, "HF_TOKEN=hf_…"),
    ([], {"env": {"GOOGLE_APPLICATION_CREDENTIALS": "/home/me/creds.json"}}, "GOOGLE_APPLICATION_CREDENTIALS=/ho…"),
]


@pytest.mark.parametrize(("flags", "keys", "masked"), REFUSED)
@pytest.mark.parametrize("command", ["submit", "render"])
def test_a_credential_value_is_refused_in_one_line_before_anything_is_written(
        tmp_path: Path, hpcjobs_home: Path, flags: list[str], keys: dict[str, object], masked: str,
        command: str) -> None:
    profile = local_profile(tmp_path, "testcluster" if command == "render" else "local", **keys)
    value = (flags[1] if flags else next(iter(keys["env"].values()))).split("=", 1)[-1]  # type: ignore[attr-defined]
    extra = ["-o", str(tmp_path / "job.sh")] if command == "render" else []
    out = hpcjobs(command, "--profile", str(profile), *flags, *extra, "trainers.tasks.lm", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == "", out.stderr
    assert masked in out.stderr and "--env NAME" in out.stderr and value not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"] and not hpcjobs_home.exists()


def test_the_escape_hatch_and_ordinary_settings_pass(tmp_path: Path) -> None:
    profile = local_profile(tmp_path, env={"OMP_NUM_THREADS": "1", "NCCL_DEBUG": "WARN"})
    ordinary = ["--env", "HPCJOBS_STOP_CHECK_EVERY=3", "--env", "HPCJOBS_HOOKS=0", "--env", "TOKENIZERS_PARALLELISM=0",
                "--env", "WANDB_MODE=offline", "--env", "NCCL_SOCKET_IFNAME=lo"]
    out = hpcjobs("submit", "--profile", str(profile), *ordinary, "--dry-run", "trainers.tasks.lm", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    out = hpcjobs("submit", "--profile", str(profile), "--env", "HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123",
                  "--allow-secret-values", "--dry-run", "trainers.tasks.lm", cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_a_secret_name_hpcjobs_sets_per_rank_is_refused(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", str(local_profile(tmp_path)), "--env", "RANK", "--dry-run",
                  "trainers.tasks.lm", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "RANK" in out.stderr


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def under_umask_022(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "hpcjobs"), *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, preexec_fn=lambda: os.umask(0o022), timeout=300)


@pytest.mark.train
def test_run_folder_snapshot_and_store_are_the_owners_alone_under_umask_022(tmp_path: Path,
                                                                             hpcjobs_home: Path) -> None:
    work = tmp_path / "work"  # outside git
    work.mkdir()
    shutil.copy(SCRIPT, work / "secret_hash.py")
    for name in (".env", "id_rsa", "server.pem", ".netrc"):
        (work / name).write_text("not for the snapshot\n")
    (work / ".aws").mkdir()
    (work / ".aws" / "credentials").write_text("[default]\n")
    out = under_umask_022("submit", "--profile", str(local_profile(work)), "--gpus", "2", "--json", "secret_hash.py",
                          cwd=work)
    assert out.returncode == 0, out.stderr
    assert "leaves out what commonly holds credentials: .aws/, .env, .netrc, id_rsa, server.pem" in out.stderr
    run = Path(json.loads(out.stdout)["run_dir"])
    snapshot = next((work / "runs" / ".snapshots").iterdir())
    assert sorted(p.name for p in snapshot.iterdir()) == [".hpcjobs-snapshot.json", "p.yaml", "secret_hash.py"]
    assert {mode(p) for p in (work / "runs", run, run / "logs", snapshot.parent, snapshot, hpcjobs_home)} == {0o700}
    assert mode(hpcjobs_home / "jobs.sqlite") == 0o600
    assert mode(run / "spec.json") == 0o600
    assert all(mode(p) & 0o077 == 0 for p in (run / "logs").rglob("*.log"))
    doctor = under_umask_022("doctor", "--profile", str(local_profile(work)), "--gpus", "2", cwd=work)
    assert "run folders private" not in doctor.stdout, doctor.stdout
    (work / "runs" / "lm-old").mkdir(mode=0o755)
    (work / "runs" / "lm-old").chmod(0o755)
    doctor = under_umask_022("doctor", "--profile", str(local_profile(work)), "--gpus", "2", cwd=work)
    assert "run folders private" in doctor.stdout and "lm-old" in doctor.stdout, doctor.stdout


@pytest.mark.train
def test_a_group_makes_the_run_folder_the_groups_too(tmp_path: Path, hpcjobs_home: Path) -> None:
    import grp

    group = grp.getgrgid(([g for g in os.getgroups() if g != os.getgid()] or [os.getgid()])[0])
    profile = local_profile(tmp_path, group=group.gr_name)
    out = under_umask_022("submit", "--profile", str(profile), "--json", "trainers.tasks.lm", "--size", "tiny",
                          "--steps", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    run = Path(json.loads(out.stdout)["run_dir"])
    assert mode(run) == 0o2750 and run.stat().st_gid == group.gr_gid
    assert mode(run / "spec.json") == 0o640 and mode(hpcjobs_home / "jobs.sqlite") == 0o600
    bad = under_umask_022("submit", "--profile", str(local_profile(tmp_path, group="no-such-group-39")),
                          "trainers.tasks.lm", cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no-such-group-39" in bad.stderr


def test_a_chain_step_with_a_missing_secret_queues_no_step(tmp_path: Path, hpcjobs_home: Path) -> None:
    profile = local_profile(tmp_path)
    (tmp_path / "chain.yaml").write_text(yaml.safe_dump({
        "first": {"submit": f"--profile {profile} trainers.tasks.lm --size tiny --steps 1"},
        "second": {"after": "first", "submit": f"--profile {profile} --env HPCJOBS_UNSET_39 trainers.tasks.lm"}}))
    out = hpcjobs("submit", "--chain", "chain.yaml", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "HPCJOBS_UNSET_39" in out.stderr and not (tmp_path / "runs").exists()


def as_nobody(*argv: str) -> int:
    """The exit code of `argv` run as the unprivileged user nobody (group nogroup)."""
    return subprocess.run(["runuser", "-u", "nobody", "--", *argv], capture_output=True).returncode


@pytest.mark.train
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser"), reason="needs root to act as nobody")
@pytest.mark.parametrize("group", [None, "nogroup"])
def test_another_user_reads_nothing_unless_the_profile_names_a_group_they_share(shared_tmp: Path,
                                                                                 group: str | None) -> None:
    home = shared_tmp / "store"
    profile = local_profile(shared_tmp, **({"group": group} if group else {}))
    out = under_umask_022("submit", "--profile", str(profile), "--json", "trainers.tasks.lm", "--size", "tiny",
                          "--steps", "1", cwd=shared_tmp, env={"HPCJOBS_HOME": str(home)})
    assert out.returncode == 0, out.stderr
    run = Path(json.loads(out.stdout)["run_dir"])
    assert as_nobody("test", "-r", str(home / "jobs.sqlite")) != 0  # the store is its owner's alone, group or not
    reads = [as_nobody("ls", str(run)), as_nobody("cat", str(run / "spec.json")),
             as_nobody("ls", str(next((shared_tmp / "runs" / ".snapshots").iterdir())))]
    assert reads == ([0, 0, 0] if group else [2, 1, 2]), reads


@pytest.mark.train
def test_a_tracker_key_reaches_every_rank_and_the_tracker_writes_it_nowhere(tmp_path: Path,
                                                                           hpcjobs_home: Path) -> None:
    """The third way of issue 39's canary: a tracker's key in the profile's `secrets:`; rank 0 runs a wandb run
    (offline, into the run folder) with it, and neither hpcjobs nor the tracker's own files hold the key."""
    pytest.importorskip("wandb")
    canary = uuid.uuid4().hex + uuid.uuid4().hex[:8]  # 40 characters, as W&B's keys
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "tests" / "scripts" / "tracker_key.py", work / "tracker_key.py")
    profile = local_profile(work, secrets=["WANDB_API_KEY"])
    env = {"WANDB_API_KEY": canary, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    out = hpcjobs("submit", "--profile", str(profile), "--gpus", "2", "--json", "tracker_key.py", cwd=work, env=env,
                  timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = Path(json.loads(out.stdout)["run_dir"])
    digest = hashlib.sha256(canary.encode()).hexdigest()
    assert all(f"rank {r} WANDB_API_KEY sha256 {digest}" in newest_log(run, r) for r in (0, 1))
    assert list(run.rglob("*.wandb")), sorted(str(p) for p in run.rglob("*"))[:20]  # the tracker wrote its run
    assert found_in(canary, [work, hpcjobs_home], [out, hpcjobs("status", "--json")]) == []
