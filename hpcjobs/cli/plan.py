"""`hpcjobs plan --model config.json`: the memory plan per GPU of a user's Hugging Face decoder (Llama, Mistral, Qwen2,
GPT-2 families) before anything is queued, the same arithmetic the bundled LM's plan has
(hpcjobs.protocol.planning.memory_plan over hpcjobs.request.hf_config's Shape): parameters, gradients, AdamW,
activations with the logits, the working buffers, per rank, under the trainer's flags and the profile's GPUs; fits or
not, and the flags that would fit (hpcjobs.request.gpu_fit's suggestions). Without the model at hand: a config.json
is a few hundred bytes, the weights tens of GB. Exit 0 when it fits (or nothing to judge against), 1 when not, 2 on
bad input. Measured against the peak live tensor bytes of transformers' own models in a CPU training step
(bench/results/hf_memplan.json): without activation checkpointing 0.999-1.000 × under ddp, 1.02-1.04 × under fsdp;
with it 0.94-1.06 ×. With `--local-ckpt-every N` the node-local tier's host memory a node too (host_plan: 4 copies of
each rank's state, 12 bytes a parameter, 1/ranks under fsdp), against the profile's mem_per_gpu × the GPUs of a node,
as `submit --dry-run` shows it; a tier that does not fit exits 1 as well."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from hpcjobs.cli import present
from hpcjobs.cli.parser import Parser, command_parser, whole_number

if TYPE_CHECKING:
    from hpcjobs.cli.parser import Subparsers
    from hpcjobs.profiles.cluster_profile import ClusterProfile

TRAINER_FLAGS = ("strategy", "batch_size", "global_batch_size", "grad_accum", "precision", "ac_mode", "ac_every",
                 "local_ckpt_every")
SWITCHES = ("activation_checkpointing", "cpu_offload", "no_reduce_each_micro_batch")
ROWS = (("parameters", "weights"), ("gradients", "gradients"), ("optimizer (AdamW)", "optimizer"),
        ("activations", "activations"), ("buffers: working copies", "working"),
        ("buffers: loss gradients", "transient"), ("headroom", "headroom"))


def add_plan(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "plan", "A Hugging Face model's memory per GPU from its config.json, before anything is "
                       "queued: fits or not, and the flags that would fit.")
    p.add_argument("--model", required=True, metavar="CONFIG_JSON",
                   help="the model's config.json (Llama, Mistral, Qwen2, GPT-2 families)")
    p.add_argument("--profile", help="cluster profile: its gpu_memory and gpus_per_node (a name or a .yaml path)")
    p.add_argument("--nodes", type=whole_number, default=1, help="nodes (default 1)")
    p.add_argument("--gpus", type=whole_number, default=None, help="GPUs per node (default: the profile's, or 1)")
    p.add_argument("--seq-len", type=whole_number, default=None,
                   help="tokens a sample (default 2048, at most the model's max positions)")
    for name in TRAINER_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE",
                       help="as the trainer's flag (docs/reference/trainer-flags.md)")
    for name in SWITCHES:
        p.add_argument("--" + name.replace("_", "-"), dest=name, action="store_true", help="as the trainer's flag")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run_plan)


def trainer_args(ns: argparse.Namespace) -> list[str]:
    """The trainer flags given, as the trainer would read them."""
    given = [w for name in TRAINER_FLAGS if getattr(ns, name) is not None
             for w in ("--" + name.replace("_", "-"), getattr(ns, name))]
    return given + ["--" + name.replace("_", "-") for name in SWITCHES if getattr(ns, name)]


def planned(ns: argparse.Namespace) -> dict[str, Any]:
    """The plan and its verdict as a mapping (what --json prints)."""
    from hpcjobs.profiles.cluster_profile import MAX_NODES, load_profile
    from hpcjobs.protocol.planning.memory_plan import parse_gpu_memory
    from hpcjobs.request.ckpt_window import checkpoint_bytes, window_line
    from hpcjobs.request.gpu_fit import fixes_hint
    from hpcjobs.request.hf_plan import model_job_plan

    profile = load_profile(ns.profile) if ns.profile else None
    gpus = ns.gpus or (profile.gpus_per_node if profile else 1)
    found = model_job_plan(ns.model, trainer_args(ns), ns.nodes * gpus, ns.seq_len)
    shape, setup = found.shape, found.setup
    room = parse_gpu_memory(profile.gpu_memory) if profile and profile.gpu_memory else None
    fits = None if room is None else found.plan.total <= room
    most = min(profile.max_nodes or MAX_NODES, MAX_NODES) if profile else ns.nodes
    hint = (fixes_hint(shape, setup, room, gpus, most, "a smaller --seq-len, or more GPUs")
            if room is not None and not fits else None)
    size = checkpoint_bytes(shape)
    window = window_line(profile, size, f"{ns.model} ({found.model_type})") if profile else None
    return {"model": ns.model, "model_type": found.model_type, "what": found.what(), "checkpoint_bytes": size,
            "checkpoint_warning": window, "parameters": shape.params, "setup": dataclasses.asdict(setup),
            "plan": found.plan.as_dict(), "logits": setup.micro_batch * setup.seq_len * shape.vocab * 4,
            "gpu_memory": room, "profile": profile.name if profile else None, "fits": fits, "hint": hint,
            "local_tier": local_tier(ns, profile, shape.params, setup.strategy, gpus)}


def local_tier(ns: argparse.Namespace, profile: ClusterProfile | None, params: int, strategy: str, gpus: int,
               ) -> dict[str, Any] | None:
    """The node-local tier's host memory a node with `--local-ckpt-every N` (hpcjobs.protocol.planning.host_plan, as
    `submit --dry-run` shows it) against the profile's mem_per_gpu × the GPUs of a node; None with the tier off."""
    from hpcjobs.protocol.planning.host_plan import tier_plan
    from hpcjobs.protocol.settings.trainflags import parse_trainer_args
    from hpcjobs.request.gpu_fit import node_room

    every = parse_trainer_args(trainer_args(ns))[0].local_ckpt_every  # checked by model_job_plan already
    tier = tier_plan(every if isinstance(every, int) else 1, params, strategy, ns.nodes * gpus, gpus)
    if tier is None:
        return None
    room = node_room(profile, gpus) if profile else None
    text = tier.text() if isinstance(every, int) else \
        f"--local-ckpt-every {every}" + "".join(tier.text().partition(":")[1:])
    return {"every": every, "ranks_per_node": tier.ranks_per_node, "state": tier.state, "per_node": tier.per_node,
            "text": text, "node_memory": room[0] if room else None, "node_memory_from": room[1] if room else None,
            "fits": None if room is None else tier.per_node <= room[0]}


def tier_text(tier: dict[str, Any], profile: str | None) -> str:
    """The tier's line, in the words of the dry run's `# node-local tier: …`."""
    from hpcjobs.protocol.planning.host_plan import gib

    if tier["node_memory"] is None:
        why = f"profile {profile} declares no mem_per_gpu" if profile else "no --profile (its mem_per_gpu)"
        return f"node-local tier: {tier['text']}; not checked: {why}"
    verdict = "fits" if tier["fits"] else "does NOT fit" + ("" if isinstance(tier["every"], int) else
                                                             ": auto leaves the tier off")
    return f"node-local tier: {tier['text']} of {gib(tier['node_memory'])} ({tier['node_memory_from']}): {verdict}"


def text(found: dict[str, Any]) -> str:
    from hpcjobs.protocol.planning.memory_plan import GIB

    plan: dict[str, int] = found["plan"]
    lines = [f"memory plan per GPU: {found['what']}"]
    for label, key in ROWS:
        lines.append(f"  {label:<26}{plan[key] / GIB:>8.2f} GiB")
        if key == "activations":
            lines.append(f"  {'  of which logits (fp32)':<26}{found['logits'] / GIB:>8.2f} GiB")
    room = found["gpu_memory"]
    judged = (f" of {room / GIB:.0f} GiB (gpu_memory of profile {found['profile']}): "
              f"{'fits' if found['fits'] else 'does NOT fit'}" if room is not None else
              "; not checked: " + (f"profile {found['profile']} declares no gpu_memory" if found["profile"] else
                                   "no --profile (its gpu_memory)"))
    lines.append(f"  {'total':<26}{plan['total'] / GIB:>8.2f} GiB{judged}")
    if found["local_tier"]:
        lines.append(tier_text(found["local_tier"], found["profile"]))
    if found["hint"]:
        lines.append(f"HINT: {found['hint']}")
    if found["checkpoint_warning"]:
        lines.append(f"warning: {found['checkpoint_warning']}")
    return "\n".join(lines)


def run_plan(ns: argparse.Namespace) -> int:
    found = planned(ns)
    if ns.json:
        present.print_json(found)
    else:
        print(text(found))
    tier = found["local_tier"] or {}
    return 1 if found["fits"] is False or (tier.get("fits") is False and isinstance(tier["every"], int)) else 0

