"""A job's memory plan for a Hugging Face model (`--model config.json`): hpcjobs.request.hf_config's Shape under the
trainer's flags, the same plan the bundled LM's job gets (hpcjobs.request.gpu_fit). Its callers: `hpcjobs plan`,
and, when `--model` is given, `submit --dry-run`'s memory line (and its `--json` record's `model_plan`), `doctor`'s
memory row, and submit's checkpoint-window line (hpcjobs.request.ckpt_window: the model's stop checkpoint against the
preemption warning). Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpcjobs.profiles.cluster_profile import ClusterProfile
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.planning.memory_plan import GIB, Plan, Setup, Shape, parse_gpu_memory, plan
from hpcjobs.protocol.settings.trainflags import ConfigError, parse_trainer_args
from hpcjobs.request.checks import Check, Result
from hpcjobs.request.ckpt_window import checkpoint_bytes, window_line
from hpcjobs.request.gpu_fit import setup_of
from hpcjobs.request.hf_config import max_positions, model_shape

DEFAULT_SEQ_LEN = 2048
"""Tokens a sample unless `--seq-len` says (or fewer, where the model's positions end sooner)."""


@dataclass(frozen=True)
class ModelPlan:
    model: str
    model_type: str
    shape: Shape
    setup: Setup
    plan: Plan

    def what(self) -> str:
        """The model and the settings, for a person."""
        m, s = self.shape, self.setup
        params = f"{m.params / 1e9:.2f}B" if m.params >= 1e9 else f"{m.params / 1e6:.1f}M"
        return (f"{self.model_type} ({params} parameters, {m.n_layer} layers, width {m.d_model}, vocabulary "
                f"{m.vocab}), {s.strategy} over {s.ranks} rank{'s' * (s.ranks != 1)}, micro-batch {s.micro_batch} "
                f"× {s.seq_len} tokens, {s.precision}"
                f"{f', activation checkpointing ({s.ac_mode})' if s.activation_checkpointing else ''}"
                f"{f', grad-accum {s.grad_accum}' if s.grad_accum > 1 else ''}")


def model_job_plan(model: str, trainer_args: Sequence[str], ranks: int, seq_len: int | None = None) -> ModelPlan:
    """The plan of `model` (a config.json) under the trainer's flags in `trainer_args` over `ranks` GPUs; bad input
    raises UsageError in one line."""
    shape, cfg = model_shape(model)
    longest = max_positions(cfg)
    fallback = min(DEFAULT_SEQ_LEN, longest or DEFAULT_SEQ_LEN)
    seq = fallback if seq_len is None else seq_len
    if seq < 1 or longest and seq > longest:
        raise UsageError(f"--seq-len {seq}; valid: 1 to {longest or 'any'} (max positions of {model}).",
                         f"e.g. --seq-len {fallback}")
    try:
        train, _ = parse_trainer_args(list(trainer_args))
        setup = setup_of(train, ranks, train.micro_batch(ranks), seq)
    except ConfigError as e:  # its own line: given, valid, HINT
        raise UsageError(str(e)) from None
    except ValueError as e:  # a batch that does not split over the ranks or micro-batches
        raise UsageError(f"{e}; valid: a batch that divides evenly.", "`hpcjobs plan --help` lists the flags") from None
    return ModelPlan(model, cfg["model_type"], shape, setup, plan(shape, setup))


def entry_plan(model: str, args: Sequence[str], ranks: int) -> ModelPlan:
    """The plan with an entry's arguments: the shared trainer's flags among them (its defaults where there are
    none, or where a script's own flags are not the trainer's) and a `--seq-len` if one is given."""
    from hpcjobs.request.gpu_fit import task_flag

    seq = task_flag(list(args), "--seq-len")
    try:
        parse_trainer_args(list(args))
    except ConfigError:
        args = ()
    return model_job_plan(model, args, ranks, int(seq) if seq and seq.isdigit() else None)


def model_plan_line(profile: ClusterProfile, model: str, args: Sequence[str], ranks: int) -> str:
    """The dry run's line about memory for `--model`."""
    found = entry_plan(model, args, ranks)
    head = f"# memory plan per GPU (--model {model}): {found.what()}: {found.plan.text()}"
    if profile.gpu_memory is None:
        return f"{head}; not checked: profile {profile.name} declares no gpu_memory (e.g. gpu_memory: 80GB)"
    room = parse_gpu_memory(profile.gpu_memory)
    return f"{head} of {room / GIB:.0f} GiB (gpu_memory of profile {profile.name}): " + (
        "fits" if found.plan.total <= room else "does NOT fit (`hpcjobs plan --model` names the flags that would)")


def model_doctor_check(profile: ClusterProfile, model: str, args: Sequence[str], ranks: int) -> Check:
    """`hpcjobs doctor --model`'s row: the plan against gpu_memory."""
    found = entry_plan(model, args, ranks)
    need = f"{found.plan.total / GIB:.1f} GiB a GPU for {found.what()}"
    if profile.gpu_memory is None:
        return Check("memory plan", Result.SKIP, f"{need}; not checked: profile {profile.name} declares no "
                     "gpu_memory", "add e.g. gpu_memory: 80GB to the profile")
    room = parse_gpu_memory(profile.gpu_memory)
    if found.plan.total > room:
        return Check("memory plan", Result.FAIL, f"{need}, over the {room / GIB:.0f} GiB of gpu_memory",
                     f"`hpcjobs plan --model {model}` with the same flags names the flags that would fit")
    return Check("memory plan", Result.PASS, f"{need}, of {room / GIB:.0f} GiB (gpu_memory)")


def model_plan_record(profile: ClusterProfile, model: str, args: Sequence[str], ranks: int) -> dict[str, Any]:
    """`submit --dry-run --json`'s `model_plan`: what the text dry run's line says, in bytes, with the verdict
    against the profile's gpu_memory (None: not declared) and the stop checkpoint's size and window line."""
    found = entry_plan(model, args, ranks)
    room = parse_gpu_memory(profile.gpu_memory) if profile.gpu_memory is not None else None
    size = checkpoint_bytes(found.shape)
    return {"model": model, "model_type": found.model_type, "what": found.what(), "parameters": found.shape.params,
            "plan": found.plan.as_dict(), "gpu_memory": room,
            "fits": None if room is None else found.plan.total <= room, "checkpoint_bytes": size,
            "checkpoint_warning": model_window(profile, found)}


def model_window(profile: ClusterProfile, found: ModelPlan) -> str | None:
    """The checkpoint-window line (hpcjobs.request.ckpt_window) for the model's stop checkpoint."""
    return window_line(profile, checkpoint_bytes(found.shape), f"{found.model} ({found.model_type})")


def model_window_line(profile: ClusterProfile, model: str, args: Sequence[str], ranks: int) -> str | None:
    """Submit's warning for `--model`: its stop checkpoint cannot commit within preemption.seconds_before at the
    profile's storage.write_gb_per_s; None when it can or no rate is known."""
    return model_window(profile, entry_plan(model, args, ranks))
