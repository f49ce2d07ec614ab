"""The GPU test set (`pytest -m gpu`): what only a CUDA machine can show. Skipped where torch sees no GPU (CI never
has one); run it on a GPU machine with `pytest -m gpu tests/test_gpu.py` and commit what it found (bench/results/)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from conftest import REPO, hpcjobs
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu)")]

LM = ["trainers.tasks.lm", "--size", "small", "--steps", "12", "--log-every", "1", "--ckpt-every", "3",
      "--batch-size", "8", "--seed", "3", "--dropout", "0.1"]


def train(run: Path, *args: str, fault: str = "") -> str:
    manual = ("--max-recoveries", "0") if fault else ()  # the kill ends the run; the next command resumes it
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run), *manual, *LM, *args, cwd=REPO,
                  env={"HPCJOBS_FAULT_INJECT": fault}, timeout=600)
    if not fault:
        assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def weights(run: Path, step: int = 12) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None and ref.step == step
    return model_weights(ref)


def records(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_local_job_trains_on_the_gpu_in_bf16_and_reports_mfu(tmp_path: Path) -> None:
    log = train(tmp_path / "run")
    start = next(line for line in log.splitlines() if "| precision" in line)
    assert "on cuda" in start and "precision bf16" in start, start  # auto: bf16 where the GPU has it
    assert "expandable segments" in start, start  # the allocator, unless the user set it
    recs = [r for r in records(tmp_path / "run") if "loss" in r]
    assert len(recs) == 12 and all(r["loss"] == r["loss"] for r in recs)  # no NaN
    assert all(r["peak_reserved_gib"] >= r["peak_mem_gib"] and r["alloc_retries"] >= 0 for r in recs)
    if any(name in torch.cuda.get_device_name() for name in ("H100", "H200", "A100")):
        assert all(0 < r["mfu"] < 1 for r in recs)


def test_fp32_runs_tf32_unless_deterministic(tmp_path: Path) -> None:
    fast = train(tmp_path / "fast", "--precision", "fp32", "--steps", "2")
    exact = train(tmp_path / "exact", "--precision", "fp32", "--steps", "2", "--deterministic")
    assert "precision fp32, TF32 matmuls" in fast
    assert "precision fp32, deterministic" in exact and "TF32" not in exact


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_kill_and_resume_is_bit_exact_when_deterministic(precision: str, tmp_path: Path) -> None:
    """Dropout (CUDA RNG), fused AdamW, the GradScaler (fp16) and the schedule all continue exactly."""
    flags = ["--precision", precision, "--deterministic"]
    train(tmp_path / "straight", *flags)
    train(tmp_path / "killed", *flags, fault="step@7")
    # step 6's save is asynchronous: the kill may land before it is committed
    assert checkpoint.latest(tmp_path / "killed" / "checkpoints").step in (3, 6)  # type: ignore[union-attr]
    train(tmp_path / "killed", *flags)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra", [["--activation-checkpointing", "--compile"], ["--cpu-offload"]])
def test_fsdp_on_the_gpu_resumes_bit_exactly(extra: list[str], tmp_path: Path) -> None:
    """FSDP2 on one GPU (a group of one over NCCL): bf16 parameters with fp32 reduction, the asynchronous saves
    staged through pinned host buffers, and a kill mid-run; with --cpu-offload the shards and the optimizer step
    live on the host (gloo beside NCCL for the gradient norm)."""
    flags = ["--strategy", "fsdp", "--precision", "bf16", "--deterministic", *extra]
    log = train(tmp_path / "straight", *flags)
    assert "fsdp, nccl on cuda" in log and "precision bf16" in log
    train(tmp_path / "killed", *flags, fault="step@7")
    train(tmp_path / "killed", *flags)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(r.get("peak_mem_gib", 0) > 0 for r in records(tmp_path / "straight") if "loss" in r)


def test_compiled_model_trains_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    log = train(run, "--compile", fault="step@7")
    assert "compiled" in log
    train(run, "--compile")  # resumes from step 6: the checkpoint holds the plain module's keys
    assert records(run)[-1]["step"] == 12


def test_data_loader_workers_pin_memory_and_stay_up(tmp_path: Path) -> None:
    """Two epochs of a small dataset with two persistent workers per rank feeding pinned memory to the GPU."""
    log = train(tmp_path / "run", "--num-workers", "2", "--samples", "160", "--steps", "12")
    assert "step 12" in log


def test_default_optimizer_is_fused_on_cuda() -> None:
    from hpcjobs.protocol.settings.trainconfig import TrainConfig
    from trainers.trainer import default_optimizer

    model = torch.nn.Linear(4, 4).cuda()
    assert default_optimizer(model, 1e-3, TrainConfig()).defaults["fused"] is True
    assert default_optimizer(torch.nn.Linear(4, 4), 1e-3, TrainConfig()).defaults["fused"] is None


def test_only_the_current_devices_rng_state_is_saved_and_restored() -> None:
    from trainers.checkpoint.state import rng_state, set_rng_state

    torch.cuda.manual_seed(5)
    state = rng_state(torch.device("cuda", 0))
    a = torch.rand(3, device="cuda")
    set_rng_state(state, torch.device("cuda", 0))
    assert torch.equal(torch.rand(3, device="cuda"), a)
    assert isinstance(state["cuda"], torch.Tensor)  # one device's state, not a list per visible GPU


def _guard_under_nccl(store: str, out: str) -> None:
    import torch.distributed as dist

    from hpcjobs.protocol.contract import LaunchContract
    from trainers import preemption

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    guard = preemption.StopGuard(contract=LaunchContract(run_dir=""))
    answers = [guard.should_stop()]
    os.kill(os.getpid(), signal.SIGUSR2)
    answers.append(guard.should_stop())
    Path(out).write_text(repr(answers))
    dist.destroy_process_group()


def test_stop_guard_under_a_real_nccl_default_group(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    p = ctx.Process(target=_guard_under_nccl, args=(str(tmp_path / "store"), str(tmp_path / "answers")))
    p.start()
    p.join(120)
    assert p.exitcode == 0 and (tmp_path / "answers").read_text() == "[False, True]"


def test_the_rank_picks_nccl_and_its_own_gpu() -> None:
    from trainers.dist import pick_backend
    from trainers.distenv import DistEnv

    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1",
                  master_port=29500, job_id="local", restart=0, source="single")
    backend, device = pick_backend(env)
    assert (backend, device.type, device.index) == ("nccl", "cuda", 0)
