"""The profile schema read off its dataclasses, the docs' key table generated from it, and the profile limits:
an empty file, a key given twice, a huge, binary or unreadable file, absurd numbers and lengths. Each is refused
as one ProfileError line (exit 2 through the console script, nothing submitted)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import hpcjobs.profiles.cluster_profile as profiles
import test_bad_inputs
from conftest import REPO, hpcjobs
from hpcjobs.backends import SCHEDULERS
from hpcjobs.profiles.cluster_profile import ClusterProfile, load_profile, parse_profile
from hpcjobs.profiles.container import Container
from hpcjobs.profiles.keycheck import MAX_ITEMS, MAX_STRING
from hpcjobs.profiles.storage import Storage
from hpcjobs.profiles.table import reference_table
from hpcjobs.profiles.yamlfile import MAX_FILE_BYTES
from hpcjobs.protocol.contract import Preemption, Recovery
from hpcjobs.protocol.errors import ProfileError
from test_bad_inputs import GOOD, assert_refused

SOURCE = "/site/bad.yaml"
sbatch_log = test_bad_inputs.sbatch_log
"""test_bad_inputs' fixture: a recording `sbatch` first on PATH, which proves nothing was submitted."""


def refused(data: Any) -> str:
    """parse_profile's refusal of `data`, as the one line a user sees."""
    with pytest.raises(ProfileError) as e:
        parse_profile(data, "bad", SOURCE)
    line = e.value.one_line()
    assert "\n" not in line and "HINT:" in line and e.value.exit_code == 2
    return line


def write(tmp_path: Path, text: str | bytes, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def load_refused(path: Path | str) -> str:
    with pytest.raises(ProfileError) as e:
        load_profile(str(path))
    line = e.value.one_line()
    assert "\n" not in line and "HINT:" in line
    return line


# --- the schema is the dataclass ------------------------------------------------------------------------------


def _yaml_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)  # type: ignore[arg-type]
    return list(value) if isinstance(value, tuple) else value


def test_every_field_is_accepted_with_its_default(tmp_path: Path) -> None:
    keys = {f.name: _yaml_value(f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
            for f in dataclasses.fields(ClusterProfile) if f.name not in ("name", "source")}
    path = write(tmp_path, yaml.safe_dump({"name": "all", **keys}))
    assert load_profile(str(path)) == ClusterProfile(name="all", source=str(path))


def test_every_key_appears_in_the_reference_table() -> None:
    table = reference_table()
    nested = ("source", "preemption", "recovery", "container", "storage")
    keys = [f.name for f in dataclasses.fields(ClusterProfile) if f.name not in nested]
    keys += [f"preemption.{f.name}" for f in dataclasses.fields(Preemption)]
    keys += [f"recovery.{f.name}" for f in dataclasses.fields(Recovery)]
    keys += [f"container.{f.name}" for f in dataclasses.fields(Container)]
    keys += [f"storage.{f.name}" for f in dataclasses.fields(Storage)]
    for key in keys:
        assert f"| `{key}` |" in table, key
    assert "`source`" not in table  # filled in by the loader, never read from the file
    assert len(table.splitlines()) == 2 + len(keys)


def test_the_table_shows_defaults_docs_and_bounds() -> None:
    rows = {line.split(" | ")[0].strip("| `"): line for line in reference_table().splitlines()[2:]}
    assert rows["gpus_per_node"].startswith("| `gpus_per_node` | 8 | GPUs each node has")
    assert "at most 64" in rows["gpus_per_node"]
    assert rows["preemption.signal"].startswith("| `preemption.signal` | `USR2` | The signal Slurm sends")
    assert "at least 10, at most 3600" in rows["preemption.seconds_before"]
    assert rows["python"].startswith("| `python` | `python3` after `setup`, else the one running hpcjobs |")
    assert rows["setup"].startswith("| `setup` | `[]` |")


def test_the_docs_hold_exactly_the_reference_table() -> None:
    page = (REPO / "docs" / "reference" / "profiles.md").read_text()
    assert f"\n\n{reference_table()}\n" in page, "docs/reference/profiles.md's table is stale: paste reference_table()"


def test_every_number_has_bounds() -> None:
    """An absurd number (gpus_per_node: 100000) is refused at load time, not by Slurm an hour later."""
    for cls in (ClusterProfile, Preemption, Recovery):
        for f in dataclasses.fields(cls):
            if f.type in ("int", "int | None"):
                assert "min" in f.metadata and "max" in f.metadata, f"{cls.__name__}.{f.name} has no bounds"


def test_one_schema_table() -> None:
    source = inspect.getsource(profiles)
    assert not hasattr(profiles, "_KEYS") and not hasattr(profiles, "_PREEMPTION_KEYS")
    assert "scheduler ==" not in source
    assert profiles.SCHEDULERS is SCHEDULERS


def test_seconds_before_is_bounded_for_every_scheduler() -> None:
    line = refused({"scheduler": "local", "preemption": {"seconds_before": 5}})
    assert "preemption.seconds_before is 5; valid: at least 10" in line
    assert parse_profile({"preemption": {"seconds_before": 10}}, "p", SOURCE).preemption.seconds_before == 10


@pytest.mark.parametrize("data,fragment", [
    ({"gpus_per_node": 65}, "gpus_per_node is 65; valid: a whole number > 0, at most 64"),
    ({"cpus_per_gpu": 1025}, "cpus_per_gpu is 1025; valid: a whole number > 0, at most 1024"),
    ({"max_nodes": 100_001}, "max_nodes is 100001; valid: a whole number > 0, at most 100000"),
    ({"preemption": {"seconds_before": 3601}}, "preemption.seconds_before is 3601; valid: at least 10, at most 3600"),
    ({"preemption": {"max_restarts": 10_001}}, "preemption.max_restarts is 10001; valid: a whole number >= 0, at most"),
    ({"preemption": {"max_restarts": -1}}, "preemption.max_restarts is -1"),
    ({"setup": ["true"] * (MAX_ITEMS + 1)}, f"valid: a list of at most {MAX_ITEMS} strings (it has 201)"),
    ({"srun_args": ["-v"] * (MAX_ITEMS + 1)}, "srun_args is ['-v', "),
    ({"env": {f"V{i}": "1" for i in range(MAX_ITEMS + 1)}}, f"valid: a mapping of at most {MAX_ITEMS} names"),
    ({"setup": ["x" * (MAX_STRING + 1)]}, f"valid: a list of strings of at most {MAX_STRING} characters each"),
    ({"partition": "x" * (MAX_STRING + 1)}, f"characters); valid: a string of at most {MAX_STRING} characters"),
    ({"env": {"A": "x" * (MAX_STRING + 1)}}, f"valid: values of at most {MAX_STRING} characters"),
    ({"partition": "low\nrm -rf ~"}, "partition is 'low\\nrm -rf ~'; valid: a single-line string"),
    ({"preemption": 5}, "preemption is 5; valid: a mapping with signal, seconds_before, max_restarts"),
], ids=lambda v: str(v)[:40] if isinstance(v, str) else None)
def test_absurd_values_are_refused(data: dict[str, Any], fragment: str) -> None:
    line = refused(data)
    assert fragment in line, line
    assert len(line) < 1000  # a 4 KB value is cut in the message, not repeated whole


@pytest.mark.parametrize("data", [
    {"gpus_per_node": 64, "cpus_per_gpu": 1024, "max_nodes": 100_000},
    {"preemption": {"seconds_before": 3600, "max_restarts": 10_000}},
    {"preemption": {"max_restarts": 0}},
    {"setup": ["true"] * MAX_ITEMS, "srun_args": ["-v"] * MAX_ITEMS, "partition": "x" * MAX_STRING},
    {"env": {f"V{i}": "x" * MAX_STRING for i in range(MAX_ITEMS)}},
])
def test_the_limits_themselves_are_accepted(data: dict[str, Any]) -> None:
    parse_profile(data, "edge", SOURCE)


# --- the file ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing but comments\n# scheduler: slurm\n", "---\n"])
def test_an_empty_profile_is_refused(text: str, tmp_path: Path) -> None:
    line = load_refused(write(tmp_path, text))
    assert "holds no keys (it is empty or only comments)" in line


def test_parse_profile_refuses_no_document() -> None:
    assert "holds no keys" in refused(None)


@pytest.mark.parametrize("text,key,lines", [
    ("partition: low\ngpus_per_node: 8\npartition: high\n", "'partition'", "line 1 and line 3"),
    ("preemption:\n  signal: USR1\n  seconds_before: 60\n  signal: USR2\n", "'signal'", "line 2 and line 4"),
    ("env:\n  A: '1'\n  A: '2'\n", "'A'", "line 2 and line 3"),
    ("nccl: {NCCL_DEBUG: WARN, NCCL_DEBUG: INFO}\n", "'NCCL_DEBUG'", "line 1 and line 1"),
])
def test_a_key_given_twice_is_refused(text: str, key: str, lines: str, tmp_path: Path) -> None:
    line = load_refused(write(tmp_path, text))
    assert f"key {key} is given twice ({lines}); valid: each key once" in line, line


def test_a_merge_key_may_be_overridden(tmp_path: Path) -> None:
    text = "nccl: &base {NCCL_DEBUG: WARN}\nenv:\n  <<: *base\n  NCCL_DEBUG: INFO\n"
    assert load_profile(str(write(tmp_path, text))).env == {"NCCL_DEBUG": "INFO"}


def test_an_unquoted_slurm_time_stays_a_time(tmp_path: Path) -> None:
    """YAML 1.1 reads 30:00 as 1800 (base 60), which would have become 1800 minutes."""
    profile = load_profile(str(write(tmp_path, "default_time: 30:00\nmax_time: 1:00:00\n")))
    assert (profile.default_time, profile.max_time) == ("30:00", "1:00:00")
    assert load_profile(str(write(tmp_path, "default_time: 30\n"))).default_time == "30"  # minutes, as in Slurm
    assert "gpus_per_node is '1:00'" in load_refused(write(tmp_path, "gpus_per_node: 1:00\n"))


def test_a_huge_profile_is_refused_before_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "huge.yaml"
    with path.open("wb") as f:
        f.truncate(50 * 1024 * 1024)  # sparse: 50 MB without writing them

    def no_reading(*_: Any, **__: Any) -> Any:
        raise AssertionError("the file was opened")
    monkeypatch.setattr(Path, "open", no_reading)
    monkeypatch.setattr(Path, "read_text", no_reading)
    monkeypatch.setattr(Path, "read_bytes", no_reading)
    start = time.monotonic()
    line = load_refused(path)
    assert f"is 52428800 bytes; valid: at most {MAX_FILE_BYTES} bytes (256 KiB)" in line
    assert time.monotonic() - start < 1


def test_a_profile_at_the_size_limit_is_read(tmp_path: Path) -> None:
    head = "scheduler: local\n"
    path = write(tmp_path, head + "#" * (MAX_FILE_BYTES - len(head) - 1) + "\n")
    assert path.stat().st_size == MAX_FILE_BYTES
    assert load_profile(str(path)).scheduler == "local"
    path.write_text(path.read_text() + "\n")
    assert f"is {MAX_FILE_BYTES + 1} bytes" in load_refused(path)


@pytest.mark.parametrize("data,fragment", [
    (b"partition: caf\xe9\n", "is not UTF-8 text (byte 0xe9 at offset 14); valid: a UTF-8 YAML file"),
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "is a binary file (a NUL byte at offset 7)"),
    (bytes(range(256)), "is not UTF-8 text (byte 0x80 at offset 128)"),
])
def test_a_binary_profile_is_refused(data: bytes, fragment: str, tmp_path: Path) -> None:
    assert fragment in load_refused(write(tmp_path, data))


def test_a_utf8_bom_is_not_part_of_the_yaml(tmp_path: Path) -> None:
    assert load_profile(str(write(tmp_path, "\ufeffscheduler: local\n"))).scheduler == "local"


def test_a_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "site.yaml"
    folder.mkdir()
    assert f"profile path '{folder}' is a folder; valid: a .yaml file" in load_refused(folder)


def test_an_unreadable_profile_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "scheduler: local\n")

    def denied(*_: Any, **__: Any) -> Any:
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "open", denied)
    assert "cannot be read (Permission denied)" in load_refused(path)


def test_a_deeply_nested_profile_is_refused(tmp_path: Path) -> None:
    assert "nests too deeply" in load_refused(write(tmp_path, "setup: " + "[" * 20_000 + "\n"))


# --- through the console script ----------------------------------------------------------------------------------


def _submit(prof: Path) -> Any:
    return hpcjobs("submit", "--profile", str(prof), "--nodes", "1", "trainers.tasks.lm", cwd=prof.parent)


@pytest.mark.parametrize("content,fragment", [
    ("# all commented out\n# partition: low\n", "holds no keys"),
    (yaml.safe_dump(GOOD) + "partition: high\n", "key 'partition' is given twice (line "),
    (b"scheduler: slurm\npartition: \xff\xfe\n", "is not UTF-8 text"),
    (yaml.safe_dump({**GOOD, "gpus_per_node": 1000}), "gpus_per_node is 1000; valid: a whole number > 0, at most 64"),
    (yaml.safe_dump({**GOOD, "srun_args": ["-v"] * 1000}), "valid: a list of at most 200 strings"),
], ids=["empty", "duplicate", "not-utf8", "gpus", "srun_args"])
def test_console_script_refuses(content: str | bytes, fragment: str, tmp_path: Path, sbatch_log: Path) -> None:
    prof = write(tmp_path, content, "bad.yaml")
    out = _submit(prof)
    assert_refused(out, fragment, sbatch_log)
    assert "bad.yaml" in out.stderr


def test_console_script_refuses_a_huge_profile(tmp_path: Path, sbatch_log: Path) -> None:
    prof = tmp_path / "bad.yaml"
    with prof.open("wb") as f:
        f.truncate(50 * 1024 * 1024)
    start = time.monotonic()
    out = _submit(prof)
    assert_refused(out, "is 52428800 bytes; valid: at most", sbatch_log)
    assert time.monotonic() - start < 30  # the process start; reading it took 23 s alone


def test_console_script_refuses_a_folder(tmp_path: Path, sbatch_log: Path) -> None:
    (tmp_path / "site.yaml").mkdir()
    out = _submit(tmp_path / "site.yaml")
    assert_refused(out, "is a folder; valid: a .yaml file", sbatch_log)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_console_script_refuses_an_unreadable_profile(tmp_path: Path, sbatch_log: Path) -> None:
    prof = write(tmp_path, yaml.safe_dump(GOOD), "bad.yaml")
    prof.chmod(0)
    out = _submit(prof)
    assert_refused(out, "cannot be read (Permission denied)", sbatch_log)


def test_a_string_key_given_a_list_is_refused_not_turned_into_text(tmp_path: Path) -> None:
    """A string key (partition) that holds a list was taken as the list's text: with YAML aliases nesting it (the
    fuzz test's case, 10 aliases a level), str() of it filled 24 GB and the CI run was killed."""
    levels = ['  - &l0 ["xxxxxxxx", "x", "x"]'] + [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 4)]
    path = tmp_path / "bomb.yaml"
    path.write_text("partition:\n" + "\n".join(levels) + "\n")
    with pytest.raises(profiles.ProfileError, match="partition .*valid: a string"):
        profiles.load_profile(str(path))
