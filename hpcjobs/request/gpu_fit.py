"""Will the job fit its GPUs? The memory plan (hpcjobs.protocol.planning.memory_plan) of a job of the bundled LM task,
from its size's shapes and presets (hpcjobs.protocol.planning.lmsizes), its trainer flags and its world, against the
profile's `gpu_memory`. `submit --dry-run` shows it; build_spec refuses, before anything is queued, a job that will not
fit. A task whose shapes only the node knows (a user's own) gets no plan and is never refused here.
With `--local-ckpt-every N` (or `auto`, the default) the node-local tier's host memory
(hpcjobs.protocol.planning.host_plan: 4 copies of each rank's state a node) is checked the same way against the
node's memory: the profile's mem_per_gpu × the GPUs of a node (what Slurm's cgroup allows the job, /dev/shm's pages
included), or for `local` the size of the tier's folder (/dev/shm's tmpfs: half the machine's memory by default; the
local backend's check passes it); neither known: not checked. `auto` that does not fit is not refused: the tier
is then off."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from hpcjobs.profiles.cluster_profile import ClusterProfile
from hpcjobs.profiles.slurmtime import parse_mem_mb
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.planning.host_plan import TierPlan, gib, tier_plan
from hpcjobs.protocol.planning.lmsizes import LM_TASK, SIZES, GPTConfig, n_params, size_defaults
from hpcjobs.protocol.planning.memory_plan import GIB, Plan, Setup, Shape, parse_gpu_memory, plan, suggestions
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError, parse_trainer_args, task_args_of
from hpcjobs.protocol.tierfiles import DIR_ENV as TIER_DIR_ENV
from hpcjobs.request.checks import Check, Result


@dataclass(frozen=True)
class JobPlan:
    """A job's plan: what it is of (`what`, for a person) and its bytes per GPU."""

    size: str
    config: GPTConfig
    setup: Setup
    plan: Plan

    def what(self) -> str:
        s = self.setup
        count = n_params(self.config)
        params = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
        return (f"{LM_TASK} --size {self.size} ({params} parameters), {s.strategy} over "
                f"{s.ranks} rank{'s' * (s.ranks != 1)}, micro-batch {s.micro_batch} × {s.seq_len} tokens, "
                f"{s.precision}{f', activation checkpointing ({s.ac_mode})' if s.activation_checkpointing else ''}"
                f"{f', grad-accum {s.grad_accum}' if s.grad_accum > 1 else ''}")


def task_flag(args: list[str], flag: str) -> str | None:
    """The last value of a task flag (`--size X` or `--size=X`), as the task's argparse reads it."""
    value = None
    for i, word in enumerate(args):
        if word == flag and i + 1 < len(args):
            value = args[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def job_plan(target: str, args: tuple[str, ...] | list[str], ranks: int) -> JobPlan | None:
    """The plan for `target` with `args` over `ranks` GPUs; None where the submit side cannot know the shapes (not
    the bundled LM task, a size or flag the node will refuse anyway, a batch it splits unevenly)."""
    if target != LM_TASK:
        return None
    try:
        rest = task_args_of(list(args))
        size = task_flag(rest, "--size") or "tiny"
        seq = task_flag(rest, "--seq-len")
        if size not in SIZES or (seq is not None and not seq.isdigit()):
            return None
        cfg, _ = parse_trainer_args(list(args), size_defaults(size))
        micro = cfg.micro_batch(ranks)
    except (ConfigError, ValueError):
        return None
    c = dataclasses.replace(SIZES[size], seq_len=int(seq) if seq else SIZES[size].seq_len)
    setup = setup_of(cfg, ranks, micro, c.seq_len)
    return JobPlan(size, c, setup, plan(c, setup))


def setup_of(cfg: TrainConfig, ranks: int, micro: int, seq_len: int) -> Setup:
    """The plan's settings from the trainer's (on GPUs: auto precision is bf16)."""
    return Setup(strategy=cfg.strategy, ranks=ranks, micro_batch=micro, seq_len=seq_len,
                 precision="bf16" if cfg.precision == "auto" else cfg.precision,
                 activation_checkpointing=cfg.checkpoints_every_block(), ac_mode=cfg.ac_mode,
                 grad_accum=cfg.grad_accum,
                 reduce_each_micro_batch=cfg.reduce_each_micro_batch, cpu_offload=cfg.cpu_offload)


def fixes_hint(c: GPTConfig | Shape, setup: Setup, room: int, gpus: int, most_nodes: int,
               otherwise: str = "a smaller --size or --seq-len") -> str:
    """The flags that would make the plan fit `room` bytes a GPU, as a HINT."""
    fixes = suggestions(c, setup, room, gpus, most_nodes)
    return "; or ".join(fixes) + " would fit" if fixes else f"no flag alone makes it fit: {otherwise}"


def plan_line(profile: ClusterProfile, target: str, args: tuple[str, ...], ranks: int, gpus: int = 0,
              folder: str | None = None) -> str:
    """The dry run's line about memory (and, with the node-local tier on, a second line about its host memory;
    `gpus`: ranks a node, 0 for all `ranks` on one; `folder`: node_room's)."""
    found = job_plan(target, args, ranks)
    tier = tier_of(target, args, ranks, gpus or ranks)
    if tier is None:
        return gpu_line(profile, target, found)
    room = node_room(profile, gpus or ranks, folder)
    verdict = (f"; not checked here: profile {profile.name} declares no mem_per_gpu (a local job is checked against "
               "its tier folder's size)" if room is None else
               f" of {gib(room[0])} ({room[1]}): {'fits' if tier.per_node <= room[0] else 'does NOT fit'}"
               + ("" if tier.per_node <= room[0] or tier.every != "auto" else ": auto leaves the tier off"))
    return f"{gpu_line(profile, target, found)}\n# node-local tier: {tier.text()}{verdict}"


def gpu_line(profile: ClusterProfile, target: str, found: JobPlan | None) -> str:
    """The dry run's line about GPU memory."""
    if found is None:
        return (f"# memory plan: none: {target}'s model is known on the node only (the plan covers {LM_TASK}); "
                "not checked")
    head = f"# memory plan per GPU: {found.what()}: {found.plan.text()}"
    if profile.gpu_memory is None:
        return f"{head}; not checked: profile {profile.name} declares no gpu_memory (e.g. gpu_memory: 80GB)"
    room = parse_gpu_memory(profile.gpu_memory)
    verdict = "fits" if found.plan.total <= room else "does NOT fit"
    return f"{head} of {room / GIB:.0f} GiB (gpu_memory of profile {profile.name}): {verdict}"


def check_fits(profile: ClusterProfile, target: str, args: tuple[str, ...], nodes: int, gpus: int,
               most_nodes: int) -> None:
    """Refuse, in one line, a job whose plan exceeds the profile's gpu_memory, naming flags that would fit."""
    found = job_plan(target, args, nodes * gpus)
    if found is None:
        return
    if profile.gpu_memory is None or found.plan.total <= parse_gpu_memory(profile.gpu_memory):
        check_tier(profile, target, args, nodes, gpus)
        return
    room = parse_gpu_memory(profile.gpu_memory)
    hint = fixes_hint(found.config, found.setup, room, gpus, most_nodes) + "; `submit --dry-run` shows the plan"
    raise UsageError(f"{found.what()} needs about {found.plan.total / GIB:.1f} GiB a GPU ({found.plan.text()}); "
                     f"valid: at most {room / GIB:.0f} GiB (gpu_memory of profile {profile.name}); nothing was "
                     "submitted.", hint)


def tier_of(target: str, args: tuple[str, ...] | list[str], ranks: int, gpus: int) -> TierPlan | None:
    """The node-local tier's host memory a node (`gpus` ranks) for the bundled LM task; None: off or not known."""
    found = job_plan(target, args, ranks)
    if found is None:
        return None
    try:
        cfg, _ = parse_trainer_args(list(args), size_defaults(found.size))
    except (ConfigError, ValueError):
        return None
    return tier_plan(cfg.local_ckpt_every, n_params(found.config), cfg.strategy, ranks, min(gpus, ranks))


def node_room(profile: ClusterProfile, gpus: int, folder: str | None = None) -> tuple[int, str] | None:
    """The host memory a node gives the job's tier, and where that figure comes from: the profile's mem_per_gpu × the
    GPUs of a node, else the size of `folder` where it is this machine's (the local backend passes it); None: not
    known."""
    if profile.mem_per_gpu is not None:
        return (parse_mem_mb(profile.mem_per_gpu) * 2**20 * gpus,
                f"mem_per_gpu {profile.mem_per_gpu} × {gpus} GPU{'s' * (gpus != 1)} of profile {profile.name}")
    if folder is None:
        return None
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, f"the size of {folder} on this machine"


def check_tier(profile: ClusterProfile, target: str, args: tuple[str, ...], nodes: int, gpus: int,
               folder: str | None = None) -> None:
    """Refuse, in one line, a node-local tier whose copies do not fit the node's memory (`folder`: the tier's folder
    where it is on this machine, node_room)."""
    tier = tier_of(target, args, nodes * gpus, gpus)
    room = None if tier is None else node_room(profile, gpus, folder)
    if tier is None or room is None or tier.per_node <= room[0] or tier.every == "auto":
        return  # auto that does not fit: off (the dry run and rank 0 say so)
    fixes = ["--local-ckpt-every 0 turns the tier off"]
    setup = job_plan(target, args, nodes * gpus)
    if setup is not None and setup.setup.strategy != "fsdp" and nodes * gpus > 1:
        fixes.append("--strategy fsdp shards each rank's state over the ranks")
    fixes.append(f"{TIER_DIR_ENV} names a larger node-local folder" if profile.mem_per_gpu is None
                 else "a larger mem_per_gpu in the profile")
    raise UsageError(f"{tier.text()}; valid: at most {gib(room[0])} ({room[1]}); nothing was submitted.",
                     "; or ".join(fixes) + "; `submit --dry-run` shows the figure")


def doctor_check(profile: ClusterProfile, target: str, tasks_args: list[tuple[str, ...]], ranks: int) -> Check:
    """`hpcjobs doctor`'s row: the largest task's plan against gpu_memory (a job that does not fit never gets here:
    building its spec refused it)."""
    found = [p for p in (job_plan(target, args, ranks) for args in tasks_args) if p is not None]
    if not found:
        return Check("memory plan", Result.SKIP, f"{target}'s model is known on the node only (the plan covers "
                     f"{LM_TASK})")
    worst = max(found, key=lambda p: p.plan.total)
    need = f"{worst.plan.total / GIB:.1f} GiB a GPU for {worst.what()}"
    if profile.gpu_memory is None:
        return Check("memory plan", Result.SKIP, f"{need}; not checked: profile {profile.name} declares no "
                     "gpu_memory", "add e.g. gpu_memory: 80GB to the profile")
    return Check("memory plan", Result.PASS,
                 f"{need}, of {parse_gpu_memory(profile.gpu_memory) / GIB:.0f} GiB (gpu_memory)")
