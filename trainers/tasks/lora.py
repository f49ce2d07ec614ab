"""LoRA fine-tuning of trainers.tasks.lm's GPT, in plain torch: the base weights are frozen and each adapted Linear of
every block learns a low-rank update, y = W·x + B·A·dropout(x)·alpha/rank (Hu et al. 2021, arXiv:2106.09685).

    hpcjobs submit --profile local --run-dir runs/base trainers.tasks.lm --size tiny --steps 200
    hpcjobs export runs/base -o base.pt
    hpcjobs submit --profile local trainers.tasks.lora --base base.pt --text data/shakespeare.txt --steps 100

--base takes a file from `hpcjobs export` (.pt or .safetensors) of an lm run of the same --size and --seq-len; without
it the base is lm's GPT at random initialisation from --base-seed (an example that needs no earlier run).

Checkpoints hold only what trains (Task.save_frozen=False): the adapters, a few MB instead of the whole model. The
frozen weights are rebuilt by model() on every start, identically on every rank: read from --base (whose sha256 is
in the task's config, so a resume against another file is refused), or drawn from --base-seed in an RNG of their
own. The trainer's --seed then decides only the adapters' initialisation, and a seed sweep varies nothing else.

For inference, merged_state_dict(model) folds the adapters into the base weights and gives a plain GPT state_dict
(`lm.GPT(config).load_state_dict(...)`); for an export that holds only the adapters, build the model first:
`m = make_task(SAME_FLAGS).model(); m.load_state_dict(adapters, strict=False); merged_state_dict(m)`.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from hpcjobs.protocol.settings.taskflags import BUNDLED, LORA_TARGETS
from trainers.task import Task, TaskArgError
from trainers.tasks.lm import (
    GPT,
    SIZES,
    GPTConfig,
    datasets,
    lm_loss,
    n_params,
    refuse_without_cuda,
    train_flops_per_token,
)

PROG = "trainers.tasks.lora"
TARGETS = LORA_TARGETS  # the Linear layers of a block, by attribute name: what --targets may name
FORMATS = (".pt", ".pth", ".safetensors")


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update: base(x) + (dropout(x) @ Aᵀ @ Bᵀ)·alpha/rank. A starts
    Kaiming-uniform (as nn.Linear's and peft's), B at zero: the wrapped layer first computes exactly the base's."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=w.device, dtype=w.dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scale = alpha / rank
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.drop(x) @ self.lora_A.T @ self.lora_B.T) * self.scale

    def delta(self) -> torch.Tensor:
        """The update to the base weight: B·A·alpha/rank."""
        return (self.lora_B @ self.lora_A) * self.scale


def adapt(model: GPT, targets: tuple[str, ...], rank: int, alpha: float, dropout: float) -> GPT:
    """Freeze every parameter of `model`, then wrap the `targets` Linear layers of each block in a LoRALinear."""
    model.requires_grad_(False)
    for block in model.blocks:
        for name in targets:
            setattr(block, name, LoRALinear(getattr(block, name), rank, alpha, dropout))
    return model


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A plain GPT state_dict (trainers.tasks.lm's keys), each adapter folded into its base weight: W + B·A·scale."""
    model = getattr(model, "module", model)  # unwrap DDP
    adapters = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            owner, _, leaf = key.rpartition(".")
            if owner in adapters:  # lora_A, lora_B
                continue
            layer = owner.removesuffix(".base")
            if layer != owner and layer in adapters:
                out[f"{layer}.{leaf}"] = value + adapters[layer].delta() if leaf == "weight" else value.clone()
            else:
                out[key] = value.clone()
    return out


def base_shapes(c: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The keys and shapes a --base file must have: GPT(c)'s state_dict, built on the meta device (no memory)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in GPT(c).state_dict().items()}


def read_base(path: Path, shapes_only: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a .pt/.pth (torch.save of a dict) or .safetensors file. shapes_only: memory-mapped or lazy,
    for checking keys and shapes without reading the weights (safetensors: empty meta tensors of the right shape)."""
    if path.suffix == ".safetensors":
        try:
            from safetensors import SafetensorError, safe_open
            from safetensors.torch import load_file
        except ImportError:
            raise TaskArgError(f"{PROG}: --base {path} is a .safetensors file and the safetensors package is missing; "
                               "valid: a .pt file, or safetensors installed. HINT: pip install "
                               "safetensors, or export the base with -o base.pt") from None
        try:
            if not shapes_only:
                return load_file(str(path), device="cpu")
            with safe_open(str(path), framework="pt") as f:
                return {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
        except SafetensorError as e:
            raise ValueError(str(e)) from None
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=shapes_only)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"it holds a {type(state).__name__}, not a dict of tensors")
    return state


def check_base(path: Path, c: GPTConfig, size: str) -> str:
    """Refuse a --base that cannot be a GPT of this size, in one line; return the file's sha256."""
    given = f"--base {path}"
    hint = (f"HINT: export the base from a trainers.tasks.lm run with --size {size}"
            f"{f' --seq-len {c.seq_len}' if c.seq_len != SIZES[size].seq_len else ''}: hpcjobs export RUN -o base.pt")
    if path.suffix not in FORMATS:
        raise TaskArgError(f"{PROG}: {given}: the suffix {path.suffix or '(none)'} is not a format; valid: "
                           f"{', '.join(FORMATS)}. {hint}")
    if not path.is_file():
        raise TaskArgError(f"{PROG}: {given} is not a file; valid: --base PATH of a file from `hpcjobs export`. "
                           "HINT: give the path from the folder the job starts in, or an absolute one")
    try:
        got = {k: tuple(v.shape) for k, v in read_base(path, shapes_only=True).items()}
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        why = " ".join(str(e).split())[:200]
        raise TaskArgError(f"{PROG}: {given} cannot be read ({type(e).__name__}: {why}); valid: a .pt or "
                           f".safetensors file from `hpcjobs export`. {hint}") from None
    want = base_shapes(c)
    differ = [*(f"{k} is {list(got[k])}, not {list(v)}" for k, v in want.items() if k in got and got[k] != v),
              *(f"missing {k}" for k in want if k not in got), *(f"unexpected {k}" for k in got if k not in want)]
    if differ:
        more = f" (+{len(differ) - 3} more)" if len(differ) > 3 else ""
        raise TaskArgError(f"{PROG}: {given} is not a GPT of --size {size} with context {c.seq_len}: "
                           f"{'; '.join(differ[:3])}{more}; valid: lm's GPT state_dict keys and shapes. {hint}")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def base_model(c: GPTConfig, base: Path | None, base_seed: int) -> GPT:
    """The frozen base, identical on every rank and every start (the checkpoints do not hold it): from the file, or
    drawn from base_seed in a forked RNG, so the trainer's RNG (seeded from --seed) still initialises the adapters."""
    if base is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base_seed)
            return GPT(c)
    with torch.device("meta"):  # no random initialisation to overwrite, no second copy of the weights
        model = GPT(c)
    if torch.get_default_device().type == "meta":  # built on the meta device (--meta-init): rank 0 sends the weights
        return model
    model.load_state_dict({k: v.float().contiguous() for k, v in read_base(base).items()}, assign=True)
    return model


def make_task(args: list[str]) -> Task:
    ns = BUNDLED[PROG].parse(args)  # declared torch-free: `hpcjobs submit` checks the same flags before queueing
    size = SIZES[ns.size]
    c = GPTConfig(size.n_layer, size.n_head, size.d_model, ns.seq_len or size.seq_len)
    refuse_without_cuda(PROG, ns.size, f"about {n_params(c) * 4 / 1e9:.0f} GB of frozen fp32 weights on each rank; "
                                       "with --strategy fsdp that is split across the ranks")
    targets = tuple(dict.fromkeys(t.strip() for t in ns.targets.split(",")))  # each once, in the order given
    base = ns.base.expanduser() if ns.base else None
    sha256 = check_base(base, c, ns.size) if base else None
    source, split = datasets(PROG, ns.text, ns.samples, c.seq_len)
    d = c.d_model
    shape = {"qkv": (d, 3 * d), "proj": (d, d), "fc": (d, 4 * d), "out": (4 * d, d)}  # (in, out) of each target
    adapters = c.n_layer * sum(ns.rank * sum(shape[t]) for t in targets)
    # lm's estimate less the weight gradients of the frozen weights (2 of its 6 FLOPs per weight), plus the adapters'.
    attention = 12 * c.n_layer * d * c.seq_len
    frozen = (train_flops_per_token(c) - attention) / 6
    flops_per_token = 4 * frozen + attention + 6 * adapters
    rank, alpha, dropout, base_seed = ns.rank, ns.alpha, ns.lora_dropout, ns.base_seed

    def model() -> GPT:
        return adapt(base_model(c, base, base_seed), targets, rank, alpha, dropout)
    return Task(name=f"lora-{ns.size}", model=model, train_data=lambda: split(0), val_data=lambda: split(1),
                loss=lm_loss,
                config={**asdict(c), "rank": rank, "alpha": alpha, "targets": ",".join(targets),
                        "lora_dropout": dropout, "adapter_params": adapters, "base_sha256": sha256,
                        "base_bytes": base.stat().st_size if base else None,
                        "base_seed": None if base else base_seed, "data": source},
                tokens_per_sample=c.seq_len, flops_per_sample=flops_per_token * c.seq_len,
                defaults=BUNDLED[PROG].defaults(ns), save_frozen=False)
