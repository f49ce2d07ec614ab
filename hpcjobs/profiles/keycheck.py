"""A profile's keys checked one by one, read off the dataclasses (hpcjobs.profiles.cluster_profile): each field's type
and metadata give its validator; an unknown key gets the nearest valid one. The reference table
(hpcjobs.profiles.table) reads the same fields through the public names here."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from hpcjobs.profiles.secrets import NAME
from hpcjobs.protocol.errors import ProfileError, UsageError, shown
from hpcjobs.protocol.rankvars import RENDEZVOUS

MAX_ITEMS = 200  # the most entries of a list or mapping key (setup, srun_args, env, nccl)
MAX_STRING = 4096  # the longest string any key (or list entry, or environment value) may hold


# --- the schema, read off the dataclasses ----------------------------------------------------------------------

Validator = Callable[[Any], Any]
"""Returns the value as the dataclass holds it; raises ValueError(what is valid) or UsageError (a parser's)."""


def keys(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields of `cls` that are YAML keys, by name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("key", True)}


@functools.cache
def types_of(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed) for `X | None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return rest[0], True
    return tp, False


def int_valid(low: int | None, high: int | None) -> str:
    # "> 0" and ">= 0" read best for the usual lower bounds; any other one is spelled out.
    text = {None: "a whole number", 0: "a whole number >= 0", 1: "a whole number > 0"}.get(low, f"at least {low}")
    text += f", at most {high}" if high is not None else ""
    return text + ("" if low in (None, 0, 1) else " (a whole number)")


def _check_int(meta: Mapping[str, Any], key: str) -> Validator:
    low, high = meta.get("min"), meta.get("max")

    def check(v: Any) -> int:
        if (isinstance(v, bool) or not isinstance(v, int) or (low is not None and v < low)
                or (high is not None and v > high)):
            raise ValueError(int_valid(low, high))
        return v
    return check


def _check_bool(meta: Mapping[str, Any], key: str) -> Validator:
    def check(v: Any) -> bool:
        if not isinstance(v, bool):
            raise ValueError("true or false")
        return v
    return check


def _one_line(v: str) -> bool:
    # Profile strings end up on lines of a shell script: a newline in a partition name would start a command.
    return "\n" not in v and "\r" not in v


def _check_str(meta: Mapping[str, Any], key: str) -> Validator:
    choices: tuple[str, ...] | None = meta.get("choices")
    parse: Callable[[Any, str], object] | None = meta.get("parse")  # None: the value must be a string as it is

    def check(v: Any) -> str:
        if choices is not None and v not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        if isinstance(v, str) and not _one_line(v):
            raise ValueError("a single-line string")
        if isinstance(v, str) and len(v) > MAX_STRING:
            raise ValueError(f"a string of at most {MAX_STRING} characters")
        if parse is not None:
            parse(v, key)
            return str(v)  # a bare number of minutes (`default_time: 30`) is kept in Slurm's notation
        if not isinstance(v, str):
            raise ValueError("a string")
        return v
    return check


def _check_lines(meta: Mapping[str, Any], key: str) -> Validator:
    cap = meta.get("max_items", MAX_ITEMS)
    parse: Callable[[Any, str], object] = meta.get("parse") or (lambda entry, key: None)

    def check(v: Any) -> tuple[str, ...]:
        if v is None:
            return ()  # every line commented out
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError("a list of strings")
        if len(v) > cap:
            raise ValueError(f"a list of at most {cap} strings (it has {len(v)})")
        if not all(map(_one_line, v)):
            raise ValueError("a list of single-line strings")
        if any(len(x) > MAX_STRING for x in v):
            raise ValueError(f"a list of strings of at most {MAX_STRING} characters each")
        for x in v:
            parse(x, key)  # each entry's own form (a mount's HOST:CONTAINER), in the parser's words
        return tuple(v)
    return check


def _env_entry(k: Any, val: Any, prefixes: tuple[str, ...]) -> str:
    """One NAME: value of an environment mapping, as the text exported; raises ValueError(what is valid)."""
    if not isinstance(k, str) or not NAME.fullmatch(k) or len(k) > MAX_STRING:
        raise ValueError(f"environment names (letters, digits, _), not {shown(k)}")
    if prefixes and not k.startswith(prefixes):
        raise ValueError(f"names starting with {' or '.join(prefixes)}, not {k!r}")
    if k in RENDEZVOUS:  # set for each rank when it starts: one value for the whole job would be every rank's
        raise ValueError(f"names other than those hpcjobs sets for each rank ({', '.join(RENDEZVOUS)}), not {k!r}")
    if isinstance(val, bool) or not isinstance(val, (str, int, float)):
        raise ValueError(f"scalar values, not {shown(val)} for {k}")
    if len(str(val)) > MAX_STRING:
        raise ValueError(f"values of at most {MAX_STRING} characters, not {len(str(val))} for {k}")
    return str(val)


def _check_env(meta: Mapping[str, Any], key: str) -> Validator:
    prefixes: tuple[str, ...] = meta.get("prefixes", ())
    cap = meta.get("max_items", MAX_ITEMS)

    def check(v: Any) -> dict[str, str]:
        if v is None:
            return {}  # every entry commented out
        if not isinstance(v, dict):
            raise ValueError("a mapping NAME: value")
        if len(v) > cap:
            raise ValueError(f"a mapping of at most {cap} names (it has {len(v)})")
        return {k: _env_entry(k, val, prefixes) for k, val in v.items()}
    return check


_CHECKS: dict[Any, Callable[[Mapping[str, Any], str], Validator]] = {
    bool: _check_bool, int: _check_int, str: _check_str, tuple: _check_lines, dict: _check_env,
}
"""How a field's type is checked (its metadata says the rest)."""


def _checker(tp: Any, meta: Mapping[str, Any], key: str) -> Validator:
    base, optional = _unwrap_optional(tp)
    check = _CHECKS[typing.get_origin(base) or base](meta, key)
    return (lambda v: None if v is None else check(v)) if optional else check


# --- validation ---------------------------------------------------------------------------------------------------


def unknown_key(source: str, key: object, valid: list[str], where: str = "") -> ProfileError:
    close = difflib.get_close_matches(str(key), valid, n=1)
    maybe = f" Did you mean {close[0]!r}?" if close else ""
    return ProfileError(
        f"profile {source}: unknown key {where}{shown(key)}.{maybe} Valid keys: {', '.join(valid)}.",
        "see the commented keys in cluster_profiles/local.yaml or `hpcjobs profiles show local`.",
    )


def _check(source: str, key: str, check: Validator, value: Any) -> Any:
    try:
        return check(value)
    except ValueError as e:
        raise ProfileError(f"profile {source}: {key} is {shown(value)}; valid: {e}.",
                           f"fix {key} in {source}.") from None
    except UsageError as e:  # a Slurm notation parser's, which names the key and the valid forms itself
        raise ProfileError(f"profile {source}: {e.message}", f"fix {key} in {source}.") from None


def parse_mapping(cls: type, data: Mapping[Any, Any], source: str, where: str = "") -> dict[str, Any]:
    """The checked values of a mapping whose keys are the fields of `cls`; a nested dataclass field is a nested
    mapping, its keys named `where.key` in messages."""
    fields, hints = keys(cls), types_of(cls)
    values: dict[str, Any] = {}
    for key, raw in data.items():
        if key not in fields:
            raise unknown_key(source, key, sorted(fields), where)
        path = f"{where}{key}"
        if dataclasses.is_dataclass(hints[key]):
            values[key] = parse_nested(hints[key], raw, source, path)
        else:
            values[key] = _check(source, path, _checker(hints[key], fields[key].metadata, path), raw)
    return values


def parse_nested(cls: type, raw: Any, source: str, key: str) -> Any:
    if raw is None:
        return cls()  # every key commented out: the defaults
    if not isinstance(raw, dict):
        raise ProfileError(f"profile {source}: {key} is {shown(raw)}; valid: a mapping with "
                           f"{', '.join(keys(cls))}.", f"fix {key} in {source}.")
    return cls(**parse_mapping(cls, raw, source, f"{key}."))
