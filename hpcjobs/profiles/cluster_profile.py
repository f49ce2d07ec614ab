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
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcjobs.profiles import yamlfile
from hpcjobs.profiles.container import Container
from hpcjobs.profiles.keycheck import MAX_ITEMS, parse_mapping
from hpcjobs.profiles.secrets import secret_name
from hpcjobs.profiles.shipped import data_dir
from hpcjobs.profiles.slurmtime import parse_mem_mb, parse_time
from hpcjobs.profiles.storage import Storage
from hpcjobs.protocol.contract import Preemption, Recovery
from hpcjobs.protocol.errors import ProfileError, shown
from hpcjobs.protocol.paths import expanded_path
from hpcjobs.protocol.planning.memory_plan import parse_gpu_memory
from hpcjobs.protocol.schedulers import SCHEDULERS

GPU_REQUEST_FORMS = ("gpus-per-node", "gres", "none")
MAX_NODES = 100_000  # the most nodes any job may ask for, whatever the profile (larger than any cluster)
PROFILE_FILE = yamlfile.Kind("profile", "--profile", "keys, lists and one level of mappings (env, nccl, "
                             "preemption, recovery, container, storage)", ProfileError)


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
    storage: Storage = field(default_factory=Storage)
    """How fast checkpoints are written to runs_dir (see Storage)."""

    def runs_path(self) -> Path:
        return expanded_path(self.runs_dir, f"runs_dir {self.runs_dir} of profile {self.name} ({self.source})")


def parse_profile(data: Any, name: str, source: str) -> ClusterProfile:
    """Validate a loaded YAML document into a ClusterProfile (pure; raises ProfileError)."""
    if data is None:  # an empty file, or one of comments only: never a job from defaults by accident
        raise ProfileError(f"profile {source} holds no keys (it is empty or only comments); valid: a mapping of "
                           "keys.", "start from a copy of cluster_profiles/local.yaml, or check that the file was "
                           "saved whole.")
    if not isinstance(data, dict):
        raise ProfileError(f"profile {source}: the top level is a {type(data).__name__}; valid: a mapping of keys.",
                           "start from a copy of cluster_profiles/local.yaml.")
    profile = ClusterProfile(**{"name": name, **parse_mapping(ClusterProfile, data, source), "source": source})
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
