"""Can the stop checkpoint commit inside the preemption warning? Said at submit, in one line, before the first
preemption shows it: a stop save that outlasts `preemption.seconds_before` is killed half-written, and the requeue
resumes from the last periodic checkpoint (goodput says so only afterwards).

The stop checkpoint holds the model's fp32 weights and both AdamW moments, 12 bytes a parameter (the memory plan's
weights and optimizer, summed over the ranks: the same bytes sharded or not); RNG states, the scheduler and the data
position are kilobytes. Written at the profile's `storage.write_gb_per_s` (all ranks together), after the ranks
agree on the stop (about a second, stop_check_every) and finish their step: STOP_MARGIN_S. A 70B model
(Llama-2-70B: 0.83 TB) commits in 120 s only above ~7.9 GB/s (the margin taken); the bundled 7b (77 GB) needs
~0.7 GB/s. Torch-free, reads only."""

from __future__ import annotations

import math

from hpcjobs.profiles.cluster_profile import ClusterProfile
from hpcjobs.profiles.storage import parse_rate
from hpcjobs.protocol.planning.lmsizes import LM_TASK, GPTConfig
from hpcjobs.protocol.planning.memory_plan import Plan, Setup, Shape, plan

STOP_MARGIN_S = 15
"""Seconds of the warning spent before the save starts (the stop agreed on, the step finished) and after it (the
commit's rename and fsync)."""
ROUND_S = 30
"""A seconds_before asked for is rounded up to this."""


def checkpoint_bytes(shape: GPTConfig | Shape) -> int:
    """The stop checkpoint's bytes: the plan's weights and AdamW state of one unsharded rank."""
    whole: Plan = plan(shape, Setup(strategy="ddp", ranks=1, micro_batch=1, seq_len=1, gpu=False))
    return whole.weights + whole.optimizer


def window_line(profile: ClusterProfile, size: int, what: str) -> str | None:
    """One line when `size` bytes cannot be written within the profile's warning; None when they can or the profile
    gives no write rate."""
    if profile.storage.write_gb_per_s is None:
        return None
    rate = parse_rate(profile.storage.write_gb_per_s)
    save_s = size / (rate * 1e9)
    warn = profile.preemption.seconds_before
    if save_s + STOP_MARGIN_S <= warn:
        return None
    needed = math.ceil((save_s + STOP_MARGIN_S) / ROUND_S) * ROUND_S
    faster = (size / 1e9) / max(warn - STOP_MARGIN_S, 1)
    return (f"the stop checkpoint of {what} is about {size / 1e9:.0f} GB: at {rate:g} GB/s "
            f"(storage.write_gb_per_s of profile {profile.name}) it takes ~{save_s:.0f} s, more than the "
            f"{warn} s warning (preemption.seconds_before) leaves, so a preemption kills the save and the requeue "
            f"resumes from the last periodic checkpoint. HINT: preemption.seconds_before {needed} or more in "
            f"{profile.source} (if the site's warning allows), or storage writing {faster:.1f} GB/s; otherwise "
            "--ckpt-every bounds what a preemption loses.")


def submit_window_line(profile: ClusterProfile, target: str, tasks_args: list[tuple[str, ...]],
                       ranks: int) -> str | None:
    """The line for a job of the bundled LM task (its largest point); None for any other entry, whose model only
    the node knows (unless `--model config.json` names it: hpcjobs.request.hf_plan.model_window_line)."""
    from hpcjobs.request.gpu_fit import job_plan

    found = [p for p in (job_plan(target, args, ranks) for args in tasks_args) if p is not None]
    if not found:
        return None
    sizes = [(checkpoint_bytes(p.config), p) for p in found]
    size, biggest = max(sizes, key=lambda s: s[0])
    return window_line(profile, size, f"{LM_TASK} --size {biggest.size}")
