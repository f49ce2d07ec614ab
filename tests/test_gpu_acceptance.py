"""bench/gpu_acceptance.py, the GPU acceptance command (issue 28 item 5): its bookkeeping here, and the whole suite
end to end on the CPU (--dry), so the one command a session with a lent GPU runs cannot rot in between."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import acceptance_parts as parts
import gpu_acceptance as acceptance

SCRIPT = str(REPO / "bench" / "gpu_acceptance.py")


def test_help_names_the_budget_and_a_bad_part_is_refused_in_one_line() -> None:
    help_ = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, cwd=REPO)
    assert help_.returncode == 0 and "--budget-min" in help_.stdout and "--dry" in help_.stdout
    bad = subprocess.run([sys.executable, SCRIPT, "--parts", "P0,P9"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "valid: parts P0,P1" in bad.stderr


@pytest.mark.train
def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    got = subprocess.run([sys.executable, SCRIPT, "--work", str(tmp_path / "w"), "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, cwd=REPO, env=env)
    refusal = [line for line in got.stderr.splitlines() if line.startswith("bench/gpu_acceptance.py")]
    assert got.returncode == 2 and len(refusal) == 1 and "no CUDA GPU visible" in refusal[0] and "--dry" in refusal[0]
    assert list(tmp_path.iterdir()) == []


def test_a_failing_part_is_recorded_and_the_budget_and_the_gpu_decide_what_runs(tmp_path: Path) -> None:
    suite = acceptance.Suite(dry=False, work=tmp_path, deadline=time.monotonic() + 600)
    suite.gpu = "NVIDIA H100 80GB HBM3"

    def broken(s: Any) -> dict[str, Any]:
        raise RuntimeError("the part's own bug")

    failed = acceptance.run_part(suite, parts.Part("P9", "broken", 1, broken))
    assert failed["status"] == "failed" and "the part's own bug" in failed["error"]
    assert acceptance.run_part(suite, parts.PARTS[6])["why"] == "H200 only; this is NVIDIA H100 80GB HBM3"
    assert acceptance.run_part(suite, parts.Part("P9", "long", 11, broken))["why"].startswith("budget:")
    ok = acceptance.run_part(suite, parts.Part("P9", "fine", 1, lambda s: parts.part_record(
        {}, [parts.check("x", 2.0, 1, 3), parts.check("y", None, 1)])))
    assert ok["status"] == "done" and ok["pass"] is True  # a missing figure neither passes nor fails


def test_save_blocks_are_the_step_after_each_save_less_a_plain_step(tmp_path: Path) -> None:
    times = [0.0, 1.0, 2.0, 12.0, 13.0, 14.0, 15.5, 16.5, 17.5]  # steps 1..9: save at 3 held 9 s, at 6 held 0.5 s
    (tmp_path / "checkpoints" / "step-3").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": 1.0, "time": t}) + "\n"
                                                    for i, t in enumerate(times)))
    got = parts.save_blocks(tmp_path, 3)
    assert got["blocks_s"] == [9.0, 0.5] and got["committed"] == ["step-3"]


@pytest.mark.train
def test_the_whole_suite_runs_on_the_cpu_in_dry_mode(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    got = subprocess.run([sys.executable, SCRIPT, "--dry", "--jobs", "2", "--work", str(tmp_path / "w"),
                          "--out", str(out)], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr
    res = json.loads(out.read_text())
    assert res == json.loads((tmp_path / "w" / "acceptance.json").read_text())
    assert list(res["parts"]) == [p.prio for p in parts.PARTS]
    assert {k: v["status"] for k, v in res["parts"].items()} == {p.prio: "done" for p in parts.PARTS}
    assert "python -m trainers trainers.tasks.lm" in res["parts"]["P2"]["runs"]["ddp"]["cmd"]
    for prio in ("P2", "P3", "P5", "P6"):  # figures read back from every throughput run's metrics.jsonl
        assert all(r["figures"]["tokens_per_s"] > 0 for r in res["parts"][prio]["runs"].values()), prio
    assert len(res["parts"]["P4"]["saves"]["async"]["blocks_s"]) == 2
