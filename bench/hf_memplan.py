"""bench/hf_memplan: the memory plan of a Hugging Face config.json (hpcjobs.request.hf_config) against the peak bytes
the real transformers model holds in a training step on the CPU.

    .venv/bin/python bench/hf_memplan.py
Each case writes a small config.json (Llama with GQA, Qwen2 with its q/k/v biases, Mistral, GPT-2), builds the model
from it with transformers' own class (LlamaForCausalLM(LlamaConfig(...)), ...), and trains two steps as the shared
trainer does (bench/memplan.py's two_steps: trainers.strategy.make, AdamW, clip, zero_grad) with labels = inputs
(HF's own shifted loss), the live tensor bytes counted by bench/memplan.py's LiveBytes dispatch mode. ddp over one
rank (the bare model) in this process; fsdp (FSDP2, as the trainer shards: each decoder layer, then the root) as rank
0 of 2 or 4 under torch's fake process group, alone in a child process (real tensors, collectives that move
nothing). fp32 and bf16 (autocast under ddp, FSDP2's cast under fsdp), with and without activation checkpointing. The
plan is `plan(model_shape(config.json), Setup(..., gpu=False))`: tensors only. Writes bench/results/hf_memplan.json
with each row's phase peaks (two_steps' `phases`: where the peak fell); the target (issue 41) is the plan within ±5%
of each peak.

AdamW is the fused one (two_steps' `fused`), as the trainer makes it on a GPU, the path the plan is for: it updates
each parameter in place and makes no temporaries. On the CPU the trainer's AdamW is the unfused foreach one, whose
whole-list temporaries (+45% of the weights' bytes: llama ddp, its step-2 optimizer phase 22.48 MB against the 20.20
MB of weights, gradients and moments) made the optimizer step the peak of every checkpointed llama row (0.94 then).
The harness also counts the model's weights from the start: before, a model built outside the count had its weights
counted only once an op returned them (the foreach AdamW's in-place updates), so a fused measurement missed them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

RESULTS = Path(__file__).parent / "results" / "hf_memplan.json"
TOLERANCE = 0.05

CONFIGS: dict[str, dict[str, Any]] = {
    # small shapes of each family, GQA where the family has it, vocabularies a few times the width
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 352,
              "vocab_size": 2048, "max_position_embeddings": 256, "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 96,
              "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 256,
              "vocab_size": 3000, "max_position_embeddings": 256, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 128,
                "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
                "intermediate_size": 448, "vocab_size": 1024, "max_position_embeddings": 256,
                "sliding_window": None},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 96, "n_layer": 3, "n_head": 4,
             "vocab_size": 1024, "n_positions": 256, "activation_function": "gelu_new"},
}
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel")}
NO_DROPOUT = {"gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}}


def build(name: str) -> Any:
    """The transformers model of CONFIGS[name], in training mode."""
    import torch
    import transformers

    config_class, model_class = (getattr(transformers, n) for n in CLASSES[name])
    keys = {k: v for k, v in CONFIGS[name].items() if k not in ("model_type", "architectures")}
    torch.manual_seed(0)
    # no KV cache in training (HF's Trainer turns it off under gradient checkpointing): with one, a checkpointed
    # layer's recompute appends to the cache its forward filled (--ac-mode selective then fails in the backward)
    model = model_class(config_class(**keys, **NO_DROPOUT.get(name, {}), use_cache=False))
    return model.train()


def fsdp_worker(name: str, ranks: int, batch: int, seq_len: int, precision: str, ac: str) -> None:
    """Rank 0 of `ranks` under torch's fake process group (alone in its process: the fake group is the default)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    from memplan import two_steps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hpcjobs.protocol.settings.trainconfig import TrainConfig

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    mesh = device_mesh.init_device_mesh("cpu", (ranks,))
    device_mesh.init_device_mesh = lambda *a, **k: mesh  # type: ignore[assignment]
    ctx = types.SimpleNamespace(world_size=ranks, rank=0, device=torch.device("cpu"), is_main=True,
                                adopt=lambda groups: None)
    cfg = TrainConfig(strategy="fsdp", batch_size=batch, activation_checkpointing=bool(ac), ac_mode=ac or "full",
                      meta_init=False)
    data = torch.randint(0, int(CONFIGS[name]["vocab_size"]), (batch, seq_len))
    phases: dict[str, Any] = {}
    peak = two_steps(build(name), ctx, cfg, precision, data, hf_loss, phases, fused=True)
    print("PEAK " + json.dumps({"peak": peak, "phases": phases}), flush=True)


def hf_loss(net: Any, x: Any) -> Any:
    return net(input_ids=x, labels=x).loss


def measured_peak(name: str, strategy: str, ranks: int, batch: int, seq_len: int, precision: str,
                  ac: str) -> tuple[int, dict[str, Any]]:
    """Rank 0's peak live bytes over two steps, with its phases (bench/memplan.py's two_steps): ddp here, fsdp in a
    child process (fsdp_worker)."""
    if strategy == "fsdp":
        argv = [sys.executable, __file__, "--fsdp-worker", name, *map(str, (ranks, batch, seq_len)), precision,
                ac or "none"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PEAK ")), None)
        if line is None:
            raise SystemExit(f"{name} fsdp × {ranks} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        found = json.loads(line.removeprefix("PEAK "))
        return int(found["peak"]), found["phases"]
    import torch
    from memplan import two_steps

    from hpcjobs.protocol.settings.trainconfig import TrainConfig

    ctx = types.SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"), is_main=True,
                                adopt=lambda groups: None)
    cfg = TrainConfig(strategy="ddp", batch_size=batch, activation_checkpointing=bool(ac), ac_mode=ac or "full")
    data = torch.randint(0, int(CONFIGS[name]["vocab_size"]), (batch, seq_len))
    phases: dict[str, Any] = {}
    return two_steps(build(name), ctx, cfg, precision, data, hf_loss, phases, fused=True), phases


def measure(name: str, batch: int = 2, seq_len: int = 64, precision: str = "fp32", ac: str = "",
            strategy: str = "ddp", ranks: int = 1) -> dict[str, Any]:
    """One case: the measured peak of two steps beside the plan's tensors (rank 0, the CPU); `ac`: "" (none),
    "full" or "selective" activation checkpointing of every block."""
    from hpcjobs.protocol.planning.memory_plan import Setup, plan
    from hpcjobs.request.hf_config import model_shape

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(CONFIGS[name]))
        shape, _ = model_shape(str(path))
    counted = sum(p.numel() for p in build(name).parameters())
    measured, phases = measured_peak(name, strategy, ranks, batch, seq_len, precision, ac)
    planned = plan(shape, Setup(strategy=strategy, ranks=ranks, micro_batch=batch, seq_len=seq_len,
                                precision=precision, activation_checkpointing=bool(ac), ac_mode=ac or "full",
                                gpu=False))
    return {"model": name, "strategy": strategy, "ranks": ranks, "batch": batch, "seq_len": seq_len,
            "precision": precision, "activation_checkpointing": bool(ac), "ac_mode": ac or None, "params": counted,
            "params_planned": shape.params, "measured": measured, "planned": planned.tensors,
            "ratio": planned.tensors / measured, "plan": planned.as_dict(), "peak_phase": phases["peak_phase"],
            "phase_peaks": phases["peaks"]}


CASES: list[tuple[str, int, int, str, str, str, int]] = [
    # (model, batch, seq_len, precision, activation checkpointing, strategy, ranks)
    *((name, 2, 64, precision, ac, "ddp", 1) for name in CONFIGS for precision in ("fp32", "bf16")
      for ac in ("", "full", "selective")),
    ("llama", 4, 128, "bf16", "", "ddp", 1), ("qwen2", 1, 256, "fp32", "", "ddp", 1),
    *((name, 2, 64, precision, ac, "fsdp", ranks) for name, ranks, precision in
      (("llama", 2, "bf16"), ("llama", 2, "fp32"), ("qwen2", 4, "fp32"), ("mistral", 2, "bf16"), ("gpt2", 2, "bf16"))
      for ac in ("", "full", "selective")),
]


def main() -> None:
    if sys.argv[1:2] == ["--fsdp-worker"]:
        name, ranks, batch, seq_len, precision, ac = sys.argv[2:8]
        fsdp_worker(name, int(ranks), int(batch), int(seq_len), precision, "" if ac == "none" else ac)
        return
    import torch
    import transformers
    from memplan import report

    torch.set_num_threads(1)
    report(RESULTS, CASES, measure, TOLERANCE, ("model", "strategy", "ranks", "batch", "seq_len", "precision",
                                                 "ac_mode"),
           {"torch": torch.__version__, "transformers": transformers.__version__})


if __name__ == "__main__":
    main()
