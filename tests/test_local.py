"""The `local` profile: the README's main job on this machine, and Ctrl-C stopping at a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import BIN, hpcjobs
from hpcjobs.backends.local.ranks import rank_preexec
from trainers import checkpoint


def test_each_local_rank_runs_in_a_session_of_its_own() -> None:
    """Not only a process group: where the kernel shares CPU time by session (sched_autogroup), ranks in the
    shell's session trained measurably slower than torchrun's (rank_preexec says how much)."""
    asks = "import os; print(os.getsid(0) == os.getpid(), os.getpgid(0) == os.getpid(), os.getsid(0))"
    out = subprocess.run([sys.executable, "-c", asks], preexec_fn=rank_preexec, capture_output=True, text=True,
                         check=True)
    leads_session, leads_group, sid = out.stdout.split()
    assert (leads_session, leads_group) == ("True", "True") and int(sid) != os.getsid(0)


@pytest.mark.train
def test_main_job_trains_checkpoints_and_reports_where(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "trainers.tasks.lm", "--size", "tiny", "--steps",
                  "30", "--log-every", "10", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    run = next((tmp_path / "runs").glob("lm-*"))
    assert checkpoint.latest(run / "checkpoints").step == 30
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10, 20, 30]
    assert f"checkpoints in {run / 'checkpoints'}" in out.stdout + out.stderr
    rows = json.loads(hpcjobs("list", "--json").stdout)
    assert rows[0]["state"] == "COMPLETED" and rows[0]["state_source"] == "run folder"
    # Each rank's start-up line (bench/startup.py's input): the marks in order, each with the CPU used by then.
    lines = sorted((json.loads(x) for x in (run / "startup.jsonl").read_text().splitlines()), key=lambda r: r["rank"])
    marks = ("imported", "joined", "ready", "first_step")
    assert [r["rank"] for r in lines] == [0, 1]
    for r in lines:
        assert [r[m] for m in ("launched", *marks)] == sorted(r[m] for m in ("launched", *marks)), r
        assert 0 < r["cpu_at"]["imported"] <= r["cpu_at"]["first_step"] <= r["cpu_s"], r
        assert [r["cpu_at"][m] for m in marks] == sorted(r["cpu_at"][m] for m in marks), r


@pytest.mark.train
def test_evaluation_keeps_the_best_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), "trainers.tasks.classifier",
                  "--steps", "40", "--log-every", "5", "--eval-every", "5", "--ckpt-every", "5", "--keep-best",
                  "--lr", "0.05", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    evals = {r["step"]: r["val_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "val_loss" in r}
    assert sorted(evals) == [5, 10, 15, 20, 25, 30, 35, 40]
    best = checkpoint.read_best(run / "checkpoints")
    assert best["step"] == min(evals, key=evals.get) and best["value"] == evals[best["step"]]
    kept = [r.step for r in checkpoint.finished(run / "checkpoints")]
    assert best["step"] in kept and kept[-2:] == [35, 40] and len(kept) <= 3, kept
    assert "val_loss" in out.stdout + out.stderr
    # A run folder stands for its job where an id goes (issue 26), whatever the job store knows.
    elsewhere = {"HPCJOBS_HOME": str(tmp_path / "another-home")}
    st = hpcjobs("status", str(run), "--json", env=elsewhere)
    assert st.returncode == 0 and json.loads(st.stdout)["state"] == "COMPLETED", st.stdout + st.stderr
    assert "step 40 " in hpcjobs("logs", str(run), env=elsewhere).stdout


@pytest.mark.train
def test_task_without_a_validation_set_refuses_eval_every(tmp_path: Path) -> None:
    own = tmp_path / "notask.py"
    own.write_text("import torch\nfrom torch.utils.data import TensorDataset\nfrom trainers.task import Task\n"
                   "task = Task(name='n', model=lambda: torch.nn.Linear(2, 1), train_data=lambda: TensorDataset("
                   "torch.zeros(8, 2)), loss=lambda m, b: m(b[0]).sum())\n")
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(tmp_path / "run"), "notask",
                  "--eval-every", "5", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, timeout=300)
    assert out.returncode != 0
    assert "has no validation set; valid: --eval-every 0" in (out.stdout + out.stderr + "".join(
        p.read_text() for p in (tmp_path / "run" / "logs").rglob("rank-0.log")))


@pytest.mark.train
def test_ctrl_c_stops_every_rank_at_a_checkpoint_and_the_next_run_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), "trainers.tasks.lm", "--size",
            "tiny", "--steps", "100000", "--log-every", "5", "--ckpt-every", "0"]
    proc = subprocess.Popen([str(BIN / "hpcjobs"), *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    deadline = time.time() + 120
    while not (run / "heartbeat.json").exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out  # as an interrupted command: `hpcjobs submit ... && next` stops there
    assert out.strip().splitlines()[-1].startswith("Job local-") and "ended with code 130; run folder" in out
    stop = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines() if "stopped" in x][-1]
    # The local launcher passes Ctrl-C on to the ranks as it came, and the run folder says so (it said SIGUSR2).
    assert stop["stopped"] == "interrupt" and stop["signal"] == "SIGINT"
    assert checkpoint.latest(run / "checkpoints").step == stop["step"]
    # The losses of the steps since the last logged one are logged at the stop (the resume starts after them).
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["step"] == stop["step"] and json.loads((run / "heartbeat.json").read_text())["step"] == \
        stop["step"], (logged[-3:], stop)
    assert not (run / "final.json").exists()
    assert json.loads(hpcjobs("status", "--json").stdout)["state"] == "STOPPED"
    # Fewer steps than planned: a changed --steps re-plans the LR schedule, so it takes --extend (issue 10).
    again = hpcjobs(*[a if a != "100000" else str(stop["step"] + 5) for a in args], "--extend", cwd=tmp_path,
                    timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"(step {stop['step']}," in (run / "logs" / "restart-1" / "rank-0.log").read_text()  # its own logs


@pytest.mark.train
def test_same_trainer_under_torchrun_and_as_a_plain_process(tmp_path: Path) -> None:
    base = ["trainers.tasks.classifier", "--steps", "6", "--log-every", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, cmd in (("torchrun", [str(BIN / "torchrun"), "--nproc_per_node", "2", "-m", "trainers"]),
                      ("plain", [str(BIN / "python"), "-m", "trainers"])):
        run = tmp_path / name
        out = subprocess.run([*cmd, *base, "--run-dir", str(run)], capture_output=True, text=True, env=env,
                             cwd=tmp_path, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        log = (run / "logs" / "restart-0" / "rank-0.log").read_text()
        ranks = "2 rank(s)" if name == "torchrun" else "1 rank(s)"
        assert ranks in log and "finished at step 6" in log
        assert checkpoint.latest(run / "checkpoints").step == 6


@pytest.mark.train
def test_rendezvous_timeout_names_the_rank_and_address(tmp_path: Path) -> None:
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once closed
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "HPCJOBS_INIT_TIMEOUT": "3"}
    t = time.time()
    out = subprocess.run([str(BIN / "python"), "-m", "trainers.launch", "--run-dir", str(tmp_path / "r"), "--",
                          "trainers.tasks.classifier"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1
    assert f"rank 1/2 could not join the rendezvous at 127.0.0.1:{port} within 3 s" in out.stdout + out.stderr
    assert time.time() - t < 60
    final = json.loads((tmp_path / "r" / "final.json").read_text())
    assert final["state"] == "failed" and "RendezvousError" in final["reason"]


@pytest.mark.train
def test_a_refused_second_job_leaves_the_running_ones_records_alone(tmp_path: Path) -> None:
    """Issue 26: a second `submit --run-dir` on a folder a job trains in was refused only by its rank 0, after it
    had rewritten local-process.json (its own, soon dead, pid), spec.json and specs/: the running job then read
    UNKNOWN and `hpcjobs cancel` said there was nothing to cancel."""
    run = tmp_path / "run"
    args = ["submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run), "trainers.tasks.classifier",
            "--steps", "100000", "--log-every", "5", "--ckpt-every", "0"]
    first = subprocess.Popen([str(BIN / "hpcjobs"), *args], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    deadline = time.time() + 120
    while not (run / "heartbeat.json").exists():
        assert time.time() < deadline and first.poll() is None
        time.sleep(0.2)
    records = {p.relative_to(run): p.read_bytes() for p in (run / "local-process.json", run / "spec.json")}
    specs = sorted(p.name for p in (run / "specs").iterdir())
    second = hpcjobs(*args, "--lr", "0.5", cwd=tmp_path)
    assert second.returncode == 2 and "is in use by job local-" in second.stderr, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1, second.stderr
    assert {p: (run / p).read_bytes() for p in records} == records
    assert sorted(p.name for p in (run / "specs").iterdir()) == specs
    rows = json.loads(hpcjobs("list", "--json").stdout)
    assert [r["state"] for r in rows] == ["RUNNING"], rows
    cancelled = hpcjobs("cancel", rows[0]["job_id"])
    assert cancelled.returncode == 0 and "asked to stop" in cancelled.stdout, cancelled.stdout + cancelled.stderr
    first.communicate(timeout=120)


@pytest.mark.train
def test_a_refused_resume_ends_with_its_own_words_not_the_last_jobs(tmp_path: Path) -> None:
    """Issue 26: after a resume refused for other settings, the end line said "ended with code 2: reached step 6",
    the finished job's final.json."""
    run = tmp_path / "run"
    args = ["submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run), "trainers.tasks.classifier",
            "--steps", "6", "--log-every", "3"]
    assert hpcjobs(*args, cwd=tmp_path).returncode == 0
    assert hpcjobs(*args, cwd=tmp_path).returncode == 0  # the README's "run it again": nothing left to train
    rows = json.loads(hpcjobs("list", "--json").stdout)  # the first job read UNKNOWN once the second ended
    assert [(r["state"], r["state_source"]) for r in rows] == [("COMPLETED", "run folder")] * 2, rows
    # Each job its own restart number and logs: `logs` of the second printed the first's output first.
    assert [r["restarts"] for r in rows] == [1, 0], rows
    second = hpcjobs("logs", rows[0]["job_id"]).stdout
    assert "resumed from" in second and "starting at step 0" not in second, second
    again = hpcjobs(*args, "--hidden", "64", cwd=tmp_path)  # another task config: known on the ranks only
    assert again.returncode == 2 and "was written with other settings" in again.stdout, again.stdout
    end = again.stdout.strip().splitlines()[-1]
    assert "ended with code 2; run folder" in end and "reached step" not in end, end


@pytest.mark.train
def test_time_is_honoured_locally_and_what_is_not_run_is_said(tmp_path: Path) -> None:
    """Issue 26: `--time` was recorded and ignored (the job trained on), and the profile's setup lines were
    skipped without a word. The profile's signal comes `seconds_before` the end, as on Slurm: a timeout stop."""
    import yaml

    from conftest import REPO

    data = yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())
    data["preemption"]["seconds_before"] = 105  # --time 2:00: the signal 15 s in
    data["setup"] = ["module load cuda"]
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    t0 = time.monotonic()
    out = hpcjobs("submit", "--profile", str(profile), "--gpus", "1", "--time", "2:00", "--run-dir", str(run),
                  "trainers.tasks.classifier", "--steps", "1000000", "--log-every", "50", "--ckpt-every", "0",
                  cwd=tmp_path, timeout=120)
    assert time.monotonic() - t0 < 90, "the job ran past its warning"
    assert "setup lines are for Slurm jobs and are not run here" in out.stderr, out.stderr
    stop = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines() if "stopped" in x][-1]
    # the signal, or (on a loaded machine, sent while the rank still started and ignored it) the ranks' own deadline
    assert stop["stopped"] == "timeout" and stop["signal"] in ("SIGUSR2", "deadline"), stop
    assert checkpoint.latest(run / "checkpoints").step == stop["step"]


def test_a_profile_python_without_the_dependencies_is_one_line(tmp_path: Path) -> None:
    """Issue 26: locally each rank printed its ModuleNotFoundError traceback; the Slurm job script says one line."""
    import yaml

    from conftest import REPO

    python = tmp_path / "python"  # stands for a Python without torch, whatever this machine has
    python.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                      "echo \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    python.chmod(0o755)
    data = {**yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text()), "python": str(python)}
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(data))
    out = hpcjobs("submit", "--profile", str(profile), "--gpus", "2", "--run-dir", str(tmp_path / "run"),
                  "trainers.tasks.classifier", "--steps", "5", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stdout + out.stderr
    assert f"python {python} cannot start the ranks (ModuleNotFoundError: No module named 'torch')" in out.stderr
    assert not (tmp_path / "run").exists()
