"""GPU-only paths shown on the CPU (issue 11): what a GPU node would hit, simulated where this machine can."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from trainers.dist import RendezvousError, rank_gpu
from trainers.distenv import DistEnv


def _guard_on_a_group_without_cpu_backend(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from hpcjobs.protocol.contract import LaunchContract
    from trainers import preemption

    # "cuda:gloo" registers a backend for CUDA tensors only, as NCCL does: the default group has no CPU backend.
    dist.init_process_group("cuda:gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    guard = preemption.StopGuard(contract=LaunchContract(run_dir=""))
    answers = [guard.should_stop()]
    if rank == 1:
        preemption.request_stop(signal.SIGTERM)
    answers.append(guard.should_stop())
    Path(f"{out}-{rank}").write_text(repr(answers))
    dist.destroy_process_group()


def test_stop_guard_works_when_the_default_group_has_no_cpu_backend(tmp_path: Path) -> None:
    """StopGuard all-reduced a CPU tensor on the default group: under init_process_group("nccl") (the README's
    own-script example on GPUs) the first should_stop() raised."""
    out = str(tmp_path / "answers")
    mp.spawn(_guard_on_a_group_without_cpu_backend, args=(str(tmp_path / "store"), out), nprocs=2)
    assert [Path(f"{out}-{r}").read_text() for r in (0, 1)] == ["[False, True]", "[False, True]"]
    assert not os.path.exists(tmp_path / "run")


def test_each_rank_gets_a_gpu_of_its_own_or_a_clear_error() -> None:
    """The device was local_rank % visible GPUs: with 1 < visible < ranks per node two ranks shared one."""
    def env(local: int, per_node: int = 8) -> DistEnv:
        return DistEnv(rank=8 + local, local_rank=local, world_size=16, local_world_size=per_node,
                       master_addr="n1", master_port=1, job_id="1", restart=0, source="slurm")

    assert [rank_gpu(env(r), 8) for r in range(8)] == list(range(8))  # every rank sees every GPU
    assert [rank_gpu(env(r), 1) for r in range(8)] == [0] * 8  # one GPU per task (--gpus-per-task)
    with pytest.raises(RendezvousError, match="sees 4 GPUs: valid: 1 per rank, or at least 8"):
        rank_gpu(env(5), 4)


def test_torch_threads_never_exceed_the_cpus_the_rank_may_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm 22.05-23.02 do not pass --cpus-per-task from sbatch to srun: a rank bound to 1 CPU was told to run
    SLURM_CPUS_PER_TASK threads on it."""
    from trainers.dist import cpu_threads

    env = DistEnv(rank=0, local_rank=0, world_size=4, local_world_size=4, master_addr="h", master_port=1,
                  job_id="1", restart=0, source="slurm")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "8")
    assert cpu_threads(env, usable=1) == 1  # bound to one CPU
    assert cpu_threads(env, usable=16) == 8  # task/none: the mask is the node, the share is Slurm's
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    assert cpu_threads(env, usable=8) == 2  # a mask the four ranks share (salloc -c 8, a container's cpuset)
    assert cpu_threads(env, usable=16) == 4  # the machine shared by four ranks
    assert cpu_threads(env, usable=3) == 1


def test_gpu_peaks_for_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from trainers.perf import peak_flops

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(cuda, "bf16", tf32=False) == pytest.approx(989.4e12)
    assert peak_flops(cuda, "fp32", tf32=True) == pytest.approx(494.7e12)
    assert peak_flops(cuda, "fp32", tf32=False) == pytest.approx(66.9e12)
    assert peak_flops(torch.device("cpu"), "bf16", tf32=False) is None
    for other in ("Some Future GPU", "NVIDIA RTX A1000 Laptop GPU", "NVIDIA H20"):  # an A100 or H200 by substring
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=other: name)
        assert peak_flops(cuda, "bf16", tf32=False) is None, other


@pytest.mark.parametrize(("name", "bf16", "tf32"), [
    ("NVIDIA H100 80GB HBM3", 989.4, 494.7), ("NVIDIA H100 PCIe", 756.5, 378.0), ("NVIDIA H100 NVL", 835.5, 417.5),
    ("NVIDIA H200", 989.4, 494.7), ("NVIDIA H200 NVL", 835.5, 417.5), ("NVIDIA GH200 480GB", 989.4, 494.7),
    ("NVIDIA A100-SXM4-80GB", 312.0, 156.0), ("NVIDIA A100 80GB PCIe", 312.0, 156.0), ("NVIDIA B200", 2250.0, 1100.0),
    ("NVIDIA GB200", 2500.0, 1250.0), ("NVIDIA A100-PCIE-40GB", 312.0, 156.0),
])
def test_each_gpu_variant_gets_its_own_peak(monkeypatch: pytest.MonkeyPatch, name: str, bf16: float,
                                            tf32: float) -> None:
    """A PCIe or NVL H100 has a lower peak than the SXM part: its MFU was computed against the SXM's (issue 28)."""
    import torch

    from trainers.perf import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    assert peak_flops(cuda, "bf16", tf32=False) == pytest.approx(bf16 * 1e12)
    assert peak_flops(cuda, "fp32", tf32=True) == pytest.approx(tf32 * 1e12)


MATH = """
import os, torch
from trainers.perf import configure_math
said = configure_math({precision!r}, {deterministic}, torch.device({device!r}))
print(said, torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
      os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.backends.cudnn.allow_tf32, sep="|")
"""


@pytest.mark.train
@pytest.mark.parametrize("precision,deterministic,device,expected", [
    ("fp32", False, "cuda", "TF32 matmuls|high|False|None|True"),
    ("bf16", False, "cuda", "|highest|False|None|True"),  # bf16 matmuls are bf16 anyway: nothing to say
    ("fp32", True, "cuda", "deterministic|highest|True|:4096:8|False"),
    ("fp32", False, "cpu", "|highest|False|None|True"),
])
def test_tf32_for_fp32_on_gpus_unless_deterministic(precision: str, deterministic: bool, device: str,
                                                    expected: str) -> None:
    import subprocess
    import sys

    code = MATH.format(precision=precision, deterministic=deterministic, device=device)
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == expected


def test_a_rank_without_cuda_where_slurm_allocated_gpus_is_an_error_naming_it() -> None:
    """It used to fall back to gloo on the CPU while the other ranks used NCCL: a hang until the rendezvous timeout.
    This machine has no CUDA: it is such a rank."""
    import torch

    from trainers.dist import pick_backend

    assert not torch.cuda.is_available()
    env = DistEnv(rank=5, local_rank=1, world_size=16, local_world_size=8, master_addr="h", master_port=1,
                  job_id="1", restart=0, source="slurm")
    with pytest.raises(RendezvousError) as e:
        pick_backend(env, {"SLURM_GPUS_ON_NODE": "8"})
    msg = str(e.value)
    assert msg.startswith(f"rank 5 (local 1) on {os.uname().nodename}: Slurm allocated GPUs (SLURM_GPUS_ON_NODE=8) "
                          "but CUDA is unavailable to torch") and "HINT: check nvidia-smi" in msg and "\n" not in msg
    assert pick_backend(env, {"SLURM_GPUS_ON_NODE": "8", "HPCJOBS_BACKEND": "gloo"})[0] == "gloo"  # on purpose
    assert pick_backend(env, {"SLURM_GPUS_ON_NODE": "0"})[0] == "gloo"  # a CPU job on a GPU cluster
    assert pick_backend(env, {})[0] == "gloo"  # a laptop
    with pytest.raises(RendezvousError, match="HPCJOBS_BACKEND=nccl but CUDA is unavailable"):
        pick_backend(env, {"HPCJOBS_BACKEND": "nccl"})


def test_a_rank_on_the_cpu_never_asks_cuda_for_its_rng_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """HPCJOBS_BACKEND=gloo on a GPU node: every checkpoint asked torch.cuda for its RNG state because CUDA was
    there, which opens a context on GPU 0 in every rank. Simulated: CUDA 'available', and any question to it fails."""
    import torch

    from trainers.checkpoint.state import rng_state, set_rng_state

    def no_cuda(*args: object) -> None:
        raise AssertionError("a rank on the CPU asked CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", no_cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state", no_cuda)
    cpu = torch.device("cpu")
    state = rng_state(cpu)
    assert "cuda" not in state
    set_rng_state({**state, "cuda": torch.zeros(8, dtype=torch.uint8)}, cpu)  # saved on a GPU, resumed on the CPU


def test_a_background_save_waits_for_its_gpu_copies_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host waited for the GPU after every tensor's copy (thousands of waits for a large model's optimizer
    state); it waits once, after queueing them all. Simulated: a 'cuda' device whose stream counts the waits."""
    import torch

    from trainers.checkpoint.sharded import stage

    waits: list[object] = []

    class Stream:
        def synchronize(self) -> None:
            waits.append(self)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    state = {"model": {f"w{i}": torch.full((3,), float(i)) for i in range(5)}, "optimizer": {"s": torch.ones(2)}}
    buffers: dict[str, torch.Tensor] = {}
    out = stage(state, buffers, "", torch.device("cuda", 0))
    assert len(waits) == 1 and len(buffers) == 6
    assert torch.equal(out["model"]["w4"], torch.full((3,), 4.0))


@pytest.mark.parametrize(("environ", "conf", "words"), [
    ({}, "expandable_segments:True", "expandable segments"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, "max_split_size_mb:512",
     "allocator PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 (yours)"),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, None,
     "allocator PYTORCH_ALLOC_CONF=expandable_segments:False (yours)"),
])
def test_cuda_ranks_get_expandable_segments_unless_the_user_set_the_allocator(
        monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], conf: str | None, words: str) -> None:
    """Issue 28: FSDP's gathered blocks and activations of changing sizes fragment fixed-size segments."""
    import torch

    from trainers import allocator

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    allocator.configure(environ)
    assert environ.get("PYTORCH_CUDA_ALLOC_CONF") == conf
    assert allocator.words(torch.device("cuda", 0), environ) == words
    assert allocator.words(torch.device("cpu"), environ) == ""


def test_expandable_segments_are_set_directly_when_cuda_is_already_up(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from trainers import allocator

    said: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", said.append)
    allocator.configure({})
    assert said == ["expandable_segments:True"]


def test_cuda_distributed_sets_the_allocator_before_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reads PYTORCH_CUDA_ALLOC_CONF when it makes the allocator: set_device must come after."""
    import torch

    from trainers import dist

    order: list[str] = []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(dist, "pick_backend", lambda env: ("nccl", torch.device("cuda", 0)))
    monkeypatch.setattr(dist.allocator, "configure", lambda: order.append("allocator"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: order.append("set_device"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # this process's settings stay as they were
    monkeypatch.setattr(dist.startup, "mark", lambda name: None)
    with dist.distributed():
        pass
    assert order == ["allocator", "set_device"]


def test_metrics_carry_reserved_memory_and_allocator_retries_on_cuda(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    import json

    import torch

    from hpcjobs.protocol.runfolder import RunFolder
    from hpcjobs.protocol.settings.trainconfig import TrainConfig
    from trainers.dist import DistContext
    from trainers.meter import Meter
    from trainers.task import Task

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 2})
    env = DistEnv(0, 0, 1, 1, "127.0.0.1", 1, "j", 0, "torchrun")
    task = Task(name="t", model=lambda: torch.nn.Linear(1, 1), train_data=lambda: [], loss=lambda m, b: b)
    meter = Meter(DistContext(env, torch.device("cpu"), "gloo"), TrainConfig(steps=10), task, RunFolder(tmp_path),
                  1, 0, None)
    meter.ctx = DistContext(env, torch.device("cuda", 0), "nccl")  # the counters are the allocator's: no tensor
    meter.add(torch.tensor(1.0))
    meter.flush(1, 0.1)
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert (rec["peak_mem_gib"], rec["peak_reserved_gib"], rec["alloc_retries"]) == (3.0, 4.0, 2)


@pytest.mark.parametrize(("device", "capability", "torchao", "said"), [
    ("cpu", (0, 0), True, "--fp8 on a rank without a GPU; valid: --fp8 on GPUs with float8 tensor cores"),
    ("cuda", (8, 0), True, "--fp8 on NVIDIA A100-SXM4-80GB (compute capability 8.0: no float8 tensor cores)"),
    ("cuda", (9, 0), False, "--fp8 on a rank without the torchao package; valid:"),
    ("cuda", (9, 0), True, None),
])
def test_fp8_is_refused_in_one_line_without_float8_tensor_cores_or_torchao(
        monkeypatch: pytest.MonkeyPatch, device: str, capability: tuple[int, int], torchao: bool,
        said: str | None) -> None:
    import importlib.util

    import torch

    from trainers import fp8

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if torchao else None) if name == "torchao" else real(name, *a))
    why = fp8.unavailable(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    line = None if why is None else fp8.refusal(why)
    assert (line is None) == (said is None)
    if said is not None:
        assert line is not None and said in line and "\n" not in line and "HINT: pip install torchao" in line


def test_fp8_converts_the_aligned_linears_first_and_gathers_in_float8_under_fsdp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torchao is not installed here: a stand-in records what the trainer asks of torchao.float8, and
    strategy.make converts before activation checkpointing wraps the blocks (torchtitan's order)."""
    import sys
    import types

    import torch
    from torch import nn

    from hpcjobs.protocol.settings.trainconfig import TrainConfig
    from hpcjobs.protocol.settings.trainflags import ConfigError
    from trainers import fp8, strategy
    from trainers.dist import DistContext

    calls: list[tuple[nn.Module, dict[str, bool], list[str]]] = []
    float8 = types.ModuleType("torchao.float8")
    float8.Float8LinearConfig = lambda **kw: kw  # type: ignore[attr-defined]
    float8.convert_to_float8_training = lambda model, config, module_filter_fn: calls.append(  # type: ignore[attr-defined]
        (model, config, [n for n, m in model.named_modules() if module_filter_fn(m, n)]))
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10), nn.Linear(32, 48))
    assert fp8.convert(model, TrainConfig(strategy="fsdp")) == 2
    assert calls[-1][1] == {"enable_fsdp_float8_all_gather": True} and calls[-1][2] == ["0", "3"]

    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="h", master_port=1,
                  job_id="1", restart=0, source="local")
    ctx = DistContext(env, torch.device("cpu"), "gloo")
    cfg = TrainConfig(fp8=True, activation_checkpointing=True)
    with pytest.raises(ConfigError, match="--fp8 on a rank without a GPU"):
        strategy.make(nn.Sequential(nn.Linear(16, 16)), ctx, cfg, "fp32")
    seen: list[str] = []
    monkeypatch.setattr(fp8, "unavailable", lambda device: None)
    monkeypatch.setattr(fp8, "convert", lambda model, cfg: seen.append("fp8") or 1)
    monkeypatch.setattr(strategy, "checkpoint_activations", lambda *a: seen.append("ac") or 1)
    monkeypatch.setattr(strategy, "Ddp", lambda *a: seen.append("ddp"))
    strategy.make(nn.Sequential(nn.Linear(16, 16)), ctx, cfg, "fp32")
    assert seen == ["fp8", "ac", "ddp"]
