"""The trainer's settings: one dataclass, a docstring per field, flags derived from the fields.

Torch-free (so is trainers/__init__.py): the submit side imports `parse_trainer_args` to refuse a bad trainer flag
on the login node, before the job is queued, with the same check the ranks make.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, NoReturn

from hpcjobs.helpflags import HELP_FLAGS

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
STRATEGIES = ("ddp", "fsdp")
LR_SCALING = ("none", "linear", "sqrt")
TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
"""--tracker's names; metrics.jsonl is written whichever are given (trainers/tracking.py has the others)."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    """Optimizer steps to train in all (a resumed run continues up to this number)."""
    batch_size: int = 8
    """Samples per rank per optimizer step (per-GPU batch). Ignored when global_batch_size is set."""
    global_batch_size: int = 0
    """Samples per optimizer step across all ranks (0: batch_size × world size). Must divide by the world size."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank; gradients are only all-reduced on the last one (no_sync)."""
    lr: float = 3e-4
    """Peak learning rate before scaling with the world size."""
    lr_scaling: str = "none"
    """How the LR grows with the world size: none, linear (lr × world) or sqrt (lr × √world). Logged at start."""
    warmup_steps: int = 0
    """Linear warmup steps, then cosine decay to min_lr_ratio × lr at `steps`."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW weight decay (on matrices only, not biases or norms)."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this (0: no clipping)."""
    precision: str = "auto"
    """auto (bf16 on GPUs that have it, else fp32), fp32, bf16 (autocast) or fp16 (autocast + GradScaler)."""
    seed: int = 0
    """Seed for weights, data order and dropout; each rank's RNG states are checkpointed for exact resume."""
    log_every: int = 10
    """Steps between log lines, metrics.jsonl records and heartbeats (the only host-device syncs)."""
    ckpt_every: int = 100
    """Steps between periodic checkpoints (0: only at the end and on a stop request)."""
    keep: int = 2
    """Finished checkpoints to keep (at least 2)."""
    keep_best: bool = False
    """Also keep the checkpoint with the lowest val_loss (RUN/checkpoints/best.json names it; never pruned)."""
    eval_every: int = 0
    """Steps between evaluations of the task's validation set, all ranks' shards averaged (0: never)."""
    stop_check_every: int = 0
    """Steps between the ranks' agreement on a stop request (one CPU all-reduce of one int, in the background: a stop
    takes effect at the check after the one that saw it). 0: about once a second of training, from the step time
    measured over this start's first steps (the slowest rank's; every rank checks at the same steps)."""
    num_workers: int = 0
    """DataLoader worker processes per rank, kept across epochs. With workers, each sample's randomness (data
    augmentation) is seeded from the seed, the epoch and its index, so results do not depend on how many workers
    there are or on where a resume began; without, it draws from the rank's checkpointed RNG (also exact, but other
    values than with workers)."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace, no TF32, deterministic SDPA):
    needed for a bit-exact resume on GPUs; slower (bench/gpu.py measures by how much)."""
    compile: bool = False
    """torch.compile the model (with fsdp: each block), off by default; the first steps take longer while it
    compiles."""
    strategy: str = "ddp"
    """ddp: every rank holds the whole model, gradients are all-reduced. fsdp: FSDP2 shards parameters, gradients and
    optimizer state over the ranks (each holds 1/world; a block's parameters are gathered while it runs): for models
    whose weights, gradients and AdamW state (~16 bytes/parameter) do not fit on one GPU."""
    cpu_offload: bool = False
    """fsdp on GPUs: keep the sharded parameters, gradients and optimizer state in host memory (FSDP2's
    CPUOffloadPolicy); the optimizer step runs on the CPU."""
    meta_init: bool = True
    """fsdp with more than one rank: only rank 0 builds the model in host memory; the others build it on the meta
    device (no memory), shard it, and receive their shards and buffers from rank 0, one tensor at a time. A node
    then holds one full copy of the model while the job starts instead of one per rank (8 × 28 GB for a 7B model in
    fp32 on an 8-GPU node). The weights are the same either way. --no-meta-init builds it on every rank, for a
    task whose model() must compute with real tensors (e.g. calls .item() on one)."""
    reduce_each_micro_batch: bool = False
    """fsdp with --grad-accum above 1: reduce-scatter the gradients after every micro-batch, so each rank only ever
    holds its shard of them. Without it the gradients are reduced once per step, on the last micro-batch, and until
    then each rank holds an unsharded fp32 gradient of the whole model (4 bytes per parameter: 28 GB for a 7B
    model), which can be what does not fit; with it, --grad-accum reduce-scatters per step instead of one."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward instead of keeping them (both strategies): less memory,
    about a third more compute."""
    async_save: bool = True
    """Periodic checkpoints are written in the background: training waits only while the state is copied to host
    memory. At most one save is in flight; a stop and the end of training wait for it, then save in the foreground."""
    reshard: bool = False
    """Resume a checkpoint written by another number of ranks (or the other --strategy): weights, optimizer,
    scheduler and step exactly, the data position by samples consumed; per-rank RNG streams start anew. Without it
    such a resume is refused."""
    tracker: str = "jsonl"
    """Where rank 0 logs the metrics: jsonl (RUN/metrics.jsonl, always written), tensorboard (RUN/tensorboard),
    wandb (RUN/wandb; offline unless W&B credentials or WANDB_MODE say otherwise), mlflow (MLFLOW_TRACKING_URI, else
    a file store in RUN/mlruns); several joined by commas (wandb,tensorboard). A requeued or resumed run goes on
    logging into the same tracker run (RUN/tracker.json holds its id); trainers/tracking.py says more."""
    extend: bool = False
    """Resume a checkpoint written under another --steps: the LR then goes on from the value the checkpoint was saved
    with (its step k) down to min_lr_ratio × lr at the new --steps along a half cosine over steps k..steps (a
    checkpoint still in warmup simply follows the plan for the new --steps: the warmup does not depend on it).
    Without it a changed --steps is refused, since the cosine would be re-planned and the LR would jump."""

    def trackers(self) -> tuple[str, ...]:
        """--tracker's names in the order given, each once; jsonl among them or not (it is always written)."""
        return tuple(dict.fromkeys(name.strip() for name in self.tracker.split(",") if name.strip()))

    def lr_factor(self, world_size: int) -> float:
        return {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[self.lr_scaling]

    def per_rank_batch(self, world_size: int) -> int:
        if self.global_batch_size:
            if self.global_batch_size % world_size:
                raise ValueError(f"global_batch_size {self.global_batch_size} does not divide by the world size "
                                 f"{world_size}")
            return self.global_batch_size // world_size
        return self.batch_size

    def micro_batch(self, world_size: int) -> int:
        per_rank = self.per_rank_batch(world_size)
        if per_rank % self.grad_accum:
            raise ValueError(f"the per-rank batch {per_rank} does not divide into grad_accum={self.grad_accum} "
                             "micro-batches")
        return per_rank // self.grad_accum

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # Settings that change what training computes: a checkpoint written under other values is refused.
    RESUME_KEYS = ("batch_size", "global_batch_size", "grad_accum", "lr", "lr_scaling", "warmup_steps",
                   "min_lr_ratio", "weight_decay", "grad_clip", "precision", "seed")


def _field_docs() -> dict[str, str]:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for a, b in zip(body, body[1:], strict=False):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value)  # type: ignore[union-attr]
    return docs


def add_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """The trainer's flags on an argparse parser, for their help text (`trainer_help`); parsing and checking them
    is `parse_trainer_args`."""
    docs = _field_docs()
    defaults = defaults or {}
    for f in dataclasses.fields(TrainConfig):
        flag = _flag(f.name)
        default = defaults.get(f.name, f.default)
        help_ = f"{docs.get(f.name, '')} (default: {default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        kind = {"int": int, "float": float, "str": str}[str(f.type)]
        parser.add_argument(flag, type=kind, default=default, choices=CHOICES.get(f.name), help=help_)


def trainer_help(defaults: dict[str, Any] | None = None) -> str:
    p = argparse.ArgumentParser(prog="the shared trainer", add_help=False, allow_abbrev=False,
                                usage="TASK [trainer flags] [task flags]")
    add_arguments(p, defaults)
    return p.format_help()


# --- parsing and checking the trainer's flags --------------------------------------------------------------------
# Hand-written rather than argparse: the submit side calls it on a login node to refuse a bad flag before the job
# waits in the queue, so it must raise (never exit or print), say what is valid, and pass every flag it does not know
# to the task untouched and in order (argparse's parse_known_args also matches abbreviations: `--warmup 5` would
# have become --warmup-steps).

CHOICES: dict[str, tuple[str, ...]] = {"precision": PRECISIONS, "lr_scaling": LR_SCALING, "strategy": STRATEGIES}
MULTI_CHOICES: dict[str, tuple[str, ...]] = {"tracker": TRACKERS}
"""Settings that take one or more of their choices, joined by commas."""
CHOICE_HINTS = {
    "precision": "auto picks bf16 on GPUs that have it and fp32 elsewhere; fp16 adds a GradScaler.",
    "lr_scaling": "linear multiplies the LR by the world size, sqrt by its square root; none keeps it.",
    "strategy": "fsdp shards a model that does not fit on one GPU; ddp is faster when it fits.",
    "tracker": "metrics.jsonl is always written; e.g. --tracker wandb,tensorboard logs to those as well.",
}


@dataclass(frozen=True)
class Bounds:
    """The valid range of a numeric setting: from `low` (inclusive, or exclusive when `above`) up to `high`."""

    low: float
    above: bool = False
    high: float | None = None
    note: str = ""
    """What a special value means, shown with the range (e.g. `0: never`)."""
    example: str = ""

    def holds(self, value: float) -> bool:
        low_ok = value > self.low if self.above else value >= self.low
        return low_ok and (self.high is None or value <= self.high)

    def describe(self, letter: str) -> str:
        def num(x: float) -> str:
            return str(x) if isinstance(x, int) else f"{x:g}"  # 2**63 - 1 in full, not 9.22337e+18

        if self.high is not None:
            text = f"{num(self.low)} ≤ {letter} ≤ {num(self.high)}"
        else:
            text = f"{letter} {'>' if self.above else '≥'} {num(self.low)}"
        return text + (f" ({self.note})" if self.note else "")


BOUNDS: dict[str, Bounds] = {
    "steps": Bounds(1, example="1000"),
    "batch_size": Bounds(1, example="32"),
    "global_batch_size": Bounds(0, note="0: batch size × world size", example="256"),
    "grad_accum": Bounds(1, example="4"),
    "lr": Bounds(0, above=True, example="3e-4"),
    "warmup_steps": Bounds(0, example="100"),
    "min_lr_ratio": Bounds(0, high=1, example="0.1"),
    "weight_decay": Bounds(0, example="0.1"),
    "grad_clip": Bounds(0, note="0: no clipping", example="1.0"),
    "seed": Bounds(0, high=2**63 - 1, example="0"),  # torch's generators take < 2**64, and the sampler adds the epoch
    "log_every": Bounds(1, example="10"),
    "ckpt_every": Bounds(0, note="0: only at the end and on a stop", example="100"),
    "keep": Bounds(2, note="the newest checkpoint is never the only copy", example="2"),
    "eval_every": Bounds(0, note="0: never", example="100"),
    "stop_check_every": Bounds(0, note="0: about once a second, from the measured step time", example="1"),
    "num_workers": Bounds(0, example="4"),
}
"""Every numeric setting's valid range; a test checks that no int or float field is missing here."""


class ConfigError(ValueError):
    """A trainer flag that cannot be used, as one line: what was given; valid: what would be. HINT: what to do.
    The launcher refuses the start with it (exit 2, one line) and records nothing in final.json."""


class ResumeError(ConfigError):
    """The run folder's checkpoint was written with settings this start does not have: resuming would not continue
    the same run. A refused start like a bad flag: the run folder's final word is left as it was."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fields() -> dict[str, str]:
    return {f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}


def _flags() -> dict[str, tuple[str, bool | None]]:
    """Each exact flag → (setting, the value a bare boolean flag sets; None for flags that take a value)."""
    out: dict[str, tuple[str, bool | None]] = {}
    for name, kind in _fields().items():
        out[_flag(name)] = (name, True if kind == "bool" else None)
        if kind == "bool":
            out["--no-" + name.replace("_", "-")] = (name, False)
    return out


def _error(given: str, valid: str, hint: str) -> ConfigError:
    return ConfigError(f"{given}; valid: {valid}. HINT: {hint}")


def _quoted(text: str, quote: bool = True) -> str:
    """A flag's value as its error shows it (repr'd, or as written where it reads as a number): a long one cut, so
    the line stays readable."""
    short = text if len(text) <= 60 else f"{text[:40]}..."
    return (repr(short) if quote else short) + ("" if short == text else f" ({len(text)} characters)")


def _valid(name: str) -> str:
    """The `valid:` part for a setting."""
    kind, flag = _fields()[name], _flag(name)
    if name in CHOICES:
        return f"{flag} {'|'.join(CHOICES[name])}"
    if name in MULTI_CHOICES:
        return f"{flag} {'|'.join(MULTI_CHOICES[name])}, or several joined by commas"
    if kind == "bool":
        return f"{flag} or --no-{name.replace('_', '-')}, without a value"
    letter = "N" if kind == "int" else "X"
    return f"{flag} {letter} with {BOUNDS[name].describe(letter)}"


def _hint(name: str) -> str:
    if name in CHOICE_HINTS:
        return CHOICE_HINTS[name]
    example = BOUNDS[name].example if name in BOUNDS else ""
    return f"e.g. {_flag(name)} {example}".rstrip()


def _convert(name: str, text: str) -> Any:
    """A flag's text as the setting's value; raises ConfigError for a value of the wrong kind."""
    kind, flag = _fields()[name], _flag(name)
    if name in CHOICES:
        if text not in CHOICES[name]:
            raise _error(f"{flag} {_quoted(text)} is not a choice", _valid(name), _hint(name))
        return text
    if name in MULTI_CHOICES:
        return _convert_multi(name, text)
    try:
        value = int(text) if kind == "int" else float(text)
    except ValueError:
        digits = text.strip().lstrip("+-")
        wrong = (f"is not {'a whole number' if kind == 'int' else 'a number'}" if not digits.isdigit() else
                 "has more digits than Python reads (4300)")
        raise _error(f"{flag} {_quoted(text)} {wrong}", _valid(name), _hint(name)) from None
    if not math.isfinite(value):
        raise _error(f"{flag} {_quoted(text)} is not a finite number", _valid(name), _hint(name))
    return value


def _convert_multi(name: str, text: str) -> str:
    """A comma-separated list of choices, each checked, as one string without spaces or repeats (what the
    checkpoint's config records); `wandb, mlflow` is read as `wandb,mlflow`."""
    flag, words = _flag(name), [w.strip() for w in text.split(",") if w.strip()]
    if not words:
        raise _error(f"{flag} {_quoted(text)} names none", _valid(name), _hint(name))
    wrong = [w for w in words if w not in MULTI_CHOICES[name]]
    if wrong:
        what = ", ".join(repr(w) for w in wrong)
        raise _error(f"{flag} {_quoted(text)}: {what} {'is not a choice' if len(wrong) == 1 else 'are not choices'}",
                     _valid(name), _hint(name))
    return ",".join(dict.fromkeys(words))


def _check_range(name: str, value: Any, given: str) -> None:
    bounds = BOUNDS.get(name)
    if bounds is not None and not bounds.holds(value):
        side = "too large" if bounds.high is not None and value > bounds.high else "too small"
        raise _error(f"{given} is {side}", _valid(name), _hint(name))


def _value_after(name: str, args: list[str], i: int) -> str:
    """The value of the flag at args[i] given as the next word; ConfigError when there is none. A next word that
    is a long option is taken for a forgotten value, not as the value: `--steps --lr 1` must not train `--lr`
    steps. A negative number (`--batch-size -1`) is a value, and its range says what is wrong with it."""
    if i + 1 >= len(args):
        raise _error(f"{args[i]} has no value (it is the last argument)", _valid(name), _hint(name))
    if args[i + 1].startswith("--"):
        raise _error(f"{args[i]} has no value (it is followed by {args[i + 1]})", _valid(name), _hint(name))
    return args[i + 1]


def _task_defaults(defaults: dict[str, Any] | None) -> dict[str, Any]:
    """A task's suggested settings (Task.defaults), checked like flags: a task can be wrong too."""
    fields = _fields()
    out: dict[str, Any] = {}
    for name, value in (defaults or {}).items():
        if name not in fields:
            raise _error(f"the task's default {name!r} is not a trainer setting",
                         ", ".join(sorted(fields)), "fix the Task's `defaults` (keys are TrainConfig's fields)")
        value = _convert(name, str(value)) if fields[name] != "bool" else bool(value)
        _check_range(name, value, f"the task's default {name}={value!r}")
        out[name] = value
    return out


def _check_together(cfg: TrainConfig) -> None:
    """Settings that are only wrong together (the world size is not known here: see per_rank_batch)."""
    if cfg.keep_best and not cfg.eval_every:
        raise _error("--keep-best without --eval-every", "--keep-best --eval-every N (best by val_loss)",
                     "add --eval-every 100")


def parse_trainer_args(args: list[str], defaults: dict[str, Any] | None = None) -> tuple[TrainConfig, list[str]]:
    """The trainer's flags out of a task's arguments, checked: (the settings, everything else in order for the
    task). Flags match exactly (`--warmup` is the task's, not --warmup-steps); `--flag value` and `--flag=value`
    both work; a later flag wins; everything from a `--` on is the task's; `-h/--help` is left to the caller.
    `defaults` are the task's suggested settings (flags win). Raises ConfigError, one line; never exits or prints.
    Torch-free: the submit side calls it to refuse a bad flag before the job is queued."""
    flags = _flags()
    values = _task_defaults(defaults)
    rest: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            rest.extend(args[i:])
            break
        flag, eq, text = word.partition("=")
        if flag not in flags:
            rest.append(word)
            i += 1
            continue
        name, bare = flags[flag]
        if bare is not None:
            if eq:
                raise _error(f"{word} gives a value to a switch", _valid(name), f"write {flag} alone")
            values[name] = bare
            i += 1
            continue
        if not eq:
            text = _value_after(name, args, i)
            i += 1
        value = _convert(name, text)
        _check_range(name, value, f"{flag} {_quoted(text, quote=False)}")
        values[name] = value
        i += 1
    cfg = TrainConfig(**values)
    _check_together(cfg)
    return cfg, rest


# --- a task's own flags (trainers.task re-exports these) ------------------------------------------------------------

class TaskArgError(ValueError):
    """A task flag that cannot be used, as one line, in the trainer flags' pattern (trainers.config.ConfigError):
    what was given; valid: what would be. HINT: what to do."""


class TaskArgParser(argparse.ArgumentParser):
    """argparse for a task's own flags, raising TaskArgError instead of printing a usage block and exiting: every
    rank parses the same flags, and a mistake must read as one line, not as a SystemExit traceback per rank. Long
    options match exactly (a prefix of a trainer flag would otherwise be taken). `--help` prints and exits as usual
    (`python -m trainers help TASK` shows it)."""

    def __init__(self, prog: str, **kwargs: Any) -> None:
        super().__init__(prog=prog, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise TaskArgError(self.explain(message)) from None  # argparse's own exception adds nothing to the log

    def explain(self, message: str) -> str:
        """argparse's message with what is valid and what to do."""
        flags = sorted(o for a in self._actions for o in a.option_strings if o not in HELP_FLAGS)
        hint = f"`python -m trainers help {self.prog}` lists them"
        if message.startswith("argument "):
            names, _, why = message[len("argument "):].partition(": ")
            why = why.split(" (choose from ")[0]  # `valid:` lists them
            action = next((a for a in self._actions if set(a.option_strings) & set(names.split("/"))), None)
            valid = _valid_task_flag(action) if action is not None else " ".join(flags)
            return f"{self.prog}: {names}: {why}; valid: {valid}. HINT: {hint}"
        unknown = message.removeprefix("unrecognized arguments: ").split()
        if message.startswith("unrecognized arguments: ") and unknown:
            close = difflib.get_close_matches(unknown[0].split("=")[0], flags, n=1)
            hint = f"did you mean {close[0]}? {hint}" if close else hint
            return (f"{self.prog}: {' '.join(unknown)} is not a flag of this task or of the trainer; valid task "
                    f"flags: {' '.join(flags) or 'none'}. HINT: {hint}")
        return f"{self.prog}: {message}; valid task flags: {' '.join(flags) or 'none'}. HINT: {hint}"


def _valid_task_flag(action: argparse.Action) -> str:
    flag = action.option_strings[0] if action.option_strings else action.dest
    if action.choices is not None:
        return f"{flag} {'|'.join(str(c) for c in action.choices)}"
    kind = {int: "N (a whole number)", float: "X (a number)"}.get(action.type, "VALUE")  # type: ignore[call-overload]
    return f"{flag} {kind}" if action.nargs != 0 else f"{flag} alone"
