"""The shared trainer's flags: their help text, their reference table and the one parser both sides run (the ranks
at start, `hpcjobs submit`/`render` before queueing), raising one line for a flag that cannot be used. All of it is
read off TrainConfig's fields (hpcjobs.protocol.settings.schema says how a field carries its schema). Torch-free."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

from hpcjobs.protocol.errors import StartRefused
from hpcjobs.protocol.settings.schema import Bounds, bounds_of, field_docs, shown_default, table
from hpcjobs.protocol.settings.trainconfig import TrainConfig


def add_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """The trainer's flags on an argparse parser, for their help text (`trainer_help`); parsing and checking them
    is `parse_trainer_args`."""
    docs = field_docs(TrainConfig)
    defaults = defaults or {}
    for f in dataclasses.fields(TrainConfig):
        flag = _flag(f.name)
        default = defaults.get(f.name, f.default)
        help_ = f"{docs.get(f.name, '')} (default: {default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
            continue
        kind = {"int": int, "float": float, "str": str, "int | str": str}[str(f.type)]
        choices = None if f.metadata.get("multiple") or _either(f.name) else f.metadata.get("choices")
        parser.add_argument(flag, type=kind, default=default, choices=choices, help=help_)


def trainer_help(defaults: dict[str, Any] | None = None) -> str:
    p = argparse.ArgumentParser(prog="the shared trainer", add_help=False, allow_abbrev=False,
                                usage="TASK [trainer flags] [task flags]")
    add_arguments(p, defaults)
    return p.format_help()


def reference_table() -> str:
    """The Markdown table of every trainer flag (| flag | type | default | valid | meaning |), as
    docs/reference/trainer-flags.md shows it."""
    docs = field_docs(TrainConfig)
    rows = [(f"`{_flag(f.name)}`", _kind(f.name), shown_default(f), _range(f.name), docs[f.name])
            for f in dataclasses.fields(TrainConfig)]
    return table(("flag", "type", "default", "valid", "meaning"), rows)


def _kind(name: str) -> str:
    meta = _meta(name)
    if _either(name):
        return "whole number or " + ", ".join(meta["choices"])
    if "choices" in meta:
        return "choices" if meta.get("multiple") else "choice"
    return {"int": "whole number", "float": "number", "bool": "switch", "str": "text"}[_fields()[name]]


def _range(name: str) -> str:
    """The valid values as the reference table shows them (the errors' `valid:` part says the same with the flag)."""
    meta, bounds = _meta(name), _bounds(name)
    if _either(name) and bounds is not None:
        return f"{bounds.describe('N')}, or " + ", ".join(f"`{c}`" for c in meta["choices"])
    if "choices" in meta:
        some = "one or more" if meta.get("multiple") else "one"
        return f"{some} of {', '.join(f'`{c}`' for c in meta['choices'])}" + (
            ", joined by commas" if meta.get("multiple") else "")
    if bounds is not None:
        return bounds.describe(_letter(name))
    return f"`{_flag(name)}` or `{_no_flag(name)}`" if _fields()[name] == "bool" else ""


# --- parsing and checking the trainer's flags --------------------------------------------------------------------
# Hand-written rather than argparse: the submit side calls it on a login node to refuse a bad flag before the job
# waits in the queue, so it must raise (never exit or print), say what is valid, and pass every flag it does not know
# to the task untouched and in order (argparse's parse_known_args also matches abbreviations: `--warmup 5` would
# have become --warmup-steps).


def _bounds(name: str) -> Bounds | None:
    """A numeric setting's range (every int and float field has one: a test checks it); None for the others."""
    return bounds_of(_meta(name))


class ConfigError(StartRefused, ValueError):
    """A trainer flag that cannot be used, as one line: what was given; valid: what would be. HINT: what to do.
    The launcher refuses the start with it (exit 2, one line) and records nothing in final.json."""


class ResumeError(ConfigError):
    """The run folder's checkpoint was written with settings this start does not have: resuming would not continue
    the same run. A refused start like a bad flag: the run folder's final word is left as it was."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _no_flag(name: str) -> str:
    return "--no-" + name.replace("_", "-")


def _fields() -> dict[str, str]:
    return {f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}


@functools.cache
def _meta(name: str) -> Mapping[str, Any]:
    """A setting's schema: its field's metadata (hpcjobs.protocol.settings.schema)."""
    return {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}[name]


def _letter(name: str) -> str:
    return "N" if _fields()[name] in ("int", "int | str") else "X"


def _either(name: str) -> bool:
    """A whole number or one of its words (`--local-ckpt-every 5|auto`)."""
    return _fields()[name] == "int | str"


def _flags() -> dict[str, tuple[str, bool | None]]:
    """Each exact flag → (setting, the value a bare boolean flag sets; None for flags that take a value)."""
    out: dict[str, tuple[str, bool | None]] = {}
    for name, kind in _fields().items():
        out[_flag(name)] = (name, True if kind == "bool" else None)
        if kind == "bool":
            out[_no_flag(name)] = (name, False)
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
    meta, flag, bounds = _meta(name), _flag(name), _bounds(name)
    if _either(name) and bounds is not None:
        return f"{flag} N with {bounds.describe('N')}, or {flag} {'|'.join(meta['choices'])}"
    if "choices" in meta:
        return f"{flag} {'|'.join(meta['choices'])}" + (", or several joined by commas" if meta.get("multiple") else "")
    if _fields()[name] == "bool":
        return f"{flag} or {_no_flag(name)}, without a value"
    assert bounds is not None, f"{name} has no `min` in its metadata"
    return f"{flag} {_letter(name)} with {bounds.describe(_letter(name))}"


def _hint(name: str) -> str:
    meta = _meta(name)
    if "hint" in meta:
        return str(meta["hint"])
    return f"e.g. {_flag(name)} {meta.get('example', '')}".rstrip()


def _convert(name: str, text: str) -> Any:
    """A flag's text as the setting's value; raises ConfigError for a value of the wrong kind."""
    kind, flag, meta = _fields()[name], _flag(name), _meta(name)
    if meta.get("multiple"):
        return _convert_multi(name, text)
    if "choices" in meta:
        if text in meta["choices"]:
            return text
        if not _either(name):
            raise _error(f"{flag} {_quoted(text)} is not a choice", _valid(name), _hint(name))
    try:
        value = int(text) if kind in ("int", "int | str") else float(text)
    except ValueError:
        digits = text.strip().lstrip("+-")
        wrong = (f"is not {'a whole number' if kind != 'float' else 'a number'}" if not digits.isdigit() else
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
    wrong = [w for w in words if w not in _meta(name)["choices"]]
    if wrong:
        what = ", ".join(repr(w) for w in wrong)
        raise _error(f"{flag} {_quoted(text)}: {what} {'is not a choice' if len(wrong) == 1 else 'are not choices'}",
                     _valid(name), _hint(name))
    return ",".join(dict.fromkeys(words))


def _check_range(name: str, value: Any, given: str) -> None:
    bounds = _bounds(name)
    if bounds is not None and not isinstance(value, str) and not bounds.holds(value):
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
    fsdp_only = [flag for flag, on in (("--no-reshard-after-forward", not cfg.reshard_after_forward),
                                       (f"--replicate-degree {cfg.replicate_degree}", cfg.replicate_degree > 1)) if on]
    if fsdp_only and cfg.strategy != "fsdp":
        raise _error(f"{fsdp_only[0]} with --strategy {cfg.strategy}", f"{fsdp_only[0]} with --strategy fsdp",
                     "DDP holds the whole model on every rank: it has nothing to reshard or to shard hybridly")
    if not cfg.activation_checkpointing and (cfg.ac_mode != "full" or cfg.ac_every != 1):
        given = f"--ac-mode {cfg.ac_mode}" if cfg.ac_mode != "full" else f"--ac-every {cfg.ac_every}"
        raise _error(f"{given} without --activation-checkpointing", f"{given} --activation-checkpointing",
                     "add --activation-checkpointing (it says which blocks and activations it recomputes)")


def parse_trainer_args(args: list[str], defaults: dict[str, Any] | None = None) -> tuple[TrainConfig, list[str]]:
    """The trainer's flags out of a task's arguments, checked: (the settings, everything else in order for the
    task). Flags match exactly (`--warmup` is the task's, not --warmup-steps); `--flag value` and `--flag=value`
    both work; a later flag wins; everything from a `--` on is the task's; `-h/--help` is left to the caller.
    `defaults` are the task's suggested settings (flags win): settings that are only wrong together are judged with
    them applied (a preset's --strategy fsdp makes --replicate-degree valid). Raises ConfigError, one line; never
    exits or prints. Torch-free: the submit side calls it to refuse a bad flag before the job is queued."""
    given = _task_defaults(defaults)
    values, rest = scan_flags(tuple(args))
    cfg = TrainConfig(**{**given, **dict(values)})  # what a scan over the defaults gave: a flag wins
    _check_together(cfg)
    return cfg, list(rest)


def task_args_of(args: list[str]) -> list[str]:
    """The task's own arguments among `args`, in order: the trainer's flags taken out, each checked alone (a value
    of the wrong kind or range). Settings that are only wrong together are not judged here: the task's defaults
    (a size's preset) are known only once its arguments are read, and `parse_trainer_args` judges them with those."""
    return list(scan_flags(tuple(args))[1])


@functools.lru_cache(maxsize=256)
def scan_flags(args: tuple[str, ...]) -> tuple[tuple[tuple[str, Any], ...], tuple[str, ...]]:
    """The one scan of an argv both sides share: (each trainer flag's value, the other arguments in order), kept
    per argv. The submit side asked it of the same sweep point in check_trainer_args, check_task_flags, the memory
    fit, the dry-run's plan and the stop-checkpoint line: 20 scans for a two-point sweep's `submit --dry-run`
    before, 2 with the cache (tests/test_flag_scans.py); the node's start asks it twice (task_args_of, then
    parse_trainer_args). Immutable, so no caller can change what another gets; a refusal is not kept."""
    values, rest = _scan(list(args), {})
    return tuple(values.items()), tuple(rest)


def _scan(args: list[str], values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(`values` with each trainer flag's value over it, the other arguments in order), each flag checked alone."""
    flags = _flags()
    values, rest = dict(values), []
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
    return values, rest


def check_world(cfg: TrainConfig, world: int) -> None:
    """Settings that are wrong for this many ranks, said where the world size is known: by the submit side before
    queueing (the request's ranks) and by the ranks at their start."""
    replicate = cfg.replicate_degree
    if cfg.strategy == "fsdp" and replicate > 1 and (world % replicate or replicate == world):
        raise ConfigError(f"--replicate-degree {replicate} with {world} rank(s); valid: a divisor of {world} below it. "
                          "HINT: the number of nodes (each node's ranks shard one replica), or drop the flag to "
                          "shard over all ranks")


def trainer_flag_names() -> list[str]:
    """Every exact trainer flag (`--steps`, `--no-compile`, ...), in TrainConfig's order: a task's parser names them
    when it meets a flag it does not know, and suggests the closest."""
    return list(_flags())
