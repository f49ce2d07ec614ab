"""A GPT-style causal language model at six sizes, on synthetic tokens or a text file (byte-level).

    hpcjobs submit --profile local trainers.tasks.lm --size tiny --steps 200
    ... trainers.tasks.lm --size small --text data/shakespeare.txt --seq-len 256
    ... --gpus 8 trainers.tasks.lm --size 7b --strategy fsdp      (7b needs GPUs: it is refused without CUDA)

trainers.tasks.lora fine-tunes this model with low-rank adapters and imports its pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainers.task import Task, TaskArgError, TaskArgParser

VOCAB = 256  # bytes: any text file works without a tokenizer


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


def n_params(c: GPTConfig) -> int:
    """The model's parameter count (the output head is tied to the byte embedding: counted once)."""
    d = c.d_model
    return VOCAB * d + c.seq_len * d + c.n_layer * (12 * d * d + 13 * d) + 2 * d


def refuse_without_cuda(prog: str, size: str, need: str) -> None:
    """A size in CUDA_ONLY on a machine without CUDA: one line, what it needs (`need`), the sizes valid here."""
    if size in CUDA_ONLY and not torch.cuda.is_available():
        valid = ", ".join(s for s in SIZES if s not in CUDA_ONLY)
        raise TaskArgError(f"{prog}: --size {size} needs GPUs ({need}) and this machine has no CUDA; valid here: "
                           f"{valid}. HINT: submit it to a GPU profile with --strategy fsdp")


def train_flops_per_token(c: GPTConfig) -> float:
    """Forward + backward FLOPs per token: 6 per weight (the tied embedding counts once, as the output head's
    matmul) plus attention's score and value matmuls, 12·layers·width·context (PaLM's appendix B estimate)."""
    d = c.d_model
    weights = VOCAB * d + c.n_layer * (12 * d * d + 13 * d) + 2 * d
    return 6 * weights + 12 * c.n_layer * d * c.seq_len


class Block(nn.Module):
    # Modules are registered in the order forward uses them: DDP's first (reverse-order) gradient buckets then
    # match the order it rebuilds them in, so a resumed run reduces gradients exactly as the uninterrupted one.
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, 4 * c.d_model)
        self.out = nn.Linear(4 * c.d_model, c.d_model)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, c.d_model)
        self.pos = nn.Parameter(torch.zeros(c.seq_len, c.d_model))
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * c.n_layer) if name.endswith(("proj.weight",
                                                                                           "out.weight")) else 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.T  # tied output head


class Sequences(Dataset[torch.Tensor]):
    """Fixed windows of seq_len + 1 tokens (inputs and shifted targets)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]


def synthetic_tokens(n_seq: int, seq_len: int, seed: int = 1234) -> torch.Tensor:
    """Arithmetic progressions mod 256 with a random start and stride per window: learnable in context."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n_seq, 1), generator=g)
    stride = torch.randint(1, 16, (n_seq, 1), generator=g)
    rows = (start + stride * torch.arange(seq_len + 1)) % VOCAB
    return torch.cat([rows[:, :seq_len].reshape(-1), rows[-1, seq_len:]])  # windows of seq_len+1 overlap by one


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))


def add_data_flags(p: TaskArgParser) -> None:
    """--text, --seq-len, --samples: the flags `datasets` reads (trainers.tasks.lora has them too)."""
    p.add_argument("--text", type=Path, help="train on this text file's bytes instead of synthetic tokens")
    p.add_argument("--seq-len", type=int, help="context length (default: the size's)")
    p.add_argument("--samples", type=int, default=8192, help="synthetic windows in the dataset")


def datasets(prog: str, text: Path | None, samples: int, seq_len: int) -> tuple[str, Callable[[int], Sequences]]:
    """(where the tokens come from, for the task's config; split(part)): part 0 builds the training set, 1 the
    validation set. A --text that is not a file is refused here, before anything trains."""
    if text:
        text = text.expanduser()
        if not text.is_file():
            raise TaskArgError(f"{prog}: --text {text} is not a file; valid: --text PATH of a text file. "
                               "HINT: give the path from the folder the job starts in, or an absolute one")
        path = text

        def split(part: int) -> Sequences:  # the last 5% of the bytes are the validation set
            tokens = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()
            cut = len(tokens) * 19 // 20
            return Sequences(tokens[:cut] if part == 0 else tokens[cut:], seq_len)
        return str(text.resolve()), split

    def synthetic(part: int) -> Sequences:  # other windows of the same kind for validation
        n = samples if part == 0 else max(64, samples // 16)
        return Sequences(synthetic_tokens(n, seq_len, seed=1234 + part), seq_len)
    return f"synthetic:{samples}", synthetic


def make_task(args: list[str]) -> Task:
    p = TaskArgParser(prog="trainers.tasks.lm")  # a bad flag: one line, not a usage block per rank
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    add_data_flags(p)
    p.add_argument("--dropout", type=float, default=0.0)
    ns = p.parse_args(args)
    base = SIZES[ns.size]
    c = GPTConfig(base.n_layer, base.n_head, base.d_model, ns.seq_len or base.seq_len, ns.dropout)
    refuse_without_cuda(p.prog, ns.size, f"about {n_params(c) * 16 / 1e9:.0f} GB of weights, gradients and AdamW "
                                         "state in fp32; with --strategy fsdp that is split across the ranks")
    source, split = datasets(p.prog, ns.text, ns.samples, c.seq_len)
    return Task(name=f"lm-{ns.size}", model=lambda: GPT(c), train_data=lambda: split(0),
                val_data=lambda: split(1), loss=lm_loss,
                config={**asdict(c), "data": source}, tokens_per_sample=c.seq_len,
                flops_per_sample=train_flops_per_token(c) * c.seq_len, defaults={"lr": 1e-3})
