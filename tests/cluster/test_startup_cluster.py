"""The short version of bench/startup.py that CI runs: 2 nodes, the submit path, cold and after a requeue. Every
rank writes its start-up line, the stages come in order, and the requeued start resumes. The 2-16 node sweep and its
figures are `bench/startup.py` (bench/README.md, "Start-up as nodes grow")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.cluster


def test_the_startup_benchmark_measures_every_stage_cold_and_after_a_requeue(tmp_path: Path) -> None:
    out = tmp_path / "startup.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "startup.py"), "--nodes", "2", "--paths", "submit",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    for phase in ("cold", "requeue"):
        stages = [row[phase][s] for s in ("launched", "imported", "joined", "ready", "first_step")]
        assert stages == sorted(stages) and stages[-1] > 0, row
        assert row[phase]["cpu_s_per_rank"] > 0
        # The CPU split by stage: importing torch costs something on every start, and the parts add up to no more
        # than the whole (the rest is the process's exit bookkeeping before the line is written).
        split = row[phase]["cpu_s_per_rank_by_stage"]
        assert split["imported"] > 0 and min(split.values()) >= 0, split
        assert sum(split.values()) <= row[phase]["cpu_s_per_rank"] + 0.05, row
    floor = result["floor"]
    assert 0 < floor["import_torch_cpu_s"] < floor["cpu_s"] and floor["least_slope_s_per_node"] > 0, floor
    together = floor["started_together_s"]["2"]  # two bare torch processes started at once, as the two nodes were
    assert 0 < together["imported"] < together["first_step"], floor
    assert row["requeue"]["running"] >= 0 and row["resumed_start_over_cold_start"] > 0
