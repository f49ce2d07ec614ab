"""Sweeps (job arrays) and code snapshots without a cluster: parsing, bad inputs, the rendered array script, the
local backend's sweep, and what a snapshot holds. The real-cluster half is tests/cluster/test_sweep_cluster.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.jobs.store import JobRecord, JobStore
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.points import point_of
from hpcjobs.request.snapshot import MANIFEST, MAX_BYTES, PLAIN_FILE_MAX, materialize, plan
from hpcjobs.request.sweep import build_points, read_sweep_file
from test_bad_inputs import assert_refused, sbatch_log  # noqa: F401 - the fixture is used by name

TASK = ["trainers.tasks.classifier", "--steps", "6", "--log-every", "2", "--ckpt-every", "3"]


def test_grid_is_the_product_with_the_first_flag_outermost() -> None:
    points = build_points(["lr=1e-3,3e-4", "seed=1,2,3"], None, [])
    assert [dict(p) for p in points] == [{"lr": lr, "seed": s} for lr in ("1e-3", "3e-4") for s in ("1", "2", "3")]


def test_sweep_file_grid_then_points(tmp_path: Path) -> None:
    f = tmp_path / "sweep.yaml"
    f.write_text("grid: {lr: [0.001, 0.0003]}\npoints:\n  - {lr: 0.01, seed: 7}\n  - {batch-size: 16}\n")
    assert [dict(p) for p in read_sweep_file(f)] == [{"lr": "0.001"}, {"lr": "0.0003"}, {"lr": "0.01", "seed": "7"},
                                                     {"batch-size": "16"}]


def test_the_node_picks_its_point_by_the_array_index() -> None:
    points = build_points(["seed=1,2,3"], None, [])
    assert point_of(points, {"SLURM_ARRAY_TASK_ID": "2"}) == (("seed", "3"),)
    assert point_of(points, {"HPCJOBS_ARRAY_TASK_ID": "0"}) == (("seed", "1"),)
    assert point_of((), {}) is None
    for env in ({}, {"SLURM_ARRAY_TASK_ID": "3"}):
        with pytest.raises(ValueError, match="sweep of 3 points"):
            point_of(points, env)


BAD_SWEEPS = [
    (["--sweep", "lr"], "is not KEY=V1,V2"),
    (["--sweep", "lr="], "lr has no values"),
    (["--sweep", "lr=1,,2"], "is not a single non-empty value"),
    (["--sweep", "lr=1,1"], "lr repeats 1"),
    (["--sweep", "lr=1,2", "--sweep", "lr=3"], "lr swept twice"),
    (["--sweep", "l r=1"], "is not a flag name"),
    (["--sweep", "steps=1,2"], "--steps is both swept and given to the entry"),
    (["--sweep", "lr=-1,2"], "not starting with '-'"),
    (["--max-parallel", "0", "--sweep", "lr=1,2"], "--max-parallel 0: valid: 1 or more"),
    (["--max-parallel", "2"], "without a sweep of two or more points"),
    (["--sweep", "lr=1,2", "--run-dir", "/tmp/one-folder"], "valid: a pattern with %a"),
    (["--sweep", "lr=1,2", "--run-dir", "/tmp/x-%j-%a"], "without %j"),
    (["--sweep", "seed=1.5,2"], "trainer flag --seed"),  # each point checked as the node would check it
    (["--sweep", "lr=1,2", "--sweep-file", "x.yaml"], "--sweep and --sweep-file together"),
    (["--sweep-file", "/nonexistent/sweep.yaml"], "cannot be read"),
]


@pytest.mark.train
@pytest.mark.parametrize("flags,fragment", BAD_SWEEPS, ids=[f"sweep-{i}" for i in range(len(BAD_SWEEPS))])
@pytest.mark.parametrize("command", ["submit", "render"])
def test_bad_sweep_is_refused(command: str, flags: list[str], fragment: str, sbatch_log: Path,  # noqa: F811
                              hpcjobs_home: Path) -> None:
    out = hpcjobs(command, "--profile", "testcluster", "--gpus", "1", *flags, *TASK, cwd=REPO)
    assert_refused(out, fragment, sbatch_log)
    assert not hpcjobs_home.exists() or JobStore().recent() == []


BAD_FILES = [
    ("grid: {lr: [1, 2]}\nseeds: [1]\n", "unknown key(s) seeds"),
    ("- lr: 1\n", "not a mapping of grid and/or points"),
    ("grid: {lr: []}\n", "lr has no values"),
    ("points: []\n", "points must be a non-empty list"),
    ("points: [{lr: [1, 2]}]\n", "is not a single non-empty value"),
    ("points: [{lr: 1}, {lr: 1}]\n", "point 1 (lr=1) is the same as point 0"),
    ("grid: {lr: [1, 2]\n", "is not valid YAML"),
    # read as a profile is (hpcjobs.profiles.yamlfile): each was a traceback, or a silent pick, before
    ("grid: {lr: [1]}\ngrid: {lr: [2]}\n", "key 'grid' is given twice (line 1 and line 2)"),
    ('grid: {lr: ["1\\0x"]}\n', "line 1 holds a NUL character"),
    ("grid: {lr: [" + "[" * 20000 + "]" * 20000 + "]}\n", "nests too deeply to be a sweep file"),
    (b"grid: {lr: ['\xff']}\n", "is not UTF-8 text (byte 0xff at offset 13)"),
]


@pytest.mark.parametrize("text,fragment", BAD_FILES, ids=[f"file-{i}" for i in range(len(BAD_FILES))])
def test_bad_sweep_file_is_refused(text: str | bytes, fragment: str, tmp_path: Path, sbatch_log: Path,  # noqa: F811
                                   hpcjobs_home: Path) -> None:
    f = tmp_path / "sweep.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = hpcjobs("submit", "--profile", "testcluster", "--gpus", "1", "--sweep-file", str(f), *TASK, cwd=REPO)
    assert_refused(out, fragment, sbatch_log)


def test_dry_run_lists_the_points_and_a_single_point_is_a_plain_job(tmp_path: Path, hpcjobs_home: Path) -> None:
    out = hpcjobs("submit", "--profile", "testcluster", "--gpus", "1", "--dry-run", "--sweep", "lr=0.1,0.2",
                  "--sweep", "seed=1,2", "--max-parallel", "3", *TASK, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "4 points, one array task each, at most 3 at once" in out.stdout
    assert "task 3: --lr 0.2 --seed 2" in out.stdout
    assert "#SBATCH --array=0-3%3" in out.stdout
    one = hpcjobs("submit", "--profile", "testcluster", "--gpus", "1", "--dry-run", "--json", "--sweep", "lr=0.1",
                  *TASK, cwd=REPO)
    data = json.loads(one.stdout)
    assert "--array" not in data["request"] and data["spec"]["entry"]["args"][-2:] == ["--lr", "0.1"]
    assert data["spec"]["point"] == {"lr": "0.1"}


def test_rendered_array_script(tmp_path: Path, hpcjobs_home: Path) -> None:
    out = hpcjobs("render", "--profile", "testcluster", "--gpus", "1", "--no-snapshot", "--sweep", "seed=1,2,3",
                  *TASK, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --array=0-2\n" in out.stdout
    assert "-%A_%a.out" in out.stdout  # Slurm's own log per task
    assert '"points":[[["seed","1"]],[["seed","2"]],[["seed","3"]]]' in out.stdout
    assert "%A_%a" in out.stdout.split('"run_dir":"', 1)[1].split('"', 1)[0]


@pytest.mark.train
def test_local_sweep_runs_each_point_in_its_own_run_folder(tmp_path: Path, hpcjobs_home: Path) -> None:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(tmp_path / "s-%A_%a"), "--json",
                  "--sweep", "seed=1,2,3", "--max-parallel", "2", *TASK, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    sub = json.loads(out.stdout)
    tasks = sub["tasks"]
    assert [t["job_id"] for t in tasks] == [f"{sub['job_id']}_{i}" for i in range(3)]
    for i, task in enumerate(tasks):
        run = Path(task["run_dir"])
        assert run.name == f"s-{sub['job_id']}_{i}"
        assert json.loads((run / "spec.json").read_text())["point"] == {"seed": str(i + 1)}
        starts = [json.loads(ln) for ln in (run / "restarts.jsonl").read_text().splitlines()]
        assert starts[0]["point"] == {"seed": str(i + 1)}
        assert json.loads((run / "final.json").read_text())["state"] == "finished"
    losses = [(Path(t["run_dir"]) / "metrics.jsonl").read_text() for t in tasks]
    assert len(set(losses)) == 3  # each seed trained its own way
    status = hpcjobs("status", sub["job_id"])
    assert status.returncode == 0, status.stderr
    assert "3 tasks: 3 COMPLETED" in status.stdout and "seed=2" in status.stdout
    goodput = json.loads(hpcjobs("goodput", sub["job_id"], "--json").stdout)  # per task, and the sweep's total
    assert [j["job_id"] for j in goodput["jobs"]] == [t["job_id"] for t in tasks]
    total = goodput["total"]
    # --json rounds each of the 8 buckets and the wall to 1 ms: their sum may be off by up to 4.5 ms
    assert abs(sum(total["buckets_s"].values()) - total["wall_s"]) < 5e-3 and 0 < total["ettr"] < 1, total
    logs = hpcjobs("logs", sub["job_id"])
    assert logs.returncode == 2 and f"valid: one task, {sub['job_id']}_0" in logs.stderr
    assert hpcjobs("logs", f"{sub['job_id']}_1").returncode == 0


def test_store_finds_an_arrays_tasks_and_nothing_else(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    for job_id in ("7_1", "7_0", "7_10", "77_0", "7", "7_x", "17_2"):
        store.add(JobRecord(job_id, "n", "p", "slurm", 1, 1, "/r", {}, {}, 0.0))
    assert [r.job_id for r in store.tasks("7")] == ["7_0", "7_1", "7_10"]
    assert store.tasks("%") == [] and store.tasks("7_") == []


# --- snapshots ------------------------------------------------------------------------------------------------------

def git_project(path: Path) -> Path:
    path.mkdir()
    (path / "train.py").write_text("VERSION = 'A'\n")
    (path / ".gitignore").write_text("data/\n")
    (path / "data").mkdir()
    (path / "data" / "big.bin").write_bytes(b"x" * 1000)
    for argv in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a"]):
        subprocess.run(["git", *argv], cwd=path, check=True)
    return path


def test_snapshot_holds_the_tree_as_it_is_and_is_shared(tmp_path: Path) -> None:
    project = git_project(tmp_path / "proj")
    (project / "train.py").write_text("VERSION = 'B'\n")  # an edit not committed
    (project / "new.py").write_text("x = 1\n")  # untracked, not ignored
    snap = plan(project, tmp_path / "runs")
    assert set(snap.files) == {".gitignore", "train.py", "new.py"}  # ignored data/ left out
    assert snap.git_dirty and "+VERSION = 'B'" in snap.git_diff and snap.untracked == ("new.py",)
    assert snap.git_commit and len(snap.git_commit) == 40
    folder = materialize(snap)
    assert (folder / "train.py").read_text() == "VERSION = 'B'\n" and (folder / MANIFEST).is_file()
    (project / "train.py").write_text("VERSION = 'C'\n")  # edited after: the copy keeps what was submitted
    assert (folder / "train.py").read_text() == "VERSION = 'B'\n"
    assert plan(project, tmp_path / "runs").digest != snap.digest
    (project / "train.py").write_text("VERSION = 'B'\n")
    again = plan(project, tmp_path / "runs")
    assert again.digest == snap.digest and materialize(again) == folder  # same tree, one copy
    assert len(list((tmp_path / "runs" / ".snapshots").iterdir())) == 1


def test_snapshot_outside_git_copies_the_folder_without_caches(tmp_path: Path) -> None:
    project = tmp_path / "plain"
    (project / "__pycache__").mkdir(parents=True)
    (project / "__pycache__" / "x.pyc").write_bytes(b"0")
    (project / ".venv").mkdir()
    (project / ".venv" / "python").write_text("")
    (project / "train.py").write_text("print(1)\n")
    (project / "runs").mkdir()
    (project / "runs" / "old.pt").write_bytes(b"0" * 10)
    snap = plan(project, project / "runs")
    assert snap.files == ("train.py",) and snap.git_commit is None


def test_snapshot_outside_git_never_copies_earlier_outputs(tmp_path: Path) -> None:
    """Issue 25: outside git the snapshots grew by every earlier run's outputs (501 MB after two runs of a Trainer
    script). Whatever wrote them: Hugging Face, Lightning, Hydra, a script's own checkpoints, an hpcjobs run."""
    project = tmp_path / "plain"
    outputs = ["out/trainer_state.json", "out/model.safetensors", "checkpoint-10/optimizer.pt",
               "lightning_logs/version_0/checkpoints/epoch=0.ckpt", "outputs/2026-11-25/10-00-00/.hydra/config.yaml",
               "outputs/2026-11-25/10-00-00/model.pt", "runs/own-script/checkpoints/step-00000010/shared.pt",
               "old-run/spec.json", "old-run/specs/0.json"]
    code = ["train.py", "checkpoints/__init__.py", "checkpoints/io.py", "conf/config.yaml", "outputs/README.md"]
    for rel in [*outputs, *code]:
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text("x\n")
    snap = plan(project, tmp_path / "runs")
    assert sorted(snap.files) == sorted(code)


def test_snapshot_outside_git_leaves_out_weights_and_large_files_and_says_so(tmp_path: Path,
                                                                              hpcjobs_home: Path) -> None:
    """Issue 38: outside git a 210 MiB out/model.pt beside the script made the next submit fail (over the snapshot's
    limit) with a .gitignore hint that does not apply there. Weights by name and any file over the per-file limit
    are left out, and the submit says which; a small data file the script may read by a relative path stays."""
    project = tmp_path / "plain"
    (project / "out").mkdir(parents=True)
    (project / "train.py").write_text("print('trained')\n")
    (project / "vocab.json").write_text("{}\n")
    (project / "out" / "model.pt").write_bytes(b"0" * 1024)
    with open(project / "corpus.txt", "wb") as f:
        f.truncate(PLAIN_FILE_MAX + 1)  # sparse: the size is what counts
    snap = plan(project, tmp_path / "runs")
    assert snap.files == ("train.py", "vocab.json"), snap.files
    assert [d.split(" (")[0] for d in snap.data] == ["corpus.txt", "out/model.pt"]
    out = hpcjobs("submit", "--profile", "local", "--run-dir", str(tmp_path / "run"), "train.py", cwd=project)
    assert out.returncode == 0 and "trained" in out.stdout + out.stderr, out.stderr
    assert "leaves out data and weights (weights, or files over 8 MiB): corpus.txt (8.0 MiB), out/model.pt (0.0 MiB)" \
        in out.stderr


def test_snapshot_over_the_size_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "plain"
    project.mkdir()
    (project / "corpus.dat").write_bytes(b"0" * 4096)
    monkeypatch.setattr("hpcjobs.request.snapshot.MAX_BYTES", 1024)
    with pytest.raises(UsageError, match=r"largest: corpus.dat") as refused:
        plan(project, tmp_path / "runs")
    assert "--no-snapshot" in refused.value.one_line()
    assert ".gitignore" not in refused.value.one_line().split("--no-snapshot")[0]  # outside git: advice that applies
    for i in range(3):
        (project / "data" / f"part{i}").mkdir(parents=True)
        (project / "data" / f"part{i}" / "shard.arrow").write_bytes(b"0" * 3000)
    with pytest.raises(UsageError) as refused:  # the folder that holds the bytes is named, not only a file in it
        plan(project, tmp_path / "runs")
    assert "(largest: data/ (0 MiB), corpus.dat (0 MiB); largest file corpus.dat (0 MiB))" in str(refused.value)
    assert MAX_BYTES >= 100 * 2**20


TRAIN_FROM = """import os, sys
from pathlib import Path
import helper
print('VERSION', helper.VERSION, 'from', os.path.dirname(helper.__file__), 'in', os.getcwd())
Path(sys.argv[1]).mkdir(exist_ok=True)
(Path(sys.argv[1]) / 'result.txt').write_text('written')
"""


def test_a_job_runs_the_snapshot_not_the_working_tree(tmp_path: Path, hpcjobs_home: Path) -> None:
    """The code is the snapshot's; the script runs where it was submitted from, so a relative output path lands
    there, never inside the snapshot (issue 25: a Trainer's `--output_dir out` did, unsaid)."""
    project = git_project(tmp_path / "proj")
    (project / "sub").mkdir()
    (project / "sub" / "train.py").write_text(TRAIN_FROM)
    (project / "sub" / "helper.py").write_text("VERSION = 'A'\n")
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--json", "--run-dir", str(tmp_path / "run"),
                  "train.py", "out", cwd=project / "sub")
    assert out.returncode == 0, out.stderr
    log = (tmp_path / "run" / "logs" / "restart-0" / "rank-0.log").read_text()
    spec = json.loads((tmp_path / "run" / "spec.json").read_text())
    snap = spec["snapshot"]["folder"]
    assert f"VERSION A from {snap}/sub in {project / 'sub'}" in log
    assert (project / "sub" / "out" / "result.txt").read_text() == "written"
    assert not (Path(snap) / "sub" / "out").exists()
    assert spec["workdir"] == snap + "/sub" and spec["snapshot"]["git_dirty"]
    assert spec["entry"]["target"] == snap + "/sub/train.py"
    plain = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--json", "--no-snapshot", "--run-dir",
                    str(tmp_path / "run2"), "train.py", "out2", cwd=project / "sub")
    assert plain.returncode == 0, plain.stderr
    assert f"VERSION A from {project / 'sub'} in {project / 'sub'}" in (
        tmp_path / "run2" / "logs" / "restart-0" / "rank-0.log").read_text()
    assert (project / "sub" / "out2" / "result.txt").is_file()


def test_the_submit_folder_reaches_a_scripts_ranks_only_with_a_snapshot() -> None:
    from types import SimpleNamespace
    from typing import Any

    from hpcjobs.profiles.cluster_profile import load_profile
    from hpcjobs.request.render import launch_contract
    from hpcjobs.request.snapshot import Snapshot

    snap = Snapshot(source="/home/u/proj", files=(), digest="d", folder="/runs/.snapshots/d")

    def contract(kind: str, snapshot: Snapshot | None = snap, workdir: str = "/runs/.snapshots/d/sub") -> Any:
        profile = load_profile("local")
        spec: Any = SimpleNamespace(run_dir="r", profile=profile, recovery=profile.recovery, time_seconds=0, points=(),
                                    array=False, snapshot=snapshot, workdir=workdir, entry=SimpleNamespace(kind=kind))
        return launch_contract(spec)

    assert contract("script").submit_dir == contract("module").submit_dir == "/home/u/proj/sub"
    assert contract("task").submit_dir == ""  # the shared trainer runs where it did
    none = contract("script", None, "/home/u/proj/sub")
    assert none.submit_dir == "" and "submit_dir" not in none.to_json()  # the contract reads as before


@pytest.mark.train
def test_ctrl_c_stops_a_local_sweep_at_a_checkpoint_and_starts_no_more(tmp_path: Path, hpcjobs_home: Path) -> None:
    import os
    import signal
    import time

    from conftest import BIN

    args = ["submit", "--profile", "local", "--gpus", "1", "--json", "--run-dir", str(tmp_path / "s-%A_%a"),
            "--sweep", "seed=1,2,3", "trainers.tasks.lm", "--size", "tiny", "--steps", "100000", "--log-every", "5",
            "--ckpt-every", "0"]
    proc = subprocess.Popen([str(BIN / "hpcjobs"), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=os.environ.copy())
    deadline = time.time() + 120
    while not list(tmp_path.glob("s-*_0/heartbeat.json")):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    tasks = json.loads(out)["tasks"]
    assert [t["returncode"] for t in tasks] == [130, 130, 130]  # stopped at a checkpoint, or never started
    first, *rest = (Path(t["run_dir"]) for t in tasks)
    stop = [json.loads(x) for x in (first / "restarts.jsonl").read_text().splitlines() if "stopped" in x][-1]
    assert stop["stopped"] == "interrupt" and (first / "checkpoints" / f"step-{stop['step']}" / "FINISHED").exists()
    assert all(not (r / "logs").exists() for r in rest)  # never started
