"""The node-local checkpoint tier (trainers/localtier.py, issue 40): 2 gloo ranks on the CPU, `--local-ckpt-every 5
--ckpt-every 200`, rank 1 SIGKILLed after step 30. The job's next start resumes from step 25 of the tier (its step-30
file was never written: the kill lands before it) with final weights bit-identical to an uninterrupted twin; with
the tier off it starts over at step 0; without a rank's own file it resumes from the replica its peer keeps, sent
over gloo when the two ranks are on two "nodes" (one folder each, LOCAL_WORLD_SIZE=1); a torn file is never used.
Ranks are started as the local backend starts them (one `python -m trainers.launch` per rank), and started again by
the test as a recovery in the same job would (the same job id, hence the same tier folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, hpcjobs
from hpcjobs.protocol.ports import free_port
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

STEPS = 40
ARGS = ["trainers.tasks.classifier", "--samples", "512", "--hidden", "32", "--steps", str(STEPS), "--log-every", "5",
        "--ckpt-every", "200", "--batch-size", "4", "--seed", "3"]
KILL = "step@30:1"


def launch(run: Path, dirs: list[Path], tier: int = 5, fault: str = "", job: str = "job-t", nodes: int = 1,
           more: tuple[str, ...] = ()) -> tuple[list[int], str]:
    """Both ranks of one start (`nodes` 2: one rank a node, each its own tier folder); their codes and output."""
    port, procs, outs = free_port(), [], []
    drop = ("SLURM_", "HPCJOBS_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for r in range(2):
        env = {**base, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r % (2 // nodes)),
               "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": str(2 // nodes), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "HPCJOBS_JOB_ID": job, "HPCJOBS_FAULT_INJECT": fault,
               "HPCJOBS_LOCAL_CKPT_DIR": str(dirs[r % len(dirs)])}
        out = run.parent / f"{run.name}-{r}-{time.monotonic_ns()}.out"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, "-m", "trainers.launch", "--run-dir", str(run), "--", *ARGS,
                                       "--local-ckpt-every", str(tier), *more], cwd=REPO, env=env,
                                      stdout=open(out, "w"), stderr=subprocess.STDOUT))
    deadline = time.time() + 300
    while any(p.poll() is None for p in procs):
        assert time.time() < deadline, "ranks did not end in time"
        if any(p.poll() not in (None, 0) for p in procs):  # as the local backend: one failed, the others end
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return [p.returncode for p in procs], "".join(o.read_text() for o in outs)


def weights(run: Path) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None and ref.step == STEPS
    return model_weights(ref)


def assert_same(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def tier_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.pt"))


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (the tier on: it must change nothing)."""
    tmp = tmp_path_factory.mktemp("twin")
    codes, out = launch(tmp / "run", [tmp / "shm"])
    assert codes == [0, 0], out
    assert tier_files(tmp / "shm") == [], "a finished job leaves nothing in the tier's folder"
    return tmp / "run"


def kill_then_resume(tmp_path: Path, dirs: list[Path], tier: int = 5, nodes: int = 1,
                     between: object = None) -> str:
    run = tmp_path / "run"
    codes, out = launch(run, dirs, tier, fault=KILL, nodes=nodes)
    assert codes[1] == -9, out
    if callable(between):
        between()
    codes, out = launch(run, dirs, tier, nodes=nodes)
    assert codes == [0, 0], out
    return out


@pytest.mark.train
def test_a_killed_rank_resumes_from_the_local_tier_bit_identical(tmp_path: Path, twin: Path) -> None:
    shm = tmp_path / "shm"
    out = kill_then_resume(tmp_path, [shm])
    assert "resumed from step 25 (local tier)" in out, out
    assert_same(twin, tmp_path / "run")
    starts = [json.loads(line) for line in (tmp_path / "run" / "startup.jsonl").read_text().splitlines()]
    assert [(s["start_step"], s["resumed_tier"]) for s in starts if s["rank"] == 0] == [(0, None), (25, "local tier")]
    assert tier_files(shm) == []


@pytest.mark.train
def test_under_fsdp_each_rank_keeps_its_shards_and_resumes_bit_identical(tmp_path: Path) -> None:
    fsdp = ("--strategy", "fsdp")
    assert launch(tmp_path / "twin", [tmp_path / "shm0"], more=fsdp)[0] == [0, 0]
    assert launch(tmp_path / "run", [tmp_path / "shm1"], fault=KILL, more=fsdp)[0][1] == -9
    codes, out = launch(tmp_path / "run", [tmp_path / "shm1"], more=fsdp)
    assert codes == [0, 0] and "resumed from step 25 (local tier)" in out, out
    assert_same(tmp_path / "twin", tmp_path / "run")


@pytest.mark.train
def test_with_the_tier_off_it_starts_over_at_step_0(tmp_path: Path, twin: Path) -> None:
    out = kill_then_resume(tmp_path, [tmp_path / "shm"], tier=0)
    assert "starting at step 0" in out and "local tier" not in out, out
    assert_same(twin, tmp_path / "run")


@pytest.mark.train
def test_without_its_own_file_a_rank_resumes_from_its_peers_replica_over_gloo(tmp_path: Path, twin: Path) -> None:
    """Two "nodes" (one folder each): rank 1's replica is in node 0's folder, and its own file is gone."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]

    def lose_rank1s_own_files() -> None:
        own = list(nodes[1].rglob("rank-1-of-2.step-*.pt"))
        assert own and list(nodes[0].rglob("peer-of-rank-1-of-2.step-25.pt"))
        for path in own:
            path.unlink()

    out = kill_then_resume(tmp_path, nodes, nodes=2, between=lose_rank1s_own_files)
    assert "resumed from step 25 (peer replica)" in out, out
    assert_same(twin, tmp_path / "run")


@pytest.mark.train
def test_a_torn_own_file_is_never_used_its_replica_is(tmp_path: Path, twin: Path) -> None:
    shm = tmp_path / "shm"

    def tear_rank0s_newest() -> None:
        path = next(shm.rglob("rank-0-of-2.step-25.pt"))
        path.write_bytes(path.read_bytes()[:-100])

    out = kill_then_resume(tmp_path, [shm], between=tear_rank0s_newest)
    assert "resumed from step 25 (peer replica)" in out, out
    assert_same(twin, tmp_path / "run")


@pytest.mark.slow  # CI runs the torn own file's case above: the same check, one copy
@pytest.mark.train
def test_a_step_whose_both_copies_are_torn_is_never_used(tmp_path: Path, twin: Path) -> None:
    """Step 20 was removed once every rank had step 25: nothing else is left, so the start is a fresh one."""
    shm = tmp_path / "shm"

    def tear_both_copies_of_step_25() -> None:
        for path in shm.rglob("*rank-0-of-2.step-25.pt"):
            path.write_bytes(b"\0" * 100)

    out = kill_then_resume(tmp_path, [shm], between=tear_both_copies_of_step_25)
    assert "starting at step 0" in out and "local checkpoint" not in out, out
    assert_same(twin, tmp_path / "run")


def test_the_flag_is_checked_before_anything_is_queued(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", "local", "--run-dir", str(tmp_path / "run"), "trainers.tasks.classifier",
                  "--local-ckpt-every", "-1", cwd=REPO)
    assert out.returncode == 2 and "--local-ckpt-every" in out.stderr and not (tmp_path / "run").exists(), out.stderr
