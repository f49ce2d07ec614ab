"""The bundled language model's sizes and their preset trainer settings, torch-free: the node side builds the model
from them (trainers.tasks.lm), the submit side plans its memory from them (hpcjobs.request.gpu_fit) without importing
torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VOCAB = 256  # bytes: any text file works without a tokenizer
LM_TASK = "trainers.tasks.lm"
"""The bundled task these shapes are the model of (the submit side plans only its memory)."""


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block."""
    d_model: int
    """Width of the residual stream."""
    seq_len: int
    """Context length in tokens."""
    dropout: float = 0.0
    """Dropout on attention output and MLP (0 for speed; > 0 exercises the RNG state on resume)."""


SIZES = {
    "tiny": GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=64),
    "small": GPTConfig(n_layer=4, n_head=4, d_model=128, seq_len=128),
    "medium": GPTConfig(n_layer=8, n_head=8, d_model=512, seq_len=256),
    "large": GPTConfig(n_layer=12, n_head=12, d_model=768, seq_len=512),
    # ≈1.21B parameters (n_params): 24 blocks × 12·2048² = 1.208B, + 2048·2048 positions, 256·2048 byte embeddings,
    # biases and norms. Runs on the CPU too (slowly: fp32 weights, gradients and AdamW state are ~19 GB).
    "1b": GPTConfig(n_layer=24, n_head=16, d_model=2048, seq_len=2048),
    # ≈6.45B parameters: LLaMA-7B's shape (32 blocks, width 4096, 32 heads, context 2048) with this GPT's GELU MLP
    # and a 256-byte vocabulary: 32 × 12·4096² = 6.442B, + 4096·2048 positions + 256·4096 byte embeddings + biases.
    "7b": GPTConfig(n_layer=32, n_head=32, d_model=4096, seq_len=2048),
}
CUDA_ONLY = ("7b",)
"""Sizes refused on a machine without CUDA (make_task says so in one line, before anything is built)."""

BASE_DEFAULTS: dict[str, Any] = {"lr": 1e-3}
"""Every size's trainer settings unless PRESETS says otherwise (flags given win over both)."""
PRESETS: dict[str, dict[str, Any]] = {
    # Per-GPU peak under hpcjobs.protocol.planning.memory_plan at batch 8 × 2048 in bf16 under DDP on 8 GPUs: 13.5 GiB
    # of fp32 weights and AdamW state + 4.5 GiB of DDP's gradient buckets + 28.7 GiB of activations (38 bytes per
    # token and width a block) + 2.3 GiB of autocast's weight copies: 49.1 GiB of tensors, 55.5 GiB with the
    # headroom, of 80. The LR of GPT-3's 1.3B (2e-4) raised a
    # little for this smaller model, with a warmup: 1e-3 without one spikes the loss at this size.
    "1b": {"lr": 3e-4, "warmup_steps": 100},
    # 103 GB of state does not fit one GPU: FSDP shards it (6.4 GB a rank on 2×8 GPUs, 12.9 on 8). Without
    # activation checkpointing batch 8 × 2048 keeps 73 GB of activations a GPU (34 bytes per token and width a
    # block in bf16 × 32 blocks): with it, 4.3 GB of block inputs + one block recomputed (2.3 GB): 12.8 GiB of
    # tensors a GPU on 2×8 (12.6 measured under fake tensors, bench/results/memplan.json), 17.3 on 8. LLaMA-7B's
    # LR was 3e-4 at a 4M-token batch; this batch is 16× smaller (2×8 GPUs × 8 × 2048), so half that, warmed up.
    "7b": {"strategy": "fsdp", "activation_checkpointing": True, "batch_size": 8, "lr": 1.5e-4,
           "warmup_steps": 200},
}
"""Trainer settings per size (Task.defaults) that fit the size's documented command on 80 GB GPUs under the memory
plan: `--gpus 8 trainers.tasks.lm --size 1b` and `--nodes 2 --gpus 8 trainers.tasks.lm --size 7b`."""


def size_defaults(size: str) -> dict[str, Any]:
    """The trainer settings a size starts from (the task's defaults; flags given win)."""
    return {**BASE_DEFAULTS, **PRESETS.get(size, {})}


def block_params(c: GPTConfig) -> int:
    """One block's parameters: qkv, proj, fc and out matrices (12·d²) with their biases and two LayerNorms (13·d)."""
    return 12 * c.d_model * c.d_model + 13 * c.d_model


def n_params(c: GPTConfig) -> int:
    """The model's parameter count (the output head is tied to the byte embedding: counted once)."""
    d = c.d_model
    return VOCAB * d + c.seq_len * d + c.n_layer * block_params(c) + 2 * d


def train_flops_per_token(c: GPTConfig) -> float:
    """Forward + backward FLOPs per token: 6 per weight (the tied embedding counts once, as the output head's
    matmul) plus attention's score and value matmuls, 12·layers·width·context (PaLM's appendix B estimate)."""
    d = c.d_model
    weights = VOCAB * d + c.n_layer * block_params(c) + 2 * d
    return 6 * weights + 12 * c.n_layer * d * c.seq_len
