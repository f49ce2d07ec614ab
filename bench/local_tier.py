"""bench/local_tier: what the node-local checkpoint tier (`--local-ckpt-every N`, issue 40) saves per fault, on the
`local` profile: fault → first resumed step (s) and steps redone, a rank SIGKILLed mid-run, with the tier
(`--local-ckpt-every 5 --ckpt-every 200`) and without (`--ckpt-every 200` alone), in interleaved rounds.

Each run is `hpcjobs submit --profile local` of 2 ranks of the example LM (`--size tiny`), rank 1 SIGKILLed after
step FAULT_STEP of the first start only (trainers/faults.py: HPCJOBS_FAULT_INJECT, HPCJOBS_FAULT_RESTART=0), the
local backend recovering it. The figures are the ones `hpcjobs goodput --json` gives for that fault
(hpcjobs.goodput.incidents): the fault → the next start's first step done, the step it resumed from and its tier;
steps redone = FAULT_STEP − the resumed step (the killed rank had finished step FAULT_STEP; goodput's `last_step`
is the start's last metrics line, kept beside); fault → the fault's step trained again = fault → first resumed step +
steps redone × the resumed start's step time (from its metrics lines). The tier folder is a fresh tmp folder each run
(HPCJOBS_LOCAL_CKPT_DIR), so no run sees another's files.

    .venv/bin/python bench/local_tier.py --rounds 3

Writes bench/results/local_tier.json (every run, and the medians per arm).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "local_tier.json"
FAULT_STEP = 150
STEPS = 180
ARMS = {"tier": ("--ckpt-every", "200", "--local-ckpt-every", "5"), "no tier": ("--ckpt-every", "200")}
HPCJOBS = [sys.executable, "-m", "hpcjobs"]


def one_run(arm: str, tmp: Path) -> dict[str, Any]:
    """One local job of `arm`, rank 1 killed after FAULT_STEP; the goodput figures of its fault."""
    run = tmp / "run"
    env = {**os.environ, "HPCJOBS_HOME": str(tmp / "home"), "HPCJOBS_LOCAL_CKPT_DIR": str(tmp / "shm"),
           "HPCJOBS_FAULT_INJECT": f"step@{FAULT_STEP}:1", "HPCJOBS_FAULT_ACTION": "kill",
           "HPCJOBS_FAULT_RESTART": "0", "USER": os.environ.get("USER", "bench")}
    began = time.monotonic()
    out = subprocess.run([*HPCJOBS, "submit", "--profile", str(REPO / "cluster_profiles" / "local.yaml"), "--gpus",
                          "2", "--run-dir", str(run), "--no-snapshot", "trainers.tasks.lm", "--size", "tiny",
                          "--steps", str(STEPS), *ARMS[arm]], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    wall = time.monotonic() - began
    if out.returncode != 0:
        return {"arm": arm, "error": out.stderr[-800:], "rc": out.returncode}
    good = subprocess.run([*HPCJOBS, "goodput", str(run), "--json"], cwd=REPO, env=env, capture_output=True,
                          text=True, check=False)
    faults = json.loads(good.stdout).get("faults", []) if good.returncode == 0 else []
    if len(faults) != 1:
        return {"arm": arm, "error": f"{len(faults)} faults in goodput: {good.stdout[-400:]}{good.stderr[-400:]}"}
    f = faults[0]
    step_s = step_time(run / "metrics.jsonl")
    redone = None if f["resumed_step"] is None else FAULT_STEP - f["resumed_step"]
    return {"arm": arm, "fault_to_first_resumed_step_s": f["to_first_step_s"], "resumed_step": f["resumed_step"],
            "last_step": f["last_step"], "steps_redone": redone, "redone_s": f["redone_s"], "tier": f["tier"],
            "noticed_s": f["noticed_s"], "step_s": step_s, "job_wall_s": round(wall, 1),
            "resumed_start_rank0": next((r for r in rows_of(run / "startup.jsonl")
                                         if r.get("restart") == 1 and r.get("rank") == 0), None),
            "fault_to_fault_step_again_s": None if redone is None or f["to_first_step_s"] is None or step_s is None
            else round(f["to_first_step_s"] + redone * step_s, 3)}


def rows_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def step_time(metrics: Path) -> float | None:
    """Seconds a step in the resumed start (restart 1), from its first and last metrics lines."""
    rows = [r for r in rows_of(metrics) if r.get("restart") == 1 and "time" in r]
    if len(rows) < 2 or rows[-1]["step"] == rows[0]["step"]:
        return None
    return round((rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"]), 4)


def median_of(runs: list[dict[str, Any]], arm: str, key: str) -> float | None:
    values = [r[key] for r in runs if r["arm"] == arm and r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    runs: list[dict[str, Any]] = []
    for i in range(ns.rounds):
        for arm in (ARMS if i % 2 == 0 else reversed(list(ARMS))):  # interleaved, the order alternating
            with tempfile.TemporaryDirectory(prefix="hpcjobs-bench-tier-") as tmp:
                runs.append({"round": i, **one_run(arm, Path(tmp))})
            print(json.dumps(runs[-1]), flush=True)
    medians = {arm: {key: median_of(runs, arm, key) for key in
                     ("fault_to_first_resumed_step_s", "steps_redone", "fault_to_fault_step_again_s", "redone_s",
                      "resumed_step", "step_s", "job_wall_s")} for arm in ARMS}
    RESULTS.write_text(json.dumps({"commit": commit.strip(), "fault_step": FAULT_STEP, "steps": STEPS,
                                   "arms": {k: list(v) for k, v in ARMS.items()}, "runs": runs,
                                   "medians": medians}, indent=1) + "\n")
    print(json.dumps(medians))
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
