"""--fp8: float8 training of the model's linear layers with torchao (an optional extra: pip install torchao).

torchao's float8 swaps each chosen nn.Linear for a Float8Linear whose matmuls run in float8 with a dynamic scale per
tensor, on GPUs whose tensor cores have float8 (compute capability 8.9 and up: L4/L40S, H100/H200, B200); under
--strategy fsdp the parameters are also all-gathered in float8 (half the bytes of bf16). torchtitan measured ~1.3-1.5×
the bf16 throughput on Llama 3 8B on H100s with it. The conversion comes first, before activation checkpointing,
compile and sharding (torchtitan's order), and works on the meta device (trainers.strategy.build_model).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from torch import nn

from hpcjobs.protocol.settings.trainconfig import TrainConfig

MIN_CAPABILITY = (8, 9)
"""The first compute capability with float8 tensor cores (Ada); Hopper is 9.0, Blackwell 10.0."""
ALIGN = 16
"""float8 matmuls (torch._scaled_mm) need both dimensions of a weight divisible by 16."""


def unavailable(device: torch.device) -> str | None:
    """Why --fp8 cannot run on this rank (None: it can)."""
    if device.type != "cuda":
        return "a rank without a GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{name} (compute capability {capability[0]}.{capability[1]}: no float8 tensor cores)"
    if importlib.util.find_spec("torchao") is None:
        return "a rank without the torchao package"
    return None


def refusal(why: str) -> str:
    return (f"--fp8 on {why}; valid: --fp8 on GPUs with float8 tensor cores (H100/H200-class, compute capability "
            "8.9+) with torchao installed. HINT: pip install torchao on the nodes' Python, or drop --fp8")


def convertible(module: nn.Module, fqn: str) -> bool:
    """A linear layer whose weight float8 matmuls can take (both dimensions multiples of 16)."""
    return (isinstance(module, nn.Linear) and module.in_features % ALIGN == 0
            and module.out_features % ALIGN == 0)


def convert(model: nn.Module, cfg: TrainConfig) -> int:
    """Swap the model's convertible linear layers for torchao's Float8Linear in place; returns how many."""
    float8 = importlib.import_module("torchao.float8")
    chosen = sum(convertible(m, n) for n, m in model.named_modules())
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.strategy == "fsdp")
    float8.convert_to_float8_training(model, config=config, module_filter_fn=convertible)
    return chosen
