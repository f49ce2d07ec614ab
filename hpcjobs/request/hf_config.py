"""A Hugging Face decoder's `config.json` as the memory plan's Shape (hpcjobs.protocol.planning.memory_plan),
torch-free: the users' own models (Llama, Mistral, Qwen2 and GPT-2 families) get the same plan as the bundled LM,
the same arithmetic over other counts.

What differs from the bundled GPT, counted from what transformers 5.24's model classes save for their backward
(listed with saved_tensors_hooks, one block at a time, fp32, bf16 autocast and bf16 parameters; no KV cache,
use_cache false, as training runs: with one GPT-2 keeps 2·d more a block):
  Llama, Mistral, Qwen2  RMSNorm upcasts its input to fp32 and keeps it with 1/rms (fp32) and the normalized input
           (the stream's dtype); its output is one copy, or under autocast one bf16 cast per matmul that reads it
           (q, k, v after the first norm, gate and up after the second: 5·d). Attention keeps q and its output
           (heads·head_dim each) and k, v (kv_heads·head_dim each: GQA; SDPA takes them without repeat_kv), o_proj
           reads attention's output itself; the SwiGLU MLP keeps gate, up, silu(gate) and their product (4·i).
           Parameters: q, k, v (Qwen2: with biases), o, gate, up, down, two norms; the output head unless tied.
  GPT-2    LayerNorm keeps its input (the stream's dtype) and 2 fp32 statistics; attention keeps 4·d (the fused
           qkv output its q, k, v are views of, and its output); gelu_new's composite tanh keeps 4·i besides
           c_proj's input (5·i; an exact or tanh GELU keeps 2·i). Learned positions: n_positions·d parameters.
  The head: the final norm (as a block's), the logits' fp32 log-softmax (HF's loss upcasts them) over the
           vocabulary: 32K–152K entries a token, the usual out-of-memory cause at long sequences.
bench/hf_memplan.py measures the plan against the peak live tensor bytes of a real training step
(bench/results/hf_memplan.json).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.planning.memory_plan import Saved, Shape

SWIGLU_TYPES = ("llama", "mistral", "qwen2")
GPT2_TYPES = ("gpt2",)
MODEL_TYPES = SWIGLU_TYPES + GPT2_TYPES
GELU_SAVES = {"gelu_new": 5, "gelu": 2, "gelu_pytorch_tanh": 2}
"""GPT-2's activation_function: elements of the MLP's width its fc output, activation and c_proj input keep."""
ENCODERS = ("bert", "roberta", "t5", "bart", "distilbert", "electra", "albert", "xlm-roberta", "deberta", "mt5")
HINT = (f"give a Hugging Face decoder's config.json (model_type one of {', '.join(MODEL_TYPES)}), e.g. the one "
        "saved beside the weights by save_pretrained")


def _refuse(given: str, valid: str) -> UsageError:
    return UsageError(f"--model {given}; valid: {valid}.", HINT)


def _key(cfg: dict[str, Any], path: str, *names: str, default: int | None = None) -> int:
    """The first of `names` the config has, a positive whole number (HF's aliases: hidden_size or n_embd)."""
    for name in names:
        value = cfg.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _refuse(f"{path}: {name} is {value!r}", f"{name} a positive whole number")
            return value
    if default is not None:
        return default
    raise _refuse(f"{path} has no {' or '.join(names)}", f"a {cfg.get('model_type')} config with {names[0]}")


def read_config(path: str) -> dict[str, Any]:
    """The config as a dict, refused in one line when it is missing, not JSON, or not a decoder's."""
    file = Path(path)
    if not file.is_file():
        raise _refuse(f"{path}: no such file", "the path of a config.json")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(f"{path} is not JSON ({e.__class__.__name__}: {e})", "a config.json file") from None
    if not isinstance(cfg, dict):
        raise _refuse(f"{path} holds a JSON {type(cfg).__name__}", "a JSON object (a config.json)")
    kind = cfg.get("model_type")
    archs = " ".join(str(a) for a in cfg.get("architectures") or [])
    if cfg.get("is_encoder_decoder") or kind in ENCODERS or (archs and "CausalLM" not in archs
                                                                 and "LMHeadModel" not in archs):
        raise _refuse(f"{path} is not a decoder's config (model_type {kind!r}, architectures {archs or 'none'})",
                      "a causal language model's config (…ForCausalLM, GPT2LMHeadModel)")
    if kind not in MODEL_TYPES:
        raise _refuse(f"{path} has model_type {kind!r}", f"model_type one of {', '.join(MODEL_TYPES)}")
    return cfg


def swiglu_shape(cfg: dict[str, Any], path: str) -> Shape:
    """Llama, Mistral, Qwen2: GQA attention with rotary positions, SwiGLU MLP, RMSNorm."""
    d = _key(cfg, path, "hidden_size")
    layers = _key(cfg, path, "num_hidden_layers")
    heads = _key(cfg, path, "num_attention_heads")
    kv_heads = _key(cfg, path, "num_key_value_heads", default=heads)
    inner = _key(cfg, path, "intermediate_size")
    vocab = _key(cfg, path, "vocab_size")
    head_dim = _key(cfg, path, "head_dim", default=d // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    qkv_bias = cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias"))
    mlp_bias = bool(cfg.get("mlp_bias"))
    block = (d * (q + 2 * kv) + (q + 2 * kv) * qkv_bias + q * d + d * bool(cfg.get("attention_bias"))
             + 3 * d * inner + (2 * inner + d) * mlp_bias + 2 * d)
    tied = bool(cfg.get("tie_word_embeddings", False))
    params = vocab * d * (1 if tied else 2) + layers * block + d
    cast = params - d - layers * 2 * d - (0 if tied else vocab * d)  # the embedding lookup and norms are not cast
    return Shape(n_layer=layers, n_head=heads, d_model=d, vocab=vocab, params=params, block_params=block,
                 cast_params=cast, block=Saved(fp32=2 * d + 2, stream=2 * d, compute=2 * q + 2 * kv + 4 * inner,
                                               outs=2 * d, cast_outs=5 * d),
                 kept_selective=2 * q + 2 * kv + 2 * d + 2 * inner,  # q k v o gate up down, attention's output
                 head=Saved(fp32=d + 1, stream=d, outs=d, cast_outs=d), logits_peak=True,
                 late_params=0 if tied else vocab * d)


def gpt2_shape(cfg: dict[str, Any], path: str) -> Shape:
    """GPT-2: fused qkv (Conv1D with biases), GELU MLP, LayerNorm, learned positions, tied head."""
    d = _key(cfg, path, "n_embd", "hidden_size")
    layers = _key(cfg, path, "n_layer", "num_hidden_layers")
    heads = _key(cfg, path, "n_head", "num_attention_heads")
    inner = _key(cfg, path, "n_inner", default=4 * d)
    vocab = _key(cfg, path, "vocab_size")
    positions = _key(cfg, path, "n_positions", "max_position_embeddings")
    act = cfg.get("activation_function", "gelu_new")
    if act not in GELU_SAVES:
        raise _refuse(f"{path}: activation_function {act!r}", f"one of {', '.join(GELU_SAVES)}")
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
    params = vocab * d + positions * d + layers * block + 2 * d
    cast = params - positions * d - 2 * d - layers * 4 * d  # positions and LayerNorms are not cast
    return Shape(n_layer=layers, n_head=heads, d_model=d, vocab=vocab, params=params, block_params=block,
                 cast_params=cast, block=Saved(fp32=4, stream=2 * d, compute=4 * d + GELU_SAVES[act] * inner,
                                               outs=2 * d, cast_outs=2 * d),
                 kept_selective=6 * d + inner,  # c_attn, attn c_proj, c_fc, mlp c_proj, attention's output
                 head=Saved(fp32=2, stream=d, outs=d, cast_outs=d), logits_peak=True, late_params=positions * d)


def model_shape(path: str) -> tuple[Shape, dict[str, Any]]:
    """The Shape of the decoder `path` describes, with its config; UsageError (exit 2) in one line otherwise."""
    cfg = read_config(path)
    shape = gpt2_shape(cfg, path) if cfg["model_type"] in GPT2_TYPES else swiglu_shape(cfg, path)
    return shape, cfg


def max_positions(cfg: dict[str, Any]) -> int | None:
    """The longest sequence the config's positions take (GPT-2's learned ones: a hard limit)."""
    value = cfg.get("max_position_embeddings", cfg.get("n_positions"))
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
