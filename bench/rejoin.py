"""bench/rejoin: what a killed rank costs when the other ranks keep their processes (issue 40 item 4,
hpcjobs.protocol.rejoin) against when every rank starts again (HPCJOBS_REJOIN=0, the path before it), on the `local`
profile, the node-local tier on in both arms, in interleaved rounds (the order alternating).

Each run is `hpcjobs submit --profile local` of 2 ranks of the example LM (`--size tiny`, STEPS steps,
`--ckpt-every 200 --local-ckpt-every 5`), rank 1 SIGKILLed after step FAULT_STEP of the first start only
(trainers/faults.py). The figures are `hpcjobs goodput --json`'s line for that fault (hpcjobs.goodput.incidents):
fault → first resumed step (s), the step it resumed from and its tier, steps redone = FAULT_STEP − the resumed step;
plus the survivor's start-up record for the new start (startup.jsonl, rank 0: its stages' seconds; kept: no
imports) and the job's wall time.

    .venv/bin/python bench/rejoin.py --rounds 3

Writes bench/results/rejoin.json (every run, and the medians per arm).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from local_tier import faulted_job, median_of, rows_of  # bench/ is the script's folder: sys.path[0]

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "rejoin.json"
FAULT_STEP, STEPS = 150, 180
ARMS = {"kept": {"HPCJOBS_REJOIN_SPARE": "1"}, "restarted": {"HPCJOBS_REJOIN": "0"}}
HPCJOBS = [sys.executable, "-m", "hpcjobs"]
KEYS = ("fault_to_first_resumed_step_s", "steps_redone", "job_wall_s", "survivor_start_to_first_step_s")


def one_run(arm: str, tmp: Path) -> dict[str, Any]:
    run = tmp / "run"
    env = {**os.environ, "HPCJOBS_HOME": str(tmp / "home"), "HPCJOBS_LOCAL_CKPT_DIR": str(tmp / "shm"),
           "HPCJOBS_FAULT_INJECT": f"step@{FAULT_STEP}:1", "HPCJOBS_FAULT_ACTION": "kill",
           "HPCJOBS_FAULT_RESTART": "0", "USER": os.environ.get("USER", "bench"), **ARMS[arm]}
    f, wall = faulted_job(run, env, ["trainers.tasks.lm", "--size", "tiny", "--steps", str(STEPS), "--ckpt-every",
                                     "200", "--local-ckpt-every", "5"])
    if "error" in f:
        return {"arm": arm, **f}
    survivor = next((r for r in rows_of(run / "startup.jsonl") if r.get("restart") == 1 and r.get("rank") == 0), {})
    kept = [r for r in rows_of(run / "restarts.jsonl") if "replaced" in r]
    return {"arm": arm, "fault_to_first_resumed_step_s": f["to_first_step_s"], "resumed_step": f["resumed_step"],
            "tier": f["tier"], "steps_redone": None if f["resumed_step"] is None else FAULT_STEP - f["resumed_step"],
            "job_wall_s": round(wall, 1), "survivor_kept": bool(kept),
            "survivor_start_to_first_step_s": round(survivor["first_step"] - survivor["launched"], 3)
            if survivor.get("first_step") and survivor.get("launched") else None, "survivor_startup": survivor}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    runs: list[dict[str, Any]] = []
    for i in range(ns.rounds):
        for arm in (ARMS if i % 2 == 0 else reversed(list(ARMS))):
            with tempfile.TemporaryDirectory(prefix="hpcjobs-bench-rejoin-") as tmp:
                runs.append({"round": i, **one_run(arm, Path(tmp))})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "survivor_startup"}), flush=True)
    medians = {arm: {key: median_of(runs, arm, key) for key in KEYS} for arm in ARMS}
    RESULTS.write_text(json.dumps({"commit": commit.strip(), "fault_step": FAULT_STEP, "steps": STEPS, "runs": runs,
                                   "medians": medians, "load_average": os.getloadavg()}, indent=1) + "\n")
    print(json.dumps(medians))
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
