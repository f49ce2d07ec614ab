"""The docs as a contract: every command in the fenced shell blocks of the README and of docs/ runs as written, on
the test cluster (here) or this machine (the quickstart's, by tests/readme_quickstart.py).

Substitutions, as docs/testing.md states them ("The docs as typed"): `mysite` is the profile the docs copy into
~/.config/hpcjobs/profiles/ (HOME is a fresh folder here), edited, as they say, into the test cluster's; `4242` is
the job the block submitted; `...` is the request named in SUBSTITUTED; `train.py` and `mypkg.train` are stand-in
scripts of the user's (here: a few lines that check their environment). The commands run elsewhere are
doccommands.RUN_ELSEWHERE's and the quickstart's; tests/test_docs.py fails on a command that has no case here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from doccommands import python_block

from conftest import BIN, REPO, slurm, wait_for_state

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}

SUBSTITUTED = {
    "hpcjobs submit --dry-run ...": "hpcjobs submit --dry-run --profile mysite --nodes 2 --gpus 8 trainers.tasks.lm",
    "hpcjobs submit --json ...": "hpcjobs submit --json --profile mysite --nodes 2 --gpus 8 trainers.tasks.lm "
                                 "--size tiny --steps 5",
    "hpcjobs render -o train.sbatch ...": "hpcjobs render -o train.sbatch --profile mysite --nodes 2 --gpus 8 "
                                          "trainers.tasks.lm",
    "hpcjobs submit ... ENTRY --help": "hpcjobs submit --profile mysite trainers.tasks.lm --help",
}


@pytest.fixture(autouse=True)
def _cancel_what_the_test_queued() -> Iterator[None]:
    """A failing case must not leave its 16-rank jobs holding both nodes for the tests after it."""
    before = set(slurm("squeue", "-h", "-o", "%i").split())
    yield
    left = sorted(set(slurm("squeue", "-h", "-o", "%i").split()) - before)
    if left:
        slurm("scancel", *left, check=False)


class User:
    """A shell in a fresh folder with a fresh HOME, running the docs' commands as typed."""

    def __init__(self, root: Path) -> None:
        self.cwd, self.home = root / "work", root / "home"
        self.cwd.mkdir()
        self.home.mkdir()
        shutil.copytree(REPO / "cluster_profiles", self.cwd / "cluster_profiles")  # `cp cluster_profiles/...`
        self.env = {**os.environ, "HOME": str(self.home), "PATH": f"{BIN}:{os.environ['PATH']}",
                    "HPCJOBS_HOME": str(root / "store")}
        self.env.pop("XDG_CONFIG_HOME", None)
        self.ran: list[str] = []

    job = "4242"
    """The job the block submitted stands for 4242."""

    def run(self, command: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess[str]:
        typed = SUBSTITUTED.get(command, command).replace("4242", self.job)
        self.ran.append(command)
        out = subprocess.run(["bash", "-c", typed], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                             timeout=timeout)
        assert not check or out.returncode == 0, f"`{typed}` exited {out.returncode}: {out.stderr[-2000:]}"
        return out

    def start(self, command: str) -> subprocess.Popen[str]:
        self.ran.append(command)
        return subprocess.Popen(["bash", "-c", command.replace("4242", self.job)], cwd=self.cwd, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def edit_mysite(self, runs: Path) -> None:
        """"edit partition, account, setup": into the test cluster's profile, run folders where the nodes see."""
        data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
        data["runs_dir"] = str(runs)
        (self.home / ".config" / "hpcjobs" / "profiles" / "mysite.yaml").write_text(yaml.safe_dump(data))


def job_id(out: subprocess.CompletedProcess[str]) -> str:
    m = re.search(r"Submitted job (\d+)", out.stdout) or re.search(r'"job_id": "(\d+)"', out.stdout)
    assert m, out.stdout
    return m.group(1)


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


STAND_IN = "import os, sys; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], sys.argv[1:])\n"


def test_on_a_cluster_block_as_typed(tmp_path: Path, shared_tmp: Path) -> None:
    user = User(tmp_path)
    assert "testcluster" in user.run("hpcjobs profiles").stdout
    user.run("mkdir -p ~/.config/hpcjobs/profiles")  # a fresh HOME has no such folder: the cp alone failed there
    user.run("cp cluster_profiles/a100-ib.yaml ~/.config/hpcjobs/profiles/mysite.yaml")
    user.edit_mysite(shared_tmp / "runs")
    assert "✓ request " in user.run("hpcjobs doctor --profile mysite --nodes 2 --gpus 8 --time 4:00:00").stdout
    (user.cwd / "train.py").write_text(STAND_IN)
    (user.cwd / "mypkg").mkdir()
    (user.cwd / "mypkg" / "__init__.py").write_text("")
    (user.cwd / "mypkg" / "train.py").write_text(STAND_IN)

    big = user.run("hpcjobs submit --profile mysite --nodes 2 --gpus 8 --time 4:00:00 trainers.tasks.lm --size small "
                   "--steps 5000")
    job = user.job = job_id(big)
    assert "lm: 2 nodes × 8 GPUs = 16 ranks" in big.stdout
    own = [job_id(user.run(command)) for command in (  # they queue behind the 16-rank job: waited for below
        "hpcjobs submit --profile mysite --nodes 2 --gpus 8 train.py --config configs/x.yaml",
        "hpcjobs submit --profile mysite --nodes 2 --gpus 8 -m mypkg.train --config configs/x.yaml")]
    assert "#SBATCH --nodes=2" in user.run("hpcjobs submit --dry-run ...").stdout
    spare = user.run("hpcjobs submit --dry-run --profile mysite --nodes 1 --gpus 8 --spare-nodes 1 --max-recoveries 3 "
                     "trainers.tasks.lm").stdout  # docs/how-to/self-healing.md
    assert all(s in spare for s in ("#SBATCH --nodes=2", "#SBATCH --no-kill", "--nodes=1 --ntasks=8",
                                    "trainers.recover", '"max_recoveries":3')), spare
    small = json.loads(user.run("hpcjobs submit --json ...").stdout)
    user.run("hpcjobs render -o train.sbatch ...")
    assert (user.cwd / "train.sbatch").read_text().startswith("#!/bin/bash")
    assert "--steps" in user.run("hpcjobs submit ... ENTRY --help").stdout

    # The big job: once it trains, an outside requeue gives it a restart 1 to follow.
    run = Path(json.loads(user.run("hpcjobs status 4242 --json").stdout)["run_dir"])
    wait_for(lambda: (run / "heartbeat.json").exists(), "the 16-rank job to train")
    user.run("scontrol requeue 4242")  # docs/tutorial/preemption-and-resume.md: as a preemption would
    wait_for(lambda: (run / "logs" / "restart-1" / "rank-3.log").exists(), "restart 1")
    assert "restarts:    1" in user.run("hpcjobs status 4242").stdout
    follow = user.start("hpcjobs logs 4242 --rank 3 --restart 1 --follow")
    wait_for(lambda: "RUNNING" == slurm("squeue", "-h", "-j", job, "-o", "%T").strip(), "restart 1 to run")
    assert job in user.run("hpcjobs list --state RUNNING").stdout
    assert "cancelled" in user.run("hpcjobs cancel 4242").stdout
    out, _ = follow.communicate(timeout=120)
    assert follow.returncode == 0 and "hpcjobs: rank 3/16" in out
    for queued in [*own, small["job_id"]]:
        assert wait_for_state(queued, DONE) == "COMPLETED"
    for queued in own:
        run_dir = Path(json.loads(user.run(f"hpcjobs status {queued} --json").stdout)["run_dir"])
        assert "rank 15 of 16 ['--config', 'configs/x.yaml']" in (run_dir / "logs/restart-0/rank-15.log").read_text()


def test_own_task_block_as_typed(tmp_path: Path, shared_tmp: Path) -> None:
    """The docs' mytask.py (docs/tutorial/own-task.md), submitted to the cluster and run under torchrun, as typed."""
    user = User(tmp_path)
    (user.home / ".config" / "hpcjobs" / "profiles").mkdir(parents=True)
    user.edit_mysite(shared_tmp / "runs")
    (user.cwd / "mytask.py").write_text(python_block("# mytask.py"))
    job = user.job = job_id(user.run("hpcjobs submit --profile mysite --nodes 2 --gpus 8 mytask --steps 2000 "
                                     "--batch-size 32 --lr-scaling sqrt"))
    run = Path(json.loads(user.run("hpcjobs status 4242 --json").stdout)["run_dir"])
    wait_for(lambda: (run / "heartbeat.json").exists(), "the task to train")
    log0 = (run / "logs" / "restart-0" / "rank-0.log").read_text()
    assert "task mlp | 16 rank(s)" in log0 and "sqrt scaling" in log0
    slurm("scancel", job)

    proc = user.start("torchrun --nproc_per_node 8 -m trainers mytask --steps 2000 --run-dir runs/mlp")
    ckpts = user.cwd / "runs" / "mlp"
    wait_for(lambda: (ckpts / "heartbeat.json").exists(), "torchrun's ranks to train")
    os.killpg(proc.pid, signal.SIGTERM)  # stop it early: the ranks save and stop, as under Slurm
    proc.communicate(timeout=120)
    assert list((ckpts / "checkpoints").glob("step-*/FINISHED")), "no checkpoint committed on SIGTERM"


def test_sweep_block_as_typed(tmp_path: Path, shared_tmp: Path) -> None:
    """The docs' sweep (docs/how-to/sweeps.md): a 4-point array, two tasks at once, then status and compare."""
    user = User(tmp_path)
    (user.home / ".config" / "hpcjobs" / "profiles").mkdir(parents=True)
    user.edit_mysite(shared_tmp / "runs")
    out = user.run("hpcjobs submit --profile mysite --gpus 1 --sweep lr=1e-3,3e-4 --sweep seed=1,2 --max-parallel 2 "
                   "trainers.tasks.lm --size tiny --steps 200")
    job = user.job = job_id(out)
    for i in range(4):
        assert wait_for_state(f"{job}_{i}", DONE) == "COMPLETED"
    status = user.run("hpcjobs status 4242").stdout
    assert "4 tasks: 4 COMPLETED" in status and "lr=3e-4 seed=2" in status
    compared = user.run("hpcjobs compare 4242 --plot loss.png").stdout
    assert compared.count("COMPLETED") == 4 and (user.cwd / "loss.png").stat().st_size > 10_000
    goodput = user.run("hpcjobs goodput 4242").stdout  # docs/how-to/goodput.md
    assert goodput.count(f"{job}_") == 4 and "sum (= wall time)" in goodput, goodput
    total = json.loads(user.run("hpcjobs goodput 4242 --json").stdout)["total"]
    # --json rounds each of the 8 buckets and the wall to 1 ms: their sum may be off by up to 4.5 ms
    assert abs(sum(total["buckets_s"].values()) - total["wall_s"]) < 5e-3 and 0 < total["ettr"] < 1, total


def test_chain_block_as_typed(tmp_path: Path, shared_tmp: Path) -> None:
    """The docs' chain (docs/how-to/chains.md): checked, queued at once, eval after train, then one more by hand."""
    user = User(tmp_path)
    (user.home / ".config" / "hpcjobs" / "profiles").mkdir(parents=True)
    user.edit_mysite(shared_tmp / "runs")
    (user.cwd / "chain.yaml").write_text(python_block("# chain.yaml", lang="yaml"))
    (user.cwd / "train.py").write_text(STAND_IN)
    (user.cwd / "mypkg").mkdir()
    (user.cwd / "mypkg" / "__init__.py").write_text("")
    (user.cwd / "mypkg" / "train.py").write_text(STAND_IN)
    planned = user.run("hpcjobs submit --chain chain.yaml --dry-run").stdout
    assert "step train: trainers.tasks.lm" in planned and "step eval: " in planned and "after train:ok" in planned
    out = user.run("hpcjobs submit --chain chain.yaml").stdout
    train = re.search(r"step train: job (\d+)", out)
    evaluation = re.search(r"step eval: job (\d+)", out)
    assert train and evaluation, out
    user.job = evaluation.group(1)
    assert "(ok): " in user.run("hpcjobs status 4242").stdout
    assert wait_for_state(train.group(1), DONE, timeout=600) == "COMPLETED"
    assert wait_for_state(user.job, DONE, timeout=300) == "COMPLETED"
    assert f"after:       {train.group(1)} (ok): COMPLETED, met" in user.run("hpcjobs status 4242").stdout
    last = job_id(user.run("hpcjobs submit --profile mysite --after 4242 -m mypkg.train"))
    assert wait_for_state(last, DONE, timeout=300) == "COMPLETED"


def test_secrets_block_as_typed(tmp_path: Path, shared_tmp: Path) -> None:
    """The docs' keys by name (docs/how-to/secrets.md): each in a file of its own, exported, named with --env; the
    job completes on both nodes and no file of its runs folder or the job store holds a key."""
    user = User(tmp_path)
    (user.home / ".config" / "hpcjobs" / "profiles").mkdir(parents=True)
    user.edit_mysite(shared_tmp / "runs")
    keys = {"wandb": f"canary-w-{os.getpid()}-{time.time_ns()}", "hf": f"canary-h-{os.getpid()}-{time.time_ns()}"}
    user.run("mkdir -p ~/.secrets && chmod 700 ~/.secrets")
    for name, value in keys.items():
        (user.home / ".secrets" / name).write_text(value)
    exported = 'export WANDB_API_KEY="$(cat ~/.secrets/wandb)" HF_TOKEN="$(cat ~/.secrets/hf)"'
    dry = "hpcjobs submit --dry-run --profile mysite --env WANDB_API_KEY trainers.tasks.lm"
    submit = ("hpcjobs submit --profile mysite --nodes 2 --gpus 2 --env WANDB_API_KEY --env HF_TOKEN trainers.tasks.lm "
              "--size tiny --steps 20")
    user.run(exported)  # as typed; each command below runs in a shell of its own, so the export leads each
    shown = user.run(exported + "\n" + dry)
    assert "WANDB_API_KEY set" in shown.stdout, shown.stdout
    out = user.run(exported + "\n" + submit)
    user.job = job_id(out)
    assert wait_for_state(user.job, DONE) == "COMPLETED"
    for folder in (shared_tmp / "runs", tmp_path / "store", user.cwd):
        for path in (p for p in folder.rglob("*") if p.is_file()):
            assert not any(v.encode() in path.read_bytes() for v in keys.values()), path
    assert not any(v in out.stdout + shown.stdout for v in keys.values())
