"""Which Python the nodes run and which torch it has (issue 11, items 2 and 4): the interpreter is found after the
profile's setup, the job ends with one line before any rank when it cannot start them, and an old torch is refused
when a rank starts instead of at its first (perhaps preemption's) checkpoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPO
from hpcjobs.backends import backend_for
from hpcjobs.backends.slurm.sbatch import python_lines, render_sbatch
from hpcjobs.profiles.cluster_profile import load_profile
from hpcjobs.protocol.versions import TORCH_FLOOR
from hpcjobs.request.spec import AFTER_SETUP, JobSpec, Request, build_spec
from trainers.versions import TorchTooOld, require_torch


def spec_for(profile_name: str, **changes: object) -> JobSpec:
    profile = replace(load_profile(str(REPO / "cluster_profiles" / f"{profile_name}.yaml")), **changes)
    return build_spec(profile, Request(entry="trainers.tasks.lm", nodes=1, gpus=1), backend_for(profile.scheduler),
                      workdir=REPO)


def test_the_floor_in_pyproject_is_the_one_the_ranks_check() -> None:
    declared = re.search(r'"torch>=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text())
    assert declared and (int(declared.group(1)), int(declared.group(2))) == TORCH_FLOOR


@pytest.mark.parametrize("version,ok", [("2.6.0+cu124", False), ("2.6.9", False), ("1.13.1", False),
                                        ("2.7.0", True), ("2.7.1+cu126", True), ("2.13.0+cpu", True),
                                        ("3.0.0a0", True)])
def test_torch_versions(version: str, ok: bool) -> None:
    if ok:
        require_torch(version)
    else:
        with pytest.raises(TorchTooOld, match=rf"torch {re.escape(version)} is installed; hpcjobs needs torch >= "):
            require_torch(version)


def test_a_rank_with_an_old_torch_is_refused_at_start_with_one_line(tmp_path: Path) -> None:
    """torch 2.6 (measured in a venv of its own) failed at the first checkpoint save: too late, and a preemption's
    save may be the first. Here the installed version is reported as 2.6.0 to the launcher."""
    code = ("import importlib.metadata as m, runpy, sys; real = m.version; "
            "m.version = lambda name: '2.6.0' if name == 'torch' else real(name); "
            "sys.argv = ['trainers.launch', '--run-dir', sys.argv[1], '--kind', 'task', '--', 'trainers.tasks.lm']; "
            "runpy.run_module('trainers.launch', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "hpcjobs: torch 2.6.0 is installed; hpcjobs needs torch >= 2.7. HINT: pip install 'torch>=2.7' in the "
        "environment the nodes use (the profile's python or setup)"]
    assert not (tmp_path / "run").exists()


def test_the_nodes_python_is_found_after_the_setup_unless_the_profile_names_one() -> None:
    assert spec_for("h100").python == AFTER_SETUP  # its setup activates /shared/envs/torch
    assert spec_for("h100", python="/opt/py/bin/python").python == "/opt/py/bin/python"
    assert spec_for("testcluster").python == sys.executable  # no setup: the submitting Python (shared filesystem)
    assert spec_for("local", setup=("source x",)).python == sys.executable  # nothing runs a local setup
    text = render_sbatch(spec_for("h100"))
    order = ["source /shared/envs/torch/bin/activate", "for hpcjobs_python in python3 ",
             'hpcjobs-rank "$HPCJOBS_PYTHON" -u -m trainers.launch']
    assert [text.index(x) for x in order] == sorted(text.index(x) for x in order)


def run_lines(lines: list[str], path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run(["bash", "-c", "set -eo pipefail\n" + "\n".join(lines) + "\necho ranks would start"],
                          capture_output=True, text=True, env=env, timeout=120)


def test_the_python_check_ends_the_job_with_one_line_when_torch_is_missing(tmp_path: Path) -> None:
    """The script's own lines in bash: a profile naming a base interpreter without torch (no fallback then)."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    bad = run_lines(python_lines(spec_for("h100", python=str(base))), "/usr/bin:/bin")
    assert bad.returncode == 2 and "ranks would start" not in bad.stdout
    assert bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("hpcjobs: the nodes' Python on ")
    assert (f"cannot start the ranks ({base} -> {base}: torch is not installed for this Python); valid: a "
            "Python with torch >= 2.7 and hpcjobs installed. HINT: set python: in the profile") in bad.stderr
    missing = run_lines(python_lines(spec_for("h100", python="/nowhere/python")), "/usr/bin:/bin")
    assert missing.returncode == 2 and "(/nowhere/python -> not found: " in missing.stderr


def test_python3_after_the_setup_then_the_python_hpcjobs_ran_from() -> None:
    """A setup that only loads modules leaves the system's python3 first: the ranks run the submitting Python (the
    old default, on a shared filesystem), and the job's log says so in one line."""
    base = Path(sys.base_prefix) / "bin"
    s = spec_for("h100")
    assert (s.python, s.python_fallback) == (AFTER_SETUP, sys.executable)
    fell_back = run_lines(python_lines(s), f"{base}:/usr/bin:/bin")
    assert fell_back.returncode == 0 and fell_back.stdout.strip() == "ranks would start", fell_back.stderr
    assert fell_back.stderr == (f"hpcjobs: python3 -> {base}/python3: torch is not installed for this Python; "
                                f"the ranks run {sys.executable} instead (the Python hpcjobs ran from)\n")
    first = run_lines(python_lines(s), f"{Path(sys.executable).parent}:/usr/bin:/bin")
    assert first.returncode == 0 and first.stderr == "" and first.stdout.strip() == "ranks would start"
    assert spec_for("h100", python="/opt/py/bin/python").python_fallback is None  # named: that one or nothing
