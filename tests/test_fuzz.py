"""Property-based fuzzing of cluster profiles and CLI flags (issue #13): whatever profile or flags a user gives,
`hpcjobs` ends in exit 0, or in exit 2 with one line on stderr naming what was given, what is valid and a HINT; never
a traceback (nor exit 1 from an exception nobody caught); and on exit 2 nothing was submitted and no job recorded.

`main(argv)` runs in-process (a Python start per example would spend the whole time budget), each example in a fresh
folder that is its working directory, $HOME and $HPCJOBS_HOME, so whatever a generated path makes stays in there.
Submission is watched at its real side effects rather than mocked out above them, so every check on the way runs as
it does for a user:
  - Slurm: a recording `sbatch` first on PATH (submitit runs it) keeps a copy of the script and answers with a job
    id, as Slurm does;
  - local: rank 0's command line, environment and folder go to Popen as for a real start, with /bin/true run instead;
  - the Slurm backend's read-only commands answer "command not found" (no cluster is asked, not even on the test
    cluster's login node), and doctor's probe job, a real submission, is recorded.
Beyond exit codes: whatever is accepted has an #SBATCH header of whole one-line directives and environment names that
are names; what a dry run accepts, a submission submits, once; and the entry itself never runs on the submit side.
An uncaught exception is left to propagate: hypothesis then shrinks the input and prints the traceback. The bugs it
found are pinned as @example cases. The example database is off and hypothesis' caches go to the temp folder: no
.hypothesis/ folder in the checkout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from conftest import REPO
from hpcjobs.backends.local import queue as local_queue
from hpcjobs.backends.local.queue import rank_envs
from hpcjobs.backends.slurm import probe as slurm_probe
from hpcjobs.backends.slurm import slurm as slurm_backend
from hpcjobs.cli import main
from hpcjobs.jobs.store import JobStore
from hpcjobs.profiles.cluster_profile import GPU_REQUEST_FORMS, ClusterProfile
from hpcjobs.profiles.yamlfile import MAX_FILE_BYTES
from hpcjobs.protocol.contract import SIGNALS
from hpcjobs.request.render import launcher_argv

# Hypothesis keeps caches (constants, unicode data) in ./.hypothesis even with the example database off: not in the
# checkout. The variable is read when it first writes them, in the first test (a user's own setting wins).
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "hpcjobs-hypothesis"))

SLOW_S = 10
"""The longest one command may take here (they take milliseconds; generous for a loaded 2-core machine): for inputs
cheap to write and costly to read, such as a YAML alias nested in itself (a 342-byte profile that took 25 s)."""

FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
ENTRY = "trainers.tasks.lm"
HELP = frozenset({"-h", "--help"})
"""Left out of generated entry arguments: after the entry they ask the entry for its help, in a child Python."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
TRUE = shutil.which("true") or "/bin/true"

TRAIN_PY = "import pathlib\npathlib.Path(__file__).with_name('entry-ran').touch()\nprint('training')\n"
"""The example's script entry. It leaves a mark if it ever runs: nothing on the submit side may run it."""
SHIM = """#!/bin/sh
# Records the call and keeps the script it was given; answers as Slurm does (submitit reads the job id from it).
echo sbatch >> "$HPCJOBS_FUZZ_DIR/submitted"
for last; do :; done
cp "$last" "$HPCJOBS_FUZZ_DIR/script.$$" 2>/dev/null
echo "Submitted batch job 4242"
"""


# --- running the CLI -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    argv: list[str]
    code: int
    out: str
    err: str
    submitted: list[str]
    """Every submission the guards saw: sbatch calls, local rank starts, doctor probes."""
    scripts: list[str]
    """The scripts the recording sbatch was given."""
    records: int
    """Jobs in the job store afterwards."""
    entry_ran: bool
    """Whether train.py ran (it never may: it is the job, not the request)."""
    seconds: float


@dataclasses.dataclass(frozen=True)
class Sandbox:
    root: Path
    shim: Path
    profiles: Path


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    root = tmp_path_factory.mktemp("fuzz")
    shim = root / "bin"
    shim.mkdir()
    (shim / "sbatch").write_text(SHIM)
    (shim / "sbatch").chmod(0o755)
    # The shipped profiles by name, with their run folders relative to each example's folder: a submission that gets
    # through must not make /scratch/... or /tmp/hpcjobs-runs/... on this machine. $HPCJOBS_PROFILES_DIR comes first.
    profiles = root / "profiles"
    profiles.mkdir()
    for path in sorted((REPO / "cluster_profiles").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        data["runs_dir"] = "runs"
        (profiles / path.name).write_text(yaml.safe_dump(data))
    return Sandbox(root, shim, profiles)


@contextlib.contextmanager
def _chdir(path: Path) -> Iterator[None]:
    # contextlib.chdir is 3.11+; the project supports 3.10.
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _no_slurm(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The Slurm backend's read-only commands (doctor's scontrol, sacctmgr and sbatch --test-only; squeue and sacct),
    as on a machine without Slurm."""
    return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: command not found")


@contextlib.contextmanager
def example_folder(sandbox: Sandbox) -> Iterator[Path]:
    """A fresh working directory with a script entry (train.py) and an existing file to refuse overwriting."""
    with tempfile.TemporaryDirectory(dir=sandbox.root) as box:
        work = Path(box) / "work"
        work.mkdir()
        (work / "train.py").write_text(TRAIN_PY)
        (work / "exists.sbatch").write_text("precious\n")
        yield work


def run_cli(sandbox: Sandbox, work: Path, argv: list[str]) -> Outcome:
    box = work.parent
    home = box / "store"
    submitted: list[str] = []

    def ranks_started(spec: Any, sub: Any, slot: int | None, stdout_to_stderr: bool,
                      restart: int = 0, port: int = 0) -> list[subprocess.Popen[bytes]]:
        """Instead of training: rank 0's command line, environment and folder go to Popen as the real start gives
        them, with /bin/true run in their place (Popen refuses what it would refuse for a real rank, e.g. a NUL)."""
        submitted.append(f"local {sub.job_id}")
        env = rank_envs(spec, sub.job_id, 0, dict(os.environ), restart)[0]
        return [subprocess.Popen(launcher_argv(spec), executable=TRUE, env=env, cwd=spec.workdir)]

    def probe(spec: Any, wait_s: float) -> list[Any]:
        submitted.append("doctor --probe")
        return []

    env = {"HOME": str(work), "HPCJOBS_HOME": str(home), "XDG_CONFIG_HOME": str(box / "config"),
           "HPCJOBS_PROFILES_DIR": str(sandbox.profiles), "HPCJOBS_FUZZ_DIR": str(box),
           "PATH": f"{sandbox.shim}{os.pathsep}{os.environ['PATH']}"}
    out, err = io.StringIO(), io.StringIO()
    modules = set(sys.modules)
    start = time.monotonic()
    with (mock.patch.dict(os.environ, env), _chdir(work),
          mock.patch.object(local_queue, "start_ranks", ranks_started),
          mock.patch.object(slurm_backend.BACKEND, "run", _no_slurm),
          mock.patch.object(slurm_probe, "run_probe", probe),
          contextlib.redirect_stdout(out), contextlib.redirect_stderr(err)):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: --help, --version and its usage errors
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        finally:  # whatever this example imported from its own folder must not answer for the next one
            for name in set(sys.modules) - modules:
                if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(box)):
                    del sys.modules[name]
    seconds = time.monotonic() - start
    log = box / "submitted"
    submitted += log.read_text().split() if log.exists() else []
    scripts = [p.read_text(errors="replace") for p in sorted(box.glob("script.*"))]
    records = len(JobStore(home / "jobs.sqlite").recent(10**6)) if (home / "jobs.sqlite").exists() else 0
    entry_ran = (work / "entry-ran").exists()
    return Outcome(argv, code, out.getvalue(), err.getvalue(), submitted, scripts, records, entry_ran, seconds)


# --- the contract ----------------------------------------------------------------------------------------------


def assert_contract(o: Outcome, allowed: tuple[int, ...] = (0, 2)) -> None:
    """Exit 0, or exit 2 with one line (what was given, what is valid, a HINT) and nothing submitted or recorded."""
    assert "Traceback" not in o.err + o.out, o
    assert not o.entry_ran, f"the entry ran on the submit side: {o.argv}"
    assert o.code in allowed, o
    assert o.seconds < SLOW_S, f"took {o.seconds:.1f} s: {o.argv}"
    if o.code != 2:
        return
    assert not o.submitted, f"exit 2, yet submitted: {o.submitted}"
    assert o.records == 0, f"exit 2, yet {o.records} job(s) recorded"
    line = o.err[:-1] if o.err.endswith("\n") else o.err
    assert line.strip() and not line.splitlines()[1:], f"exit 2 must say why in one line, not {o.err!r}"
    assert "HINT:" in line, line
    assert o.out == "", f"exit 2 printed on stdout: {o.out!r}"


def assert_header_intact(script: str) -> None:
    """sbatch reads #SBATCH lines up to the first command: each must be one whole directive. A newline in a value
    would end the header there and run the rest of the value as a shell line."""
    lines = script.split("\n")  # the shell's line breaks, not str.splitlines' (which also splits on \x0b, \u2028, ...)
    directives = [i for i, line in enumerate(lines) if line.startswith("#SBATCH ")]
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert directives and directives[-1] < first_command, script[:2000]
    for i in directives:
        try:
            words = shlex.split(lines[i].removeprefix("#SBATCH "))
        except ValueError as e:  # an unclosed quote: the value went on past the line
            raise AssertionError(f"line {i + 1} is not a whole directive ({e}): {lines[i]!r}") from None
        assert len(words) == 1, lines[i]


def assert_submitted_once(o: Outcome) -> None:
    """A submission that got through was seen by the guards once, recorded once, and its script is whole. A sweep
    is one sbatch (an array) and a record per task; locally, a start and a record per task."""
    local = [s for s in o.submitted if s.startswith("local")]
    assert o.records >= 1 and (len(local) == o.records if local else len(o.submitted) == 1), o
    assert o.records == 1 or any(f in o.argv for f in ("--sweep", "--sweep-file")), o
    for script in o.scripts:
        assert_header_intact(script)


# --- strategies: values --------------------------------------------------------------------------------------------

ODD_STRINGS = ["", " ", "0", "-1", "yes", "no", "null", "~", "1:00:00", "99:99", "64G", "'", '"', "a;b",
               "$(reboot)", "`id`", "a\nb", "x\n", "\r", "\t", "é", "🚀", "\u2028", "\x00", "x" * 5000, "%j", "%a",
               "--x", "NCCL_", "[", "{", "*a", "&a", "#", ": ", "- a"]
ODD_INTS = [0, -1, 2**31, 2**63, 10**40]

texts = st.text(max_size=30)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.integers(), st.sampled_from(ODD_INTS),
                    st.floats(), st.sampled_from(ODD_STRINGS), texts)
junk = st.recursive(scalars, lambda kids: st.one_of(
    st.lists(kids, max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=10), st.integers(), st.booleans(), st.none()), kids, max_size=3)),
    max_leaves=8)
"""Any value YAML can hold: wrong types, bounds and beyond, odd strings, nested junk."""

words = st.from_regex(r"[a-z][a-z0-9_.-]{0,11}", fullmatch=True)
env_names = st.from_regex(r"[A-Z_][A-Z0-9_]{0,11}", fullmatch=True)


def slurm_times() -> st.SearchStrategy[str]:
    """Every form of a Slurm time (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS), fields in and past their units."""
    n = st.one_of(st.integers(0, 70), st.integers(0, 10**12))
    forms = ["{a}", "{a}:{b:02d}", "{a}:{b:02d}:{c:02d}", "{d}-{a}", "{d}-{a}:{b:02d}", "{d}-{a}:{b:02d}:{c:02d}"]
    return st.builds(lambda f, d, a, b, c: f.format(d=d, a=a, b=b, c=c), st.sampled_from(forms),
                     st.integers(0, 3), n, st.integers(0, 70), st.integers(0, 70))


mem_sizes = st.builds(lambda n, u: f"{n}{u}", st.one_of(st.integers(0, 10**6), st.integers(0, 10**500)),
                      st.sampled_from(["", "K", "M", "G", "T", "g", "KB"]))


def inside(path: str) -> bool:
    """Whether a path stays in the example's folder (also $HOME): relative or under `~/`, no `..`, no `$VAR`
    (runs_dir expands them), no `~user` (another user's home)."""
    home = path.startswith("~/")
    return (bool(path.strip()) and ".." not in path and "$" not in path
            and (home or not path.startswith(("/", "~"))))


def relative_paths() -> st.SearchStrategy[str]:
    """Run folders inside the example's folder, of any characters otherwise (a NUL, a newline, a 300-byte name, a
    Slurm pattern)."""
    part = st.one_of(words, st.sampled_from(["%j", "x-%j", "%A", "%a", "a b", "é", "x\ny", "x\x00y", "a" * 300]),
                     st.text(min_size=1, max_size=8))
    return st.lists(part, min_size=1, max_size=3).map("/".join).filter(inside)


# --- strategies: profiles ---------------------------------------------------------------------------------------

GOOD: dict[str, st.SearchStrategy[Any]] = {
    "name": words,
    "scheduler": st.sampled_from(["slurm", "local"]),
    "partition": words, "account": words, "qos": words, "gpu_type": words, "constraint": words,
    "gpus_per_node": st.integers(1, 64),
    "gpu_request": st.sampled_from(GPU_REQUEST_FORMS),
    "cpus_per_gpu": st.integers(1, 1024),
    "mem_per_gpu": mem_sizes,
    "gpu_memory": st.builds(lambda n, u: f"{n}{u}", st.one_of(st.integers(1, 10**4), st.integers(0, 10**500)),
                            st.sampled_from(["GB", "G", "GiB", "TB", "gb", ""])),
    "max_nodes": st.integers(1, 100_000),
    "default_time": st.sampled_from(["30", "1:00:00", "4:00:00", "0-12"]),
    "max_time": st.sampled_from(["1-00:00:00", "3-00", "7-00:00:00"]),
    "exclusive": st.booleans(),
    "setup": st.lists(st.sampled_from(["module load cuda", "source venv/bin/activate", "echo 'a;b' \"$X\""])),
    "env": st.dictionaries(env_names, st.one_of(words, st.integers(), st.floats(allow_nan=False)), max_size=3),
    "secrets": st.lists(st.sampled_from(["HOME", "PATH"]), max_size=2),  # set in every shell (issue 39)
    "group": st.just(grp.getgrgid(os.getgid()).gr_name),
    "nccl": st.dictionaries(env_names.map(lambda n: f"NCCL_{n}"), words, max_size=3),
    "preemption": st.fixed_dictionaries({}, optional={"signal": st.sampled_from(SIGNALS),
                                                      "seconds_before": st.integers(10, 600),
                                                      "max_restarts": st.integers(0, 10_000)}),
    "recovery": st.fixed_dictionaries({}, optional={"max_recoveries": st.integers(0, 1000),
                                                    "spare_nodes": st.integers(0, 64),
                                                    "hang_min_s": st.integers(5, 86_400)}),
    "storage": st.fixed_dictionaries({}, optional={"write_gb_per_s": st.one_of(
        st.floats(min_value=0.001, max_value=10_000), st.sampled_from(["2", "0.5", 3])).map(str)}),
    "runs_dir": st.one_of(words, st.sampled_from(["runs/%j", "a b/é", "~/runs"])),
    "python": st.sampled_from([sys.executable, "python3"]),
    "srun_args": st.lists(st.sampled_from(["--cpu-bind=cores", "--mpi=none"]), max_size=2),
    "container": st.fixed_dictionaries({}, optional={"runtime": st.sampled_from(["none", "pyxis"]),
                                                     "image": st.sampled_from(["nvcr.io#nvidia/pytorch:24.05"]),
                                                     "mounts": st.lists(st.sampled_from(["/data:/data:ro", "/a:/b"])),
                                                     "workdir": st.sampled_from(["/work"]),
                                                     "flags": st.lists(st.sampled_from(["--container-remap-root"]))}),
}
KEYS = [f.name for f in dataclasses.fields(ClusterProfile) if f.metadata.get("key", True)]
assert sorted(GOOD) == sorted(KEYS), "a profile key was added or removed: give it good values here"
PREEMPTION_KEYS = ["signal", "seconds_before", "max_restarts"]
STRING_KEYS = ["name", "partition", "account", "qos", "gpu_type", "constraint", "runs_dir", "python", "mem_per_gpu",
               "gpu_memory", "default_time", "max_time", "scheduler", "gpu_request"]
YAML_CHARS = st.sampled_from(list(":-[]{}'\"&*!|>%@#,?\n\t ") + ["a", "1", "partition", "env", "é", "\\"])


def _safe_runs_dir(doc: dict[Any, Any]) -> dict[Any, Any]:
    """A runs_dir string that a submission could turn into a folder outside the example's folder becomes `runs`."""
    if isinstance(doc.get("runs_dir"), str) and not inside(doc["runs_dir"]):
        doc["runs_dir"] = "runs"
    return doc


@st.composite
def profile_mappings(draw: st.DrawFn) -> dict[Any, Any]:
    """A mapping of valid keys and values (any subset), then up to three mutations: an odd string where a string
    goes, a key's value turned to junk, an unknown or misspelt key, a preemption key turned to junk."""
    doc: dict[Any, Any] = draw(st.fixed_dictionaries({}, optional=GOOD))
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):  # a third of them valid
        kind = draw(st.sampled_from(["odd", "junk", "unknown", "preemption"]))
        if kind == "odd":  # a near miss: one odd string where a string goes, the rest of the profile valid
            where = draw(st.sampled_from([*STRING_KEYS, "env", "nccl", "setup"]))
            odd = draw(st.one_of(st.sampled_from(ODD_STRINGS), texts, relative_paths(), slurm_times()))
            doc[where] = {"env": {"A": odd}, "nccl": {"NCCL_X": odd}, "setup": [odd]}.get(where, odd)
        elif kind == "junk":
            doc[draw(st.sampled_from(KEYS))] = draw(junk)
        elif kind == "unknown":
            doc[draw(st.one_of(st.sampled_from([k[:-1] for k in KEYS] + ["source", "NAME"]), scalars))] = draw(junk)
        else:
            pre = doc.get("preemption")
            pre = pre if isinstance(pre, dict) else {}
            pre[draw(st.sampled_from([*PREEMPTION_KEYS, "max_restart"]))] = draw(junk)
            doc["preemption"] = pre
    return _safe_runs_dir(doc)


def _alias_bomb(key: str, depth: int) -> str:
    """A few hundred bytes that YAML reads as a list of 10**depth strings (each level ten aliases of the last)."""
    lines = [f"{key}:", '  - &l0 ["xxxxxxxx", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, depth + 1)]
    return "\n".join(lines) + "\n"


def _yaml(doc: Any, **style: Any) -> str:
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False, **style)


@st.composite
def profile_files(draw: st.DrawFn) -> bytes:
    """The bytes of a profile file: mostly a mapping as YAML, else any of the ways a file can be wrong."""
    kind = draw(st.sampled_from(["mapping"] * 8 + ["flow", "top-level", "yaml-chars", "bytes", "cut", "bomb",
                                                   "long-number", "deep", "too-big"]))
    if kind == "mapping":
        return _yaml(draw(profile_mappings())).encode()
    if kind == "flow":
        return _yaml(draw(profile_mappings()), default_flow_style=True).encode()
    if kind == "top-level":
        return _yaml(draw(st.one_of(scalars, st.lists(junk, max_size=3)))).encode()
    if kind == "yaml-chars":
        return "".join(draw(st.lists(YAML_CHARS, max_size=60))).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "cut":  # a file saved half-way, or with a line typed twice (a duplicate key)
        text = _yaml(draw(profile_mappings()))
        lines = text.splitlines(keepends=True)
        at = draw(st.integers(0, len(text)))
        return (text[:at] if draw(st.booleans()) else text + draw(st.sampled_from(lines or ["a: 1\n"]))).encode()
    if kind == "bomb":
        key = draw(st.sampled_from(["partition", "default_time", "mem_per_gpu", "setup", "gpus_per_node", "env",
                                    "preemption"]))
        text = _alias_bomb("bomb", draw(st.integers(1, 8))).replace("bomb:", f"{key}:", 1)
        if key in ("env", "preemption"):  # the bomb one level down: env.A, preemption.signal
            inner = "A" if key == "env" else "signal"
            text = text.replace(f"{key}:\n", f"{key}:\n  {inner}:\n").replace("\n  - ", "\n    - ")
        return text.encode()
    if kind == "long-number":
        key = draw(st.sampled_from(["gpus_per_node", "max_nodes", "default_time", "cpus_per_gpu", "env",
                                    "partition"]))
        digits = draw(st.sampled_from(["9" * 5000, "0x" + "f" * 4000, "0o" + "7" * 5000, "1" * 400 + ".5",
                                       "-" + "9" * 4400]))
        return (f"env:\n  A: {digits}\n" if key == "env" else f"{key}: {digits}\n").encode()
    if kind == "deep":
        return ("partition: " + "[" * draw(st.integers(1, 20_000))).encode()
    return b"# " + b"x" * MAX_FILE_BYTES + b"\n"


# --- property 1: profiles ----------------------------------------------------------------------------------------

PROFILE_COMMANDS = {
    "dry-run": ["submit", "--dry-run", "--json"],  # first: hypothesis draws the first choice most (and it is cheap)
    "render": ["render", "-o", "job.sbatch"],
    "submit": ["submit"],
    "doctor": ["doctor"],
    "show": ["profiles", "show"],
}


# The bugs hypothesis found here, pinned: each of these failed before its fix.
@pytest.mark.train
@example(content=b"gpus_per_node: " + b"9" * 5000, command="dry-run")  # int(): over 4300 digits (ValueError)
@example(content=b"gpus_per_node: 0x" + b"f" * 4000, command="dry-run")  # a hex int too long to print in the message
@example(content=b'mem_per_gpu: "' + b"1" * 400 + b'K"', command="render")  # K as a float factor: OverflowError
@example(content=_alias_bomb("partition", 8).encode(), command="dry-run")  # repr of 10**8 strings: 25 s, 1.3 GB
@example(content=b'env:\n  "A\\n": x', command="dry-run")  # `A\n` passed as a name: `export A` and a line `=x`
@example(content=b'scheduler: local\nruns_dir: "r\\0x"', command="submit")  # mkdir: embedded null byte
@example(content=b'scheduler: local\nenv: {A: "a\\0b"}', command="submit")  # the ranks' Popen: embedded null byte
@example(content=b"scheduler: local\nruns_dir: x-%a", command="submit")  # %a resolved only at submission
@example(content=b"scheduler: local\nruns_dir: " + b"a" * 300, command="doctor")  # stat: ENAMETOOLONG
@settings(FUZZ, max_examples=150)
@given(content=profile_files(), command=st.sampled_from(list(PROFILE_COMMANDS)))
def test_any_profile_is_used_or_refused_in_one_line(sandbox: Sandbox, content: bytes, command: str) -> None:
    with example_folder(sandbox) as work:
        (work / "fuzzed.yaml").write_bytes(content)
        head = PROFILE_COMMANDS[command]
        argv = [*head, "./fuzzed.yaml"] if command == "show" else [
            *head, "--profile", "./fuzzed.yaml", ENTRY, "--steps", "5"]
        o = run_cli(sandbox, work, argv)
        event(f"{command}: exit {o.code}")  # how far the inputs got (--hypothesis-show-statistics)
        # doctor's exit 1 is "a check failed" (here: no Slurm to ask), with the table on stdout and nothing on stderr
        assert_contract(o, (0, 1, 2) if command == "doctor" else (0, 2))
        if command == "doctor" and o.code == 1:
            assert "✗" in o.out and o.err == "", o
        rendered = work / "job.sbatch"
        assert rendered.exists() == (command == "render" and o.code == 0), o
        if rendered.exists():
            assert_header_intact(rendered.read_text())
        if command == "dry-run" and o.code == 0:
            dry = json.loads(o.out)
            if dry["spec"]["scheduler"] == "slurm":
                assert_header_intact(dry["request"])
            # what reaches a job's environment and the scheduler's flags is single-line and well formed
            assert all(ENV_NAME.fullmatch(k) for k in dry["spec"]["env"]), dry["spec"]["env"]
            for key in ("name", "partition", "account", "qos"):
                assert "\n" not in (dry["spec"][key] or ""), (key, dry["spec"][key])
            # what a dry run accepts, a submission submits: once, recorded, its script whole
            submitted = run_cli(sandbox, work, ["submit", *argv[3:]])
            assert_contract(submitted)
            if dry["spec"]["scheduler"] == "local" and dry["spec"]["python"] != sys.executable \
                    and submitted.code == 2 and "cannot start the ranks" in submitted.err:
                return  # a local run asks its python: first (a dry run starts no Python): refused in one line
            assert submitted.code == 0, submitted
            assert_submitted_once(submitted)
        if command == "submit" and o.code == 0:
            assert_submitted_once(o)


# --- property 2: flags --------------------------------------------------------------------------------------------

odd_words = st.one_of(st.sampled_from([s for s in ODD_STRINGS if "\x00" not in s]),
                      st.text(max_size=12).filter(lambda s: "\x00" not in s))
"""Flag values a shell could pass (an argument never holds a NUL)."""
counts = st.one_of(st.integers(-2, 70).map(str), st.integers().map(str),
                   st.sampled_from(["", "1.5", "0x2", "٣", " 1", "1e3", "9" * 5000]), odd_words)
good_profiles = st.sampled_from(["local", "testcluster", "a100-ib", "h100"])
GOOD_FLAGS: dict[str, st.SearchStrategy[str] | None] = {
    "--profile": good_profiles,
    "--nodes": st.sampled_from(["1", "2"]),
    "--gpus": st.integers(1, 8).map(str),
    "--time": st.sampled_from(["30", "1:00:00", "4:00:00", "0-12", "90:00"]),
    "--name": words,
    "--partition": words,
    "--account": words,
    "--qos": words,
    "--run-dir": st.one_of(words, st.sampled_from(["runs/x-%j", "a b", "é"])),
    "--env": st.builds(lambda n, v: f"{n}={v}", env_names, words),
    "-m": None,
    "--module": None,
    "--sweep": st.builds(lambda k, vs: f"{k}={','.join(vs)}", st.sampled_from(["lr", "seed", "batch-size"]),
                         st.lists(st.sampled_from(["1", "2", "3e-4"]), min_size=1, max_size=3, unique=True)),
    "--max-parallel": st.sampled_from(["1", "2"]),
    "--no-snapshot": None,
}
"""Each flag with values some profile takes (a request may still exceed the profile it is given)."""
ODD_FLAGS: dict[str, st.SearchStrategy[str]] = {
    "--profile": st.one_of(st.sampled_from(["testclustr", "nope", "./missing.yaml", ".", "./", "train.py",
                                            "exists.sbatch", "x" * 300]), odd_words),
    "--nodes": counts,
    "--gpus": counts,
    "--time": st.one_of(slurm_times(), st.sampled_from(["9" * 5000, "1-" + "0" * 5000, " 30 ", "30\n"]), odd_words),
    "--name": st.one_of(st.sampled_from(["x" * 64, "x" * 65, "bad name!", "job\n", "-x", "é"]), odd_words),
    "--partition": st.one_of(st.sampled_from(["a b", "low\necho pwned", "'"]), odd_words),
    "--account": odd_words,
    "--qos": odd_words,
    "--run-dir": relative_paths().filter(lambda p: "\x00" not in p),
    "--env": st.one_of(st.sampled_from(["NOEQUALS", "=x", "1A=x", "A=", "A=a\nb", "A\n=b"]),
                       st.builds(lambda n, v: f"{n}={v}", env_names, odd_words), odd_words),
    "--sweep": st.one_of(st.sampled_from(["lr", "lr=", "=1", "lr=1,,2", "lr=1,1", "a b=1", "lr=-1", "lr=1\n2",
                                          "steps=1,2", "x" * 70 + "=1", "lr=" + ",".join(map(str, range(20_000)))]),
                         odd_words),
    "--sweep-file": st.sampled_from(["missing.yaml", "exists.sbatch", "train.py", ".", ""]),
    "--max-parallel": counts,
}
"""Each flag with values it must refuse, or that only look odd (an argument never holds a NUL)."""
COMMAND_FLAGS: dict[str, dict[str, st.SearchStrategy[str] | None]] = {
    "submit": {"--dry-run": None, "--json": None},
    "render": {"-o": st.sampled_from(["job.sbatch", "new/dir/job.sbatch"]), "--force": None},
    "doctor": {"--json": None, "--probe": None, "--probe-wait": st.sampled_from(["10", "600"])},
}
ODD_COMMAND_FLAGS: dict[str, st.SearchStrategy[str]] = {
    "-o": st.sampled_from(["exists.sbatch", ".", "train.py", ""]), "--probe-wait": counts}
good_entries = st.sampled_from([[ENTRY], [ENTRY, "--steps", "5"], [ENTRY, "--size", "tiny", "--lr", "3e-4"],
                                ["train.py"], ["train.py", "--", "--name", "x"]])
odd_entries = st.one_of(st.sampled_from(["trainers.tasks.lm:make_task", "json", "no.such.module", "nope.py", "-x",
                                         "", "a b", "trainers..tasks", "train", "train.py"]), odd_words)
odd_entry_args = st.one_of(st.sampled_from(["--steps", "--lr", "fast", "--steps=0", "--", "--dry-run", "--name",
                                            "--json", "-m", "--nodes=2", "--keep-best"]),
                           odd_words.filter(lambda s: s not in HELP))


@st.composite
def job_argvs(draw: st.DrawFn, command: str) -> list[str]:
    """submit/render/doctor: a valid request (a profile, some flags, an entry and its arguments), then up to three
    mutations: a flag given an odd value, an odd entry, an odd entry argument, a stray word anywhere, no profile."""
    good = {**GOOD_FLAGS, **COMMAND_FLAGS[command]}
    flags: dict[str, str | None] = {"--profile": draw(good_profiles)}
    for flag in draw(st.lists(st.sampled_from(sorted(good)), max_size=4, unique=True)):
        value = good[flag]
        flags[flag] = None if value is None else draw(value)
    entry: list[str] = [] if command == "doctor" and draw(st.booleans()) else list(draw(good_entries))
    tail: list[str] = []
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):  # a third of them valid
        kind = draw(st.sampled_from(["value", "entry", "arg", "word", "no-profile"]))
        if kind == "value":
            odd = {**ODD_FLAGS, **{k: v for k, v in ODD_COMMAND_FLAGS.items() if k in good}}
            flag = draw(st.sampled_from(sorted(odd)))
            flags[flag] = draw(odd[flag])
        elif kind == "entry":
            entry = [draw(odd_entries), *entry[1:]]
        elif kind == "arg":
            tail.append(draw(odd_entry_args))
        elif kind == "word":  # anywhere before the entry: a stray value, an unknown flag, a flag without its value
            flags[draw(st.one_of(odd_words, st.sampled_from(sorted(good))).filter(lambda w: w not in HELP))] = None
        else:
            flags.pop("--profile", None)
    argv = [command]
    for flag, value in flags.items():
        argv += [flag] if value is None else [flag, value]
    return argv + entry + tail


def other_argvs(command: str) -> st.SearchStrategy[list[str]]:
    """status/logs/cancel/list/profiles/goodput with random ids and values (the job store is empty)."""
    job_ids = st.one_of(st.sampled_from(["1234", "local-1", "0", "-1"]), odd_words)
    options: dict[str, st.SearchStrategy[list[str]]] = {
        "status": st.tuples(st.lists(job_ids, max_size=2), st.sampled_from([[], ["--json"]])).map(
            lambda t: [*t[0], *t[1]]),
        "logs": st.tuples(job_ids, st.lists(st.one_of(
            st.tuples(st.sampled_from(["--rank", "--restart"]), counts).map(list),
            st.sampled_from([["--follow"], ["-f"]])), max_size=3)).map(lambda t: [t[0], *sum(t[1], [])]),
        "cancel": st.lists(job_ids, max_size=3),
        "goodput": st.tuples(st.one_of(job_ids, st.sampled_from([".", "runs/x", "train.py"])),
                             st.sampled_from([[], ["--json"]])).map(lambda t: [t[0], *t[1]]),
        "list": st.lists(st.one_of(
            st.tuples(st.just("--state"), st.one_of(st.sampled_from(["RUNNING", "running", "UNKNOWN", "BOGUS"]),
                                                    odd_words)).map(list),
            st.tuples(st.just("--profile"), odd_words).map(list),
            st.tuples(st.just("--limit"), counts).map(list),
            st.just(["--json"]), odd_words.map(lambda w: [w])), max_size=3).map(lambda parts: sum(parts, [])),
        "profiles": st.one_of(st.just([]), st.just(["list"]), st.lists(st.one_of(st.sampled_from(
            ["show", "local", "testcluster", "nope", "./missing.yaml", "train.py"]), odd_words), max_size=3)),
    }
    return options[command].map(lambda rest: [command, *rest])


argvs = st.sampled_from(["submit", "render", "doctor", "status", "logs", "cancel", "list", "profiles",
                         "goodput"]).flatmap(
    lambda c: job_argvs(c) if c in COMMAND_FLAGS else other_argvs(c))


# The bugs hypothesis found here, pinned: each of these failed before its fix.
@pytest.mark.train
@example(argv=["render", "--profile", "testcluster", "--partition", "low\necho pwned", ENTRY])  # into the header
@example(argv=["render", "--profile", "testcluster", "--name", "job\n", ENTRY])  # `$` matched before the newline
@example(argv=["submit", "--profile", "testcluster", "--run-dir", "x\ny", ENTRY])  # into submitit's --output line
@example(argv=["submit", "--profile", "local", "--time", "9" * 5000, ENTRY])  # int(): over 4300 digits
@example(argv=["submit", "--profile", "local", "--run-dir", "x-%a", ENTRY])  # %a resolved only at submission
@example(argv=["doctor", "--profile", "local", "--run-dir", "a" * 300])  # stat: ENAMETOOLONG
@example(argv=["submit", "--profile", "x" * 300, ENTRY])  # stat of <name>.yaml: ENAMETOOLONG
@example(argv=["list", "--limit", str(2**63)])  # sqlite: OverflowError
@example(argv=["list", "a\nb"])  # argparse's unrecognized arguments, as typed: two lines
@example(argv=["render", "--profile", "testcluster", "-o", ".", "--force", ENTRY])  # with_name of `.`: ValueError
@example(argv=["render", "--profile", "testcluster", "-o", ".", ENTRY])
@example(argv=["submit", "--profile", "local", "--dry-run", "-m", "train.py"])  # find_spec imported train: ran it
@settings(FUZZ, max_examples=300)
@given(argv=argvs)
def test_any_flags_end_in_exit_0_or_one_line(sandbox: Sandbox, argv: list[str]) -> None:
    with example_folder(sandbox) as work:
        o = run_cli(sandbox, work, argv)
        event(f"{argv[0]}: exit {o.code}")  # how far the inputs got (--hypothesis-show-statistics)
        doctor = argv[0] == "doctor"
        assert_contract(o, (0, 1, 2) if doctor else (0, 2))
        if doctor and o.code == 1:  # a failed check (no Slurm to ask here): the table, no error line
            assert "✗" in o.out or '"ok": false' in o.out, o
            assert o.err == "", o
        if o.code != 0:
            assert (work / "exists.sbatch").read_text() == "precious\n"
            return
        if argv[0] == "submit" and (o.submitted or o.records):
            assert_submitted_once(o)
        elif argv[0] == "submit":  # exit 0 and nothing submitted: only a dry run or the help may do that
            assert "dry run" in o.out or '"dry_run": true' in o.out or o.out.startswith("usage:"), o
        elif not (doctor and "--probe" in argv):
            assert not o.submitted and o.records == 0, o
        if argv[0] == "render" and "-o" not in argv and not (HELP & set(argv)):
            assert_header_intact(o.out)


# --- found by hand: a file name no filesystem takes ----------------------------------------------------------


def test_render_to_a_file_name_no_filesystem_takes_is_refused(sandbox: Sandbox) -> None:
    with example_folder(sandbox) as work:
        o = run_cli(sandbox, work, ["render", "--profile", "testcluster", "-o", "a" * 300, ENTRY])
        assert_contract(o, (1, 2))
