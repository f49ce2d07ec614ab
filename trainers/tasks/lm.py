"""A GPT-style causal language model at six sizes, on synthetic tokens or a text file (byte-level).

    hpcjobs submit --profile local trainers.tasks.lm --size tiny --steps 200
    ... trainers.tasks.lm --size small --text data/shakespeare.txt --seq-len 256
    ... --nodes 2 --gpus 8 trainers.tasks.lm --size 7b      (7b needs GPUs: it is refused without CUDA)

1b and 7b start from presets that fit 80 GB GPUs (hpcjobs.protocol.planning.lmsizes.PRESETS: 7b is FSDP with activation
checkpointing) and an LR and warmup for their size; `hpcjobs submit --dry-run` shows the memory plan.

trainers.tasks.lora fine-tunes this model with low-rank adapters and imports its pieces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

# re-exported: trainers.tasks.lora and users' scripts import them from here
from hpcjobs.protocol.planning.lmsizes import (
    CUDA_ONLY,
    SIZES,
    VOCAB,
    GPTConfig,
    n_params,
    size_defaults,
    train_flops_per_token,
)
from hpcjobs.protocol.planning.memory_plan import plan
from hpcjobs.protocol.settings.taskflags import BUNDLED
from trainers.task import Task, TaskArgError

PROG = "trainers.tasks.lm"


def refuse_without_cuda(prog: str, size: str, need: str) -> None:
    """A size in CUDA_ONLY on a machine without CUDA: one line, what it needs (`need`), the sizes valid here."""
    if size in CUDA_ONLY and not torch.cuda.is_available():
        valid = ", ".join(s for s in SIZES if s not in CUDA_ONLY)
        raise TaskArgError(f"{prog}: --size {size} needs GPUs ({need}) and this machine has no CUDA; valid here: "
                           f"{valid}. HINT: submit it to a GPU profile, e.g. "
                           "--nodes 2 --gpus 8 (`hpcjobs submit --dry-run` shows whether it fits)")


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
    """Fixed windows of seq_len + 1 tokens (inputs and shifted targets), as int64 one window at a time: the tokens
    themselves may be a narrower type (a --text file's bytes, memory-mapped)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, source: tuple[str, int, int] | None = None) -> None:
        self.tokens, self.seq_len, self.source = tokens, seq_len, source
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1].long()

    def __reduce__(self) -> tuple[Any, ...]:
        """A loader worker started by spawn or forkserver maps the file again rather than receiving its bytes."""
        if self.source is None:
            return (Sequences, (self.tokens, self.seq_len))
        return (mapped_sequences, (*self.source, self.seq_len))


def text_tokens(path: Path) -> torch.Tensor:
    """The file's bytes as byte-level tokens (uint8), memory-mapped (MAP_PRIVATE: read-only in practice): every rank
    and loader worker of a node shares the page cache's one copy, read as it is touched, where the file was read whole
    and widened to int64 on every rank, for the training and the validation set each (16 bytes of memory a byte of
    text a rank). A tokenizer's dataset would map a uint16 token cache the same way (torch.from_file)."""
    size = path.stat().st_size
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def mapped_sequences(path: str, start: int, stop: int, seq_len: int) -> Sequences:
    return Sequences(text_tokens(Path(path))[start:stop], seq_len, (path, start, stop))


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


def datasets(prog: str, text: Path | None, samples: int, seq_len: int) -> tuple[str, Callable[[int], Sequences]]:
    """(where the tokens come from, for the task's config; split(part)): part 0 builds the training set, 1 the
    validation set. A --text that is not a file is refused here, before anything trains."""
    if text:
        text = text.expanduser()
        if not text.is_file():
            raise TaskArgError(f"{prog}: --text {text} is not a file; valid: --text PATH of a text file. "
                               "HINT: give the path from the folder the job starts in, or an absolute one")
        path = text.resolve()  # what a loader worker maps again, whatever its folder

        def split(part: int) -> Sequences:  # the last 5% of the bytes are the validation set
            size = path.stat().st_size
            cut = size * 19 // 20
            return mapped_sequences(str(path), *((0, cut) if part == 0 else (cut, size)), seq_len)
        return str(text.resolve()), split

    def synthetic(part: int) -> Sequences:  # other windows of the same kind for validation
        n = samples if part == 0 else max(64, samples // 16)
        return Sequences(synthetic_tokens(n, seq_len, seed=1234 + part), seq_len)
    return f"synthetic:{samples}", synthetic


def make_task(args: list[str]) -> Task:
    ns = BUNDLED[PROG].parse(args)  # declared torch-free: `hpcjobs submit` checks the same flags before queueing
    base = SIZES[ns.size]
    c = GPTConfig(base.n_layer, base.n_head, base.d_model, ns.seq_len or base.seq_len, ns.dropout)
    refuse_without_cuda(PROG, ns.size, f"about {n_params(c) * 16 / 1e9:.0f} GB of weights, gradients and AdamW "
                                         "state in fp32; with --strategy fsdp that is split across the ranks")
    source, split = datasets(PROG, ns.text, ns.samples, c.seq_len)
    return Task(name=f"lm-{ns.size}", model=lambda: GPT(c), train_data=lambda: split(0),
                val_data=lambda: split(1), loss=lm_loss,
                config={**asdict(c), "data": source}, tokens_per_sample=c.seq_len,
                flops_per_sample=train_flops_per_token(c) * c.seq_len, defaults=size_defaults(ns.size),
                memory_plan=lambda setup: plan(c, dataclasses.replace(setup, seq_len=c.seq_len)))
