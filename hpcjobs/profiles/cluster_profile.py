"""Cluster profiles: find them, load the YAML, validate every key, return a frozen ClusterProfile.

A profile holds the facts of one cluster (what a node has, how the site wants GPUs asked for, where runs go), so
builders never ask the cluster (no `sinfo` at submit time). Lookup order for a name, first match wins:
  1. a path (anything with a `/` or ending in .yaml/.yml)
  2. $HPCJOBS_PROFILES_DIR (one or more folders, `:`-separated)
  3. ./cluster_profiles/ in the working directory
  4. the user config folder: $XDG_CONFIG_HOME/hpcjobs/profiles (default ~/.config/hpcjobs/profiles)
  5. the profiles shipped with hpcjobs

The schema is the dataclass, as for the trainer's flags (hpcjobs.protocol.settings.schema): each YAML key is a field of
`ClusterProfile` (the `preemption:` mapping, a field of `Preemption`), its type, default and docstring are the key's,
and its constraints sit in the field's metadata: `choices`, `min`, `max` and `shown` as hpcjobs.protocol.settings.schema
says, and the loader's own:
  parse      a Slurm notation parser (time, memory) called as parse(value, key); it raises UsageError
  prefixes   the names an environment mapping may use
  max_items  the most entries of a list or mapping (default MAX_ITEMS)
  key        False for a field the loader fills in, never read from the file
  sbatch     the sbatch flag the field is, passed as it is (see ClusterProfile)
The validator and `hpcjobs.profiles.table.reference_table()` (docs/reference/profiles.md's keys) read the fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcjobs.profiles import yamlfile
from hpcjobs.profiles.container import Container
from hpcjobs.profiles.secrets import secret_name
from hpcjobs.profiles.shipped import data_dir
from hpcjobs.profiles.slurmtime import parse_mem_mb, parse_time
from hpcjobs.protocol.contract import Preemption, Recovery
from hpcjobs.protocol.errors import ProfileError, UsageError, shown
from hpcjobs.protocol.paths import expanded_path
from hpcjobs.protocol.planning.memory_plan import parse_gpu_memory
from hpcjobs.protocol.rankvars import RENDEZVOUS
from hpcjobs.protocol.schedulers import SCHEDULERS

GPU_REQUEST_FORMS = ("gpus-per-node", "gres", "none")
MAX_NODES = 100_000  # the most nodes any job may ask for, whatever the profile (larger than any cluster)
PROFILE_FILE = yamlfile.Kind("profile", "--profile", "keys, lists and one level of mappings (env, nccl, "
                             "preemption, recovery, container)", ProfileError)
MAX_ITEMS = 200  # the most entries of a list or mapping key (setup, srun_args, env, nccl)
MAX_STRING = 4096  # the longest string any key (or list entry, or environment value) may hold
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""Matched whole (fullmatch): `$` also matches before a final newline, and `A\n` would be `export A` and a line `=x`."""


@dataclass(frozen=True)
class ClusterProfile:
    """One cluster's facts and site conventions. Every field but `source` is a YAML key of the same name.

    A field whose metadata names an `sbatch` flag is that flag, passed as it is (true: the bare flag; none or false:
    left out) on both Slurm paths: adding such a field is the whole change a new pass-through flag needs."""

    name: str = field(metadata={"shown": "the file's name"})
    """The profile's name (the file name without .yaml unless given)."""
    source: str = field(metadata={"key": False})
    """Where the profile came from (a file path); filled in by the loader."""
    scheduler: str = field(default="slurm", metadata={"choices": SCHEDULERS})
    """Which scheduler runs the job; `local` runs it on this machine without Slurm."""
    partition: str | None = None
    """Slurm partition (`--partition`; the flag of the same name overrides it)."""
    account: str | None = None
    """Slurm account to charge (`--account`; the flag of the same name overrides it)."""
    qos: str | None = None
    """Slurm quality of service (`--qos`; the flag of the same name overrides it)."""
    gpus_per_node: int = field(default=8, metadata={"min": 1, "max": 64})
    """GPUs each node has; `--gpus` above it is refused. For `local`: the most ranks to start."""
    gpu_request: str = field(default="gpus-per-node", metadata={"choices": GPU_REQUEST_FORMS})
    """How the site wants GPUs asked for: `gpus-per-node` (`--gpus-per-node=N`), `gres` (`--gres=gpu[:type]:N`)
    or `none`."""
    gpu_type: str | None = None
    """GPU type for the request, e.g. `a100` gives `--gres=gpu:a100:8` or `--gpus-per-node=a100:8`."""
    cpus_per_gpu: int = field(default=1, metadata={"min": 1, "max": 1024, "sbatch": "cpus-per-task"})
    """CPUs per rank (one rank per GPU): `--cpus-per-task`; also the rank's torch threads."""
    mem_per_gpu: str | None = field(default=None, metadata={"parse": parse_mem_mb})
    """Memory per GPU (Slurm notation, e.g. `64G`): `--mem-per-gpu`, or `--mem` per node when gpu_request is
    `none`."""
    gpu_memory: str | None = field(default=None, metadata={"parse": parse_gpu_memory})
    """Memory of one GPU as its maker states it: `80GB` (H100, A100 80GB), `141GB` (H200), `192GB` (B200). A job
    of the bundled LM task that the memory plan says will not fit is refused before it is queued (none: not
    checked); `submit --dry-run` shows the plan."""
    max_nodes: int | None = field(default=None, metadata={"min": 1, "max": MAX_NODES})
    """The most nodes one job may ask for (none: no limit known)."""
    default_time: str = field(default="1:00:00", metadata={"parse": parse_time})
    """Time limit when `--time` is not given (Slurm notation)."""
    max_time: str | None = field(default=None, metadata={"parse": parse_time})
    """The partition's maximum time limit; a longer `--time` is refused (none: no limit known)."""
    constraint: str | None = field(default=None, metadata={"sbatch": "constraint"})
    """Node features (`--constraint`), e.g. `a100&ib`."""
    exclusive: bool = field(default=False, metadata={"sbatch": "exclusive"})
    """Ask for whole nodes (`--exclusive`)."""
    setup: tuple[str, ...] = field(default=(), metadata={"max_items": MAX_ITEMS})
    """Shell lines run before the job starts (module loads, venv activation), one line each."""
    env: dict[str, str] = field(default_factory=dict, metadata={"max_items": MAX_ITEMS})
    """Extra environment for every rank. A credential's value is refused here: list its name in `secrets`."""
    secrets: tuple[str, ...] = field(default=(), metadata={"max_items": MAX_ITEMS, "parse": secret_name})
    """Variables every rank takes from the submitting shell's environment: names only, a value is never written."""
    nccl: dict[str, str] = field(default_factory=dict,
                                 metadata={"prefixes": ("NCCL_", "TORCH_NCCL_"), "max_items": MAX_ITEMS})
    """NCCL settings for every rank (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG, ...); names start with `NCCL_`
    or `TORCH_NCCL_`."""
    preemption: Preemption = field(default_factory=Preemption)
    """Signal, warning time and restart cap (see Preemption)."""
    recovery: Recovery = field(default_factory=Recovery)  # see Recovery; --max-recoveries, --spare-nodes override
    group: str | None = None
    """A group that may read the run folders, snapshots and job store (else only their owner), e.g. `mlteam`."""
    runs_dir: str = "~/hpcjobs-runs"
    """Where run folders go (a shared filesystem on a cluster); `~` and `$VARS` are expanded (an unset one refused)."""
    python: str | None = field(default=None,
                               metadata={"shown": "`python3` after `setup`, else the one running hpcjobs"})
    """Python on the nodes. Default: `python3` as found on the node after `setup` when there is a setup (which
    usually activates the environment), then the one running hpcjobs (a shared filesystem); without a setup, the one
    running hpcjobs. A Slurm job checks that it imports torch and hpcjobs before any rank starts, and ends with one
    line if none does."""
    srun_args: tuple[str, ...] = field(default=(), metadata={"max_items": MAX_ITEMS})
    """Extra srun flags, e.g. `--cpu-bind=cores`."""
    container: Container = field(default_factory=Container)
    """The image every rank runs in (see Container and docs/how-to/containers.md)."""

    def runs_path(self) -> Path:
        return expanded_path(self.runs_dir, f"runs_dir {self.runs_dir} of profile {self.name} ({self.source})")


# --- the schema, read off the dataclasses ----------------------------------------------------------------------

Check = Callable[[Any], Any]
"""Returns the value as the dataclass holds it; raises ValueError(what is valid) or UsageError (a parser's)."""


def _keys(cls: type) -> dict[str, dataclasses.Field[Any]]:
    """The fields of `cls` that are YAML keys, by name."""
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("key", True)}


@functools.cache
def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed) for `X | None`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return rest[0], True
    return tp, False


def _int_valid(low: int | None, high: int | None) -> str:
    # "> 0" and ">= 0" read best for the usual lower bounds; any other one is spelled out.
    text = {None: "a whole number", 0: "a whole number >= 0", 1: "a whole number > 0"}.get(low, f"at least {low}")
    text += f", at most {high}" if high is not None else ""
    return text + ("" if low in (None, 0, 1) else " (a whole number)")


def _check_int(meta: Mapping[str, Any], key: str) -> Check:
    low, high = meta.get("min"), meta.get("max")

    def check(v: Any) -> int:
        if (isinstance(v, bool) or not isinstance(v, int) or (low is not None and v < low)
                or (high is not None and v > high)):
            raise ValueError(_int_valid(low, high))
        return v
    return check


def _check_bool(meta: Mapping[str, Any], key: str) -> Check:
    def check(v: Any) -> bool:
        if not isinstance(v, bool):
            raise ValueError("true or false")
        return v
    return check


def _one_line(v: str) -> bool:
    # Profile strings end up on lines of a shell script: a newline in a partition name would start a command.
    return "\n" not in v and "\r" not in v


def _check_str(meta: Mapping[str, Any], key: str) -> Check:
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


def _check_lines(meta: Mapping[str, Any], key: str) -> Check:
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
    if not isinstance(k, str) or not _ENV_NAME.fullmatch(k) or len(k) > MAX_STRING:
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


def _check_env(meta: Mapping[str, Any], key: str) -> Check:
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


_CHECKS: dict[Any, Callable[[Mapping[str, Any], str], Check]] = {
    bool: _check_bool, int: _check_int, str: _check_str, tuple: _check_lines, dict: _check_env,
}
"""How a field's type is checked (its metadata says the rest)."""


def _checker(tp: Any, meta: Mapping[str, Any], key: str) -> Check:
    base, optional = _unwrap_optional(tp)
    check = _CHECKS[typing.get_origin(base) or base](meta, key)
    return (lambda v: None if v is None else check(v)) if optional else check


# --- validation ---------------------------------------------------------------------------------------------------


def _unknown_key(source: str, key: object, valid: list[str], where: str = "") -> ProfileError:
    close = difflib.get_close_matches(str(key), valid, n=1)
    maybe = f" Did you mean {close[0]!r}?" if close else ""
    return ProfileError(
        f"profile {source}: unknown key {where}{shown(key)}.{maybe} Valid keys: {', '.join(valid)}.",
        "see the commented keys in cluster_profiles/local.yaml or `hpcjobs profiles show local`.",
    )


def _check(source: str, key: str, check: Check, value: Any) -> Any:
    try:
        return check(value)
    except ValueError as e:
        raise ProfileError(f"profile {source}: {key} is {shown(value)}; valid: {e}.",
                           f"fix {key} in {source}.") from None
    except UsageError as e:  # a Slurm notation parser's, which names the key and the valid forms itself
        raise ProfileError(f"profile {source}: {e.message}", f"fix {key} in {source}.") from None


def _parse_mapping(cls: type, data: Mapping[Any, Any], source: str, where: str = "") -> dict[str, Any]:
    """The checked values of a mapping whose keys are the fields of `cls`; a nested dataclass field is a nested
    mapping, its keys named `where.key` in messages."""
    fields, hints = _keys(cls), _types(cls)
    values: dict[str, Any] = {}
    for key, raw in data.items():
        if key not in fields:
            raise _unknown_key(source, key, sorted(fields), where)
        path = f"{where}{key}"
        if dataclasses.is_dataclass(hints[key]):
            values[key] = _parse_nested(hints[key], raw, source, path)
        else:
            values[key] = _check(source, path, _checker(hints[key], fields[key].metadata, path), raw)
    return values


def _parse_nested(cls: type, raw: Any, source: str, key: str) -> Any:
    if raw is None:
        return cls()  # every key commented out: the defaults
    if not isinstance(raw, dict):
        raise ProfileError(f"profile {source}: {key} is {shown(raw)}; valid: a mapping with "
                           f"{', '.join(_keys(cls))}.", f"fix {key} in {source}.")
    return cls(**_parse_mapping(cls, raw, source, f"{key}."))


def parse_profile(data: Any, name: str, source: str) -> ClusterProfile:
    """Validate a loaded YAML document into a ClusterProfile (pure; raises ProfileError)."""
    if data is None:  # an empty file, or one of comments only: never a job from defaults by accident
        raise ProfileError(f"profile {source} holds no keys (it is empty or only comments); valid: a mapping of "
                           "keys.", "start from a copy of cluster_profiles/local.yaml, or check that the file was "
                           "saved whole.")
    if not isinstance(data, dict):
        raise ProfileError(f"profile {source}: the top level is a {type(data).__name__}; valid: a mapping of keys.",
                           "start from a copy of cluster_profiles/local.yaml.")
    profile = ClusterProfile(**{"name": name, **_parse_mapping(ClusterProfile, data, source), "source": source})
    if profile.max_time and parse_time(profile.default_time) > parse_time(profile.max_time):
        raise ProfileError(f"profile {source}: default_time {profile.default_time} is above max_time "
                           f"{profile.max_time}.", "lower default_time or raise max_time.")
    return profile


# --- lookup ---------------------------------------------------------------------------------------------------


def search_dirs(cwd: Path | None = None) -> list[tuple[str, Path]]:
    """Where profiles are looked for, in order, each with a label saying where it came from."""
    dirs: list[tuple[str, Path]] = []
    for d in filter(None, os.environ.get("HPCJOBS_PROFILES_DIR", "").split(os.pathsep)):
        dirs.append(("$HPCJOBS_PROFILES_DIR", Path(d)))
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return [*dirs, ("working dir", (cwd or Path.cwd()) / "cluster_profiles"),
            ("user config", config_home / "hpcjobs" / "profiles"), ("shipped", data_dir("cluster_profiles"))]


def available_profiles() -> list[tuple[str, str, Path]]:
    """(name, origin, path) of every profile found, the first one of each name winning."""
    seen: dict[str, tuple[str, str, Path]] = {}
    for origin, folder in search_dirs():
        for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            if path.is_file():  # a folder named x.yaml is no profile: find_profile would not take it either
                seen.setdefault(path.stem, (path.stem, origin, path))
    return list(seen.values())


def find_profile(name_or_path: str) -> Path:
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        path = Path(name_or_path).expanduser()
        try:
            is_dir, is_file = path.is_dir(), path.is_file()
        except OSError as e:  # a name too long for the filesystem, a folder on the way that may not be searched
            raise ProfileError(f"profile path {shown(name_or_path)} cannot be looked up ({e.strerror}); valid: a "
                               "path to a .yaml file.", "give a path to a .yaml file or a profile name; `hpcjobs "
                               "profiles` lists names.") from None
        if is_dir:
            raise ProfileError(f"profile path {name_or_path!r} is a folder; valid: a .yaml file.",
                               "name the .yaml file in it, or put the folder on $HPCJOBS_PROFILES_DIR.")
        if not is_file:
            raise ProfileError(f"profile file {name_or_path!r} does not exist.",
                               "give a path to a .yaml file or a profile name; `hpcjobs profiles` lists names.")
        return path
    for _, folder in search_dirs():
        path = folder / f"{name_or_path}.yaml"
        with contextlib.suppress(OSError):  # a name too long for the filesystem is no profile's, in any folder
            if path.is_file():
                return path
    names = [n for n, _, _ in available_profiles()]
    close = difflib.get_close_matches(name_or_path, names, n=1)
    maybe = f" Did you mean {close[0]!r}?" if close else ""
    raise ProfileError(f"no profile named {name_or_path!r}.{maybe} Available: {', '.join(names) or 'none'}.",
                       "`hpcjobs profiles` lists them with where each came from; or pass a path to a .yaml file.")


def load_profile(name_or_path: str) -> ClusterProfile:
    path = find_profile(name_or_path)
    return parse_profile(yamlfile.load(PROFILE_FILE, path), path.stem, str(path))


def profile_as_dict(profile: ClusterProfile) -> dict[str, Any]:
    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, tuple) else {k: plain(x) for k, x in v.items()} \
            if isinstance(v, dict) else v
    return plain(dataclasses.asdict(profile))
