"""How fast and how reproducibly the math runs on this rank: TF32, deterministic kernels, and the GPU's peak for MFU.

The precision first (`resolve_precision`: what --precision auto means on this device), then one call,
`configure_math`, before the model is built; it returns the words the start line shows, so a user can see
from the log whether a run was deterministic and whether fp32 matmuls ran as TF32.
"""

from __future__ import annotations

import os
import re

import torch

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's workspace setting that makes its reductions run in a fixed order (CUDA's reproducibility notes)."""

# Dense peak TFLOP/s per GPU (the vendors' datasheet figures without sparsity: NVIDIA quotes Tensor Core figures
# "with sparsity", twice the dense ones), by the device name torch.cuda.get_device_name gives: "NVIDIA H100 80GB HBM3"
# is the SXM part, "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA GH200 480GB",
# "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA B200", "NVIDIA GB200". A key matches a whole model name
# (trainers.perf.peak_key): "A100" is not the "RTX A1000", "H100" not the "GH100" inside another word. The first key
# found wins, so a form factor comes before its family: an H100 PCIe or NVL runs at lower clocks and power than the
# SXM part (756 and 835 bf16 TFLOP/s against 989), and taking the SXM peak for them understated their MFU by up to a
# quarter. TF32 is what an fp32 matmul runs as when TF32 is on; with it off, fp32 is the plain FMA figure.
# Sources: NVIDIA's H100 datasheet (nvidia.com/en-us/data-center/h100: SXM 1,979 / PCIe 1,513 / NVL 1,671 bf16
# TFLOP/s with sparsity; TF32 989 / 756 / 835; FP32 67 / 51 / 60), H200 datasheet (nvidia.com/en-us/data-center/h200:
# SXM as the H100 SXM, NVL as the H100 NVL), A100 datasheet (312 / 156 dense, 19.5 FP32, SXM4 and PCIe alike), HGX B200
# and GB200 NVL72 specifications (nvidia.com/en-us/data-center/hgx, /gb200-nvl72: per GPU 4.5 / 5 PFLOP/s FP16/BF16
# and 2.2 / 2.5 TF32 with sparsity, FP32 75 / 80 TFLOP/s), as tabulated per form factor at
# glennklockwood.com/garden/processors/B200 (HGX B200 at 1,000 W, GB200 at 1,200 W).
_HOPPER_SXM = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}
_HOPPER_NVL = {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": _HOPPER_NVL,
    "H200 NVL": _HOPPER_NVL,
    "H100": _HOPPER_SXM,  # SXM5
    "H200": _HOPPER_SXM,  # SXM: the H100 SXM's compute with more and faster memory
    "GH200": _HOPPER_SXM,  # Grace Hopper: the SXM part's compute
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},  # SXM4 and PCIe alike
    "GB200": {"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0, "fp32": 80.0},  # a GB200's GPU, 1,200 W
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},  # HGX B200, 1,000 W
}


def peak_key(name: str) -> str | None:
    """The first PEAK_TFLOPS key found in the device name as whole words ("NVIDIA RTX A1000" is no A100)."""
    return next((key for key in PEAK_TFLOPS if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", name)),
                None)


def resolve_precision(name: str, device: torch.device) -> str:
    """--precision as the run uses it: 'auto' is bf16 on a GPU that supports it, else fp32; any other name as given."""
    if name != "auto":
        return name
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def configure_math(precision: str, deterministic: bool, device: torch.device) -> str:
    """Set this process's kernel choices for `precision` ('fp32', 'bf16', 'fp16'; resolved) and `deterministic`;
    returns what the start line says about them.

    fp32 on CUDA runs its matmuls as TF32 unless deterministic: Ampere and later do them ~8× faster with a 10-bit
    mantissa, which training tolerates (torch leaves it off by default for matmuls). Deterministic mode trades speed
    for runs that repeat bit for bit on the same hardware: deterministic algorithms (torch raises on an op that has
    none), cuBLAS's fixed-order workspace, cuDNN without autotuning, and SDPA limited to its flash and math kernels
    (the memory-efficient and cuDNN attention backward passes accumulate with atomics)."""
    if deterministic:
        # Read when cuBLAS makes its first handle, so it must be set before the first matmul on the GPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        if device.type == "cuda":
            torch.backends.cuda.enable_mem_efficient_sdp(False)
            torch.backends.cuda.enable_cudnn_sdp(False)
        return "deterministic"
    if device.type == "cuda" and precision == "fp32":
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        return "TF32 matmuls"
    return ""


def peak_flops(device: torch.device, precision: str, tf32: bool) -> float | None:
    """The GPU's dense peak FLOP/s for this precision (None: not a GPU in PEAK_TFLOPS, or the CPU)."""
    if device.type != "cuda":
        return None
    key = peak_key(torch.cuda.get_device_name(device))
    if key is None:
        return None
    return PEAK_TFLOPS[key]["tf32" if precision == "fp32" and tf32 else precision] * 1e12
