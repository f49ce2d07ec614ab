"""The CLI: help with examples, torch never imported on the submit side, profiles listing, dry runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import BIN, REPO, hpcjobs

NO_TORCH = """
import sys, contextlib, io
from hpcjobs.cli import main
for argv in {argvs!r}:
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""


def test_submit_side_never_imports_torch() -> None:
    argvs = [["--help"], ["submit", "--help"],
             ["render", "--profile", "testcluster", "--nodes", "2", "--gpus", "8", "trainers.tasks.lm"],
             ["submit", "--profile", "testcluster", "--nodes", "2", "--dry-run", "trainers.tasks.lm"],
             ["profiles"], ["profiles", "show", "a100-ib"], ["list"]]
    out = subprocess.run([sys.executable, "-c", NO_TORCH.format(argvs=argvs)], capture_output=True, text=True,
                         cwd=REPO)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("cmd", ["submit", "render", "profiles", "status", "list", "logs", "cancel"])
def test_every_subcommand_has_help_with_an_example(cmd: str) -> None:
    out = hpcjobs(cmd, "--help")
    assert out.returncode == 0 and "examples:" in out.stdout and f"hpcjobs {cmd}" in out.stdout


def test_gpus_help_says_per_node() -> None:
    out = hpcjobs("submit", "--help").stdout
    assert "GPUs per node" in out and "nproc_per_node" in out


def test_version() -> None:
    out = hpcjobs("--version")
    assert out.returncode == 0 and out.stdout.startswith("hpcjobs ")


def test_dry_run_prints_world_and_script_and_submits_nothing() -> None:
    out = hpcjobs("submit", "--profile", "testcluster", "--nodes", "2", "--gpus", "8", "--dry-run",
                  "trainers.tasks.lm", "--size", "tiny", cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "2 nodes × 8 GPUs = 16 ranks" in out.stdout and "#SBATCH --nodes=2" in out.stdout
    assert hpcjobs("list", "--json").stdout.strip() == "[]"


def test_dry_run_json() -> None:
    out = hpcjobs("submit", "--profile", "testcluster", "--dry-run", "--json", "trainers.tasks.lm", cwd=REPO)
    data = json.loads(out.stdout)
    assert data["dry_run"] and data["spec"]["ranks"] == 8 and data["request"].startswith("#!/bin/bash")


def test_profiles_list_says_where_each_came_from(tmp_path, monkeypatch) -> None:
    user = tmp_path / "cfg" / "hpcjobs" / "profiles"
    user.mkdir(parents=True)
    (user / "mine.yaml").write_text("partition: x\n")
    envdir = tmp_path / "envdir"
    envdir.mkdir()
    (envdir / "local.yaml").write_text("scheduler: local\n")
    (envdir / "folder.yaml").mkdir()  # no profile: neither listed nor found
    out = hpcjobs("profiles", cwd=tmp_path, env={"XDG_CONFIG_HOME": str(tmp_path / "cfg"),
                                                 "HPCJOBS_PROFILES_DIR": str(envdir)})
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[1:]}
    assert "folder" not in rows
    assert rows["mine"][0] == "user"
    assert rows["local"][0] == "$HPCJOBS_PROFILES_DIR"  # first in the search order wins
    assert rows["testcluster"][0] == "shipped"


def test_profiles_show_resolves_every_key() -> None:
    out = hpcjobs("profiles", "show", "h100", cwd=REPO)
    assert out.returncode == 0
    assert "gpu_type: h100" in out.stdout and "max_restarts: 50" in out.stdout and "srun_args: []" in out.stdout


def test_a_reader_that_left_ends_the_command_quietly() -> None:
    """`hpcjobs list | head -1` raised BrokenPipeError (issue 26): here the reader left before the first line."""
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([str(BIN / "hpcjobs"), "list"], stdout=write, stderr=subprocess.PIPE, text=True,
                             timeout=60)
    finally:
        os.close(write)
    assert out.returncode == 141 and out.stderr == "", out.stderr


def test_list_refuses_an_unknown_state() -> None:
    """It printed an empty table with exit 0."""
    out = hpcjobs("list", "--state", "BOGUS")
    assert out.returncode == 2 and "not a job state; valid: PENDING" in out.stderr and "HINT:" in out.stderr
    assert hpcjobs("list", "--state", "running").returncode == 0
