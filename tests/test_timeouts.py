"""Start-up and training timeouts, and NCCL's flight recorder (issue 11, item 10): one 300 s timeout used to cover
both the rendezvous and every collective of the run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from conftest import REPO, hpcjobs
from hpcjobs.protocol.ports import free_port
from hpcjobs.protocol.timeouts import COLLECTIVE_TIMEOUT, INIT_TIMEOUT
from trainers.dist import FLIGHT_RECORDER, flight_recorder_env
from trainers.distenv import DistEnvError, setting_seconds
from trainers.versions import parse as release


def _hung_rank(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from trainers.dist import distributed

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HPCJOBS_COLLECTIVE_TIMEOUT": "2"})
    with distributed(timeout_s=60) as ctx:
        dist.all_reduce(torch.ones(1))  # the first step's collectives: the start-up timeout
        said = [ctx.training_timeout()]
        if rank == 1:
            time.sleep(5)  # rank 0 waits longer than the training timeout, shorter than the start-up one
        ctx.barrier()  # the control group keeps the start-up timeout: a checkpoint barrier waits for a slow writer
        said.append("barrier ok")
        if rank == 1:
            time.sleep(8)  # hung, as far as rank 0 can tell
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            said.append("all_reduce ok")
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError or DistBackendError
            said.append(f"timed out after {time.monotonic() - t0:.0f} s: {type(e).__name__}")
        Path(f"{out}-{rank}").write_text(json.dumps(said))
        os._exit(0)  # the other rank may still be inside the timed-out collective


@pytest.mark.train
def test_after_the_first_step_a_hung_rank_ends_a_collective_at_the_training_timeout(tmp_path: Path) -> None:
    port = free_port()
    out = str(tmp_path / "said")
    mp.spawn(_hung_rank, args=(port, out), nprocs=2)
    said = json.loads(Path(f"{out}-0").read_text())
    assert said[:2] == [2.0, "barrier ok"]
    assert said[2].startswith("timed out after") and int(said[2].split()[3]) < 60, said


def test_timeout_settings_are_checked() -> None:
    assert setting_seconds(INIT_TIMEOUT, {}) == 300 and setting_seconds(COLLECTIVE_TIMEOUT, {}) == 120
    assert setting_seconds(COLLECTIVE_TIMEOUT, {"HPCJOBS_COLLECTIVE_TIMEOUT": "30"}) == 30
    for bad in ("0", "-1", "soon", "nan"):
        with pytest.raises(DistEnvError, match="HPCJOBS_INIT_TIMEOUT=.*valid: .*HINT: e.g. HPCJOBS_INIT_TIMEOUT=300"):
            setting_seconds(INIT_TIMEOUT, {"HPCJOBS_INIT_TIMEOUT": bad})


def test_flight_recorder_dumps_into_the_run_folder() -> None:
    env = flight_recorder_env(Path("/runs/x/nccl-trace/rank-"), "2.13.0", {})
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/runs/x/nccl-trace/rank-"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_FR_BUFFER_SIZE"]) > 0
    assert set(FLIGHT_RECORDER) < set(env)


def test_the_flight_recorders_size_goes_by_the_name_this_torch_reads() -> None:
    """torch 2.11 warned twice a rank at TORCH_NCCL_TRACE_BUFFER_SIZE (on an H200); older ones know only that name;
    a size the user or the profile set, under either name, is theirs."""
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in flight_recorder_env(Path("/t/rank-"), "2.11.0+cu130", {})
    assert flight_recorder_env(Path("/t/rank-"), "2.9.1", {})["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert "TORCH_FR_BUFFER_SIZE" not in flight_recorder_env(Path("/t/rank-"), "2.9.1", {})
    for theirs in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env = flight_recorder_env(Path("/t/rank-"), "2.13.0", {theirs: "50"})
        assert not set(env) & {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, env
    assert release("2.13.0.dev20260101") == (2, 13) and release("2.7.1+cu128") == (2, 7)


@pytest.mark.train
def test_a_two_rank_run_says_when_training_timeouts_begin_and_status_points_at_nccl_traces(
        tmp_path: Path, hpcjobs_home: Path) -> None:
    run = tmp_path / "run"
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), "trainers.tasks.lm",
                  "--steps", "3", cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    log = (run / "logs" / "restart-0" / "rank-0.log").read_text()
    assert "first step done: training collectives now time out after 120 s" in log
    assert "nccl trace" not in hpcjobs("status").stdout  # gloo: no flight recorder, no folder
    (run / "nccl-trace").mkdir()
    (run / "nccl-trace" / "rank-1").write_bytes(b"\x80")  # what a timed-out NCCL rank leaves
    assert f"nccl trace:  {run / 'nccl-trace'} (NCCL's flight recorder" in hpcjobs("status").stdout
