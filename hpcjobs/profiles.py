"""Cluster profiles: find them, load the YAML, validate every key, return a frozen ClusterProfile.

A profile holds the facts of one cluster (what a node has, how the site wants GPUs asked for, where runs go), so
builders never ask the cluster (no `sinfo` at submit time). Lookup order for a name, first match wins:
  1. a path (anything with a `/` or ending in .yaml/.yml)
  2. $HPCJOBS_PROFILES_DIR (one or more folders, `:`-separated)
  3. ./cluster_profiles/ in the working directory
  4. the user config folder: $XDG_CONFIG_HOME/hpcjobs/profiles (default ~/.config/hpcjobs/profiles)
  5. the profiles shipped with hpcjobs
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from hpcjobs.contract import SIGNALS, Preemption
from hpcjobs.errors import ProfileError, UsageError
from hpcjobs.resources import data_dir
from hpcjobs.slurmtime import parse_mem_mb, parse_time

GPU_REQUEST_FORMS = ("gpus-per-node", "gres", "none")
SCHEDULERS = ("slurm", "local")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ClusterProfile:
    """One cluster's facts and site conventions. Every field is a YAML key of the same name."""

    name: str
    """The profile's name (the file name without .yaml unless given)."""
    source: str
    """Where the profile came from (a file path); filled in by the loader."""
    scheduler: str = "slurm"
    """`slurm`, or `local` to run on this machine without Slurm."""
    partition: str | None = None
    """Slurm partition (`--partition`)."""
    account: str | None = None
    """Slurm account to charge (`--account`)."""
    qos: str | None = None
    """Slurm quality of service (`--qos`)."""
    gpus_per_node: int = 8
    """GPUs each node has; a request for more per node is refused. For `local`: the most ranks to start."""
    gpu_request: str = "gpus-per-node"
    """How the site wants GPUs asked for: `gpus-per-node` (--gpus-per-node=N), `gres` (--gres=gpu[:type]:N), `none`."""
    gpu_type: str | None = None
    """GPU type for the request, e.g. `a100` gives --gres=gpu:a100:8 or --gpus-per-node=a100:8."""
    cpus_per_gpu: int = 1
    """CPUs per rank (one rank per GPU): `--cpus-per-task`."""
    mem_per_gpu: str | None = None
    """Memory per GPU (Slurm notation, e.g. 64G): `--mem-per-gpu`, or `--mem` per node when gpu_request is none."""
    max_nodes: int | None = None
    """The most nodes one job may ask for (None: no limit known)."""
    default_time: str = "1:00:00"
    """Time limit when --time is not given (Slurm notation)."""
    max_time: str | None = None
    """The partition's maximum time limit; a longer --time is refused (None: no limit known)."""
    constraint: str | None = None
    """Node features (`--constraint`), e.g. `a100&ib`."""
    exclusive: bool = False
    """Ask for whole nodes (`--exclusive`)."""
    setup: tuple[str, ...] = ()
    """Shell lines run before the job starts (module loads, venv activation)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every rank."""
    nccl: dict[str, str] = field(default_factory=dict)
    """NCCL settings for every rank (NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_DEBUG, ...); keys start with NCCL_."""
    preemption: Preemption = field(default_factory=Preemption)
    """Signal, warning time and restart cap (see Preemption)."""
    runs_dir: str = "~/hpcjobs-runs"
    """Where run folders go (a shared filesystem on a cluster); ~ and $VARS are expanded."""
    python: str | None = None
    """Python on the nodes (None: the one running hpcjobs, which suits a shared filesystem)."""
    srun_args: tuple[str, ...] = ()
    """Extra srun flags, e.g. --cpu-bind=cores."""

    def runs_path(self) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(self.runs_dir)))


# --- validation -------------------------------------------------------------------------------------------------

Check = Callable[[Any], Any]


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(v: Any) -> Any:
        if v not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        return v
    return check


def _typed(kind: type, positive: bool = False, optional: bool = False) -> Check:
    def check(v: Any) -> Any:
        if v is None and optional:
            return None
        if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError("a whole number" + (" > 0" if positive else ""))
        if kind is str and not isinstance(v, str):
            raise ValueError("a string")
        if kind is bool and not isinstance(v, bool):
            raise ValueError("true or false")
        if positive and v <= 0:
            raise ValueError("a whole number > 0")
        return v
    return check


def _nonneg_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError("a whole number >= 0")
    return v


def _time(optional: bool) -> Check:
    def check(v: Any) -> Any:
        if v is None and optional:
            return None
        parse_time(v if isinstance(v, (str, int)) else repr(v))
        return str(v)
    return check


def _mem(v: Any) -> Any:
    if v is None:
        return None
    parse_mem_mb(v)
    return str(v)


def _lines(v: Any) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("a list of strings")
    if any("\n" in x for x in v):
        raise ValueError("a list of single-line strings")
    return tuple(v)


def _env_map(prefixes: tuple[str, ...] = ()) -> Check:
    def check(v: Any) -> dict[str, str]:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError("a mapping NAME: value")
        out = {}
        for k, val in v.items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                raise ValueError(f"environment names (letters, digits, _), not {k!r}")
            if prefixes and not k.startswith(prefixes):
                raise ValueError(f"names starting with {' or '.join(prefixes)}, not {k!r}")
            if isinstance(val, bool) or not isinstance(val, (str, int, float)):
                raise ValueError(f"scalar values, not {val!r} for {k}")
            out[k] = str(val)
        return out
    return check


_PREEMPTION_KEYS: dict[str, Check] = {
    "signal": _one_of(SIGNALS),
    "seconds_before": _typed(int, positive=True),
    "max_restarts": _nonneg_int,
}

_KEYS: dict[str, Check] = {
    "name": _typed(str),
    "scheduler": _one_of(SCHEDULERS),
    "partition": _typed(str, optional=True),
    "account": _typed(str, optional=True),
    "qos": _typed(str, optional=True),
    "gpus_per_node": _typed(int, positive=True),
    "gpu_request": _one_of(GPU_REQUEST_FORMS),
    "gpu_type": _typed(str, optional=True),
    "cpus_per_gpu": _typed(int, positive=True),
    "mem_per_gpu": _mem,
    "max_nodes": _typed(int, positive=True, optional=True),
    "default_time": _time(optional=False),
    "max_time": _time(optional=True),
    "constraint": _typed(str, optional=True),
    "exclusive": _typed(bool),
    "setup": _lines,
    "env": _env_map(),
    "nccl": _env_map(("NCCL_", "TORCH_NCCL_")),
    "preemption": lambda v: v,  # checked key by key below
    "runs_dir": _typed(str),
    "python": _typed(str, optional=True),
    "srun_args": _lines,
}


def _unknown_key(source: str, key: object, valid: list[str], where: str = "") -> ProfileError:
    close = difflib.get_close_matches(str(key), valid, n=1)
    maybe = f" Did you mean {close[0]!r}?" if close else ""
    return ProfileError(
        f"profile {source}: unknown key {where}{key!r}.{maybe} Valid keys: {', '.join(valid)}.",
        "see the commented keys in cluster_profiles/local.yaml or `hpcjobs profiles show local`.",
    )


def _check(source: str, key: str, check: Check, value: Any) -> Any:
    try:
        return check(value)
    except (ValueError, UsageError) as e:
        valid = e.message if isinstance(e, UsageError) else str(e)
        raise ProfileError(f"profile {source}: {key} is {value!r}; valid: {valid}.",
                           f"fix {key} in {source}.") from None


def parse_profile(data: Any, name: str, source: str) -> ClusterProfile:
    """Validate a loaded YAML document into a ClusterProfile (pure; raises ProfileError)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ProfileError(f"profile {source}: the top level is a {type(data).__name__}; valid: a mapping of keys.",
                           "start from a copy of cluster_profiles/local.yaml.")
    values: dict[str, Any] = {"name": name}
    for key, raw in data.items():
        if key not in _KEYS:
            raise _unknown_key(source, key, sorted(_KEYS))
        values[key] = _check(source, key, _KEYS[key], raw)
    pre = values.get("preemption")
    if pre is not None:
        if not isinstance(pre, dict):
            raise ProfileError(f"profile {source}: preemption is {pre!r}; valid: a mapping with "
                               f"{', '.join(_PREEMPTION_KEYS)}.", f"fix preemption in {source}.")
        for key, raw in pre.items():
            if key not in _PREEMPTION_KEYS:
                raise _unknown_key(source, key, sorted(_PREEMPTION_KEYS), "preemption.")
            _check(source, f"preemption.{key}", _PREEMPTION_KEYS[key], raw)
        values["preemption"] = Preemption(**pre)
    profile = ClusterProfile(source=source, **values)
    if profile.max_time and parse_time(profile.default_time) > parse_time(profile.max_time):
        raise ProfileError(f"profile {source}: default_time {profile.default_time} is above max_time "
                           f"{profile.max_time}.", "lower default_time or raise max_time.")
    if profile.scheduler == "slurm" and profile.preemption.seconds_before < 10:
        raise ProfileError(f"profile {source}: preemption.seconds_before is {profile.preemption.seconds_before}; "
                           "valid: at least 10.", "leave time to save a checkpoint, e.g. 90.")
    return profile


# --- lookup ---------------------------------------------------------------------------------------------------


def search_dirs(cwd: Path | None = None) -> list[tuple[str, Path]]:
    """Where profiles are looked for, in order, each with a label saying where it came from."""
    dirs: list[tuple[str, Path]] = []
    for d in filter(None, os.environ.get("HPCJOBS_PROFILES_DIR", "").split(os.pathsep)):
        dirs.append(("$HPCJOBS_PROFILES_DIR", Path(d)))
    dirs.append(("working dir", (cwd or Path.cwd()) / "cluster_profiles"))
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    dirs.append(("user config", config_home / "hpcjobs" / "profiles"))
    dirs.append(("shipped", data_dir("cluster_profiles")))
    return dirs


def available_profiles() -> list[tuple[str, str, Path]]:
    """(name, origin, path) of every profile found, the first one of each name winning."""
    seen: dict[str, tuple[str, str, Path]] = {}
    for origin, folder in search_dirs():
        for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            seen.setdefault(path.stem, (path.stem, origin, path))
    return list(seen.values())


def find_profile(name_or_path: str) -> Path:
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ProfileError(f"profile file {name_or_path!r} does not exist.",
                               "give a path to a .yaml file or a profile name; `hpcjobs profiles` lists names.")
        return path
    for _, folder in search_dirs():
        path = folder / f"{name_or_path}.yaml"
        if path.is_file():
            return path
    names = [n for n, _, _ in available_profiles()]
    close = difflib.get_close_matches(name_or_path, names, n=1)
    maybe = f" Did you mean {close[0]!r}?" if close else ""
    raise ProfileError(f"no profile named {name_or_path!r}.{maybe} Available: {', '.join(names) or 'none'}.",
                       "`hpcjobs profiles` lists them with where each came from; or pass a path to a .yaml file.")


def load_profile(name_or_path: str) -> ClusterProfile:
    path = find_profile(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ProfileError(f"profile {path}:{where} is not valid YAML ({getattr(e, 'problem', e)}).",
                           "check indentation and quoting; values with ':' or '#' need quotes.") from None
    except OSError as e:
        raise ProfileError(f"profile {path} cannot be read ({e.strerror}).", "check the file's permissions.") from None
    return parse_profile(data, path.stem, str(path))


def profile_as_dict(profile: ClusterProfile) -> dict[str, Any]:
    out = dataclasses.asdict(profile)
    out["setup"] = list(profile.setup)
    out["srun_args"] = list(profile.srun_args)
    return out
