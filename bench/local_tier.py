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

`--cost`: what the tier costs a step (issue 40's target: <= 2% of the step time at the default interval): 2 gloo
ranks on the CPU started as the local backend starts them (`python -m trainers.launch` each), the classifier
(COST_ARGS), COST_STEPS steps, no shared saves (`--ckpt-every 0`), the tier off / every 5 / auto, interleaved
rounds, the tier in a fresh folder of /dev/shm. A run's step time comes from its metrics.jsonl lines (one every 5
steps): `step_ms` over steps WINDOW (auto's interval measured and agreed: its saves at steps 10, 20 and 30 come
before it), `step_ms_all` over steps 5 to the end (those three saves in). Writes bench/results/local_tier_cost.json.

    .venv/bin/python bench/local_tier.py --cost --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


def faulted_job(run: Path, env: dict[str, str], entry: list[str]) -> tuple[dict[str, Any], float]:
    """`hpcjobs submit` of 2 local ranks running `entry` into `run`, then its one fault's line from `hpcjobs goodput
    --json` (or {"error": ...}), and the job's wall time. bench/rejoin.py runs its arms through this too."""
    began = time.monotonic()
    out = subprocess.run([*HPCJOBS, "submit", "--profile", str(REPO / "cluster_profiles" / "local.yaml"), "--gpus",
                          "2", "--run-dir", str(run), "--no-snapshot", *entry], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    wall = time.monotonic() - began
    if out.returncode != 0:
        return {"error": out.stderr[-800:], "rc": out.returncode}, wall
    good = subprocess.run([*HPCJOBS, "goodput", str(run), "--json"], cwd=REPO, env=env, capture_output=True,
                          text=True, check=False)
    faults = json.loads(good.stdout).get("faults", []) if good.returncode == 0 else []
    if len(faults) != 1:
        return {"error": f"{len(faults)} faults in goodput: {good.stdout[-400:]}{good.stderr[-400:]}"}, wall
    return faults[0], wall


def one_run(arm: str, tmp: Path) -> dict[str, Any]:
    """One local job of `arm`, rank 1 killed after FAULT_STEP; the goodput figures of its fault."""
    run = tmp / "run"
    env = {**os.environ, "HPCJOBS_HOME": str(tmp / "home"), "HPCJOBS_LOCAL_CKPT_DIR": str(tmp / "shm"),
           "HPCJOBS_FAULT_INJECT": f"step@{FAULT_STEP}:1", "HPCJOBS_FAULT_ACTION": "kill",
           "HPCJOBS_FAULT_RESTART": "0", "USER": os.environ.get("USER", "bench")}
    f, wall = faulted_job(run, env, ["trainers.tasks.lm", "--size", "tiny", "--steps", str(STEPS), *ARMS[arm]])
    if "error" in f:
        return {"arm": arm, **f}
    step_s = step_time(run / "metrics.jsonl")
    redone = None if f["resumed_step"] is None else FAULT_STEP - f["resumed_step"]
    return {"arm": arm, "fault_to_first_resumed_step_s": f["to_first_step_s"], "resumed_step": f["resumed_step"],
            "last_step": f["last_step"], "steps_redone": redone, "redone_s": f["redone_s"], "tier": f["tier"],
            "noticed_s": f["noticed_s"], "step_s": step_s, "job_wall_s": round(wall, 1),
            "resumed_start_rank0": next((r for r in rows_of(run / "startup.jsonl")
                                         if r.get("restart") == 1 and r.get("rank") == 0), None),
            "fault_to_fault_step_again_s": None if redone is None or f["to_first_step_s"] is None or step_s is None
            else round(f["to_first_step_s"] + redone * step_s, 3)}


COST = REPO / "bench" / "results" / "local_tier_cost.json"
COST_STEPS = 400
WINDOW = (35, COST_STEPS)
COST_ARGS = ["trainers.tasks.classifier", "--samples", "512", "--hidden", "32", "--batch-size", "4", "--seed", "3",
             "--log-every", "5", "--ckpt-every", "0", "--steps", str(COST_STEPS)]
COST_ARMS = {"off": "0", "every 5": "5", "auto": "auto"}
SHM = "/dev/shm" if Path("/dev/shm").is_dir() else None
"""The tier's folder as the ranks use it by default: tmpfs (a folder on disk adds each file's fsync)."""


def cost_run(arm: str, tmp: Path, shm: Path) -> dict[str, Any]:
    """One job of 2 CPU ranks with the tier at `arm`: its step time over WINDOW, and auto's chosen interval."""
    from hpcjobs.protocol.ports import free_port

    port, procs, outs = free_port(), [], []
    drop = ("SLURM_", "HPCJOBS_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for r in range(2):
        env = {**base, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "HPCJOBS_JOB_ID": "bench-cost", "HPCJOBS_LOCAL_CKPT_DIR": str(shm)}
        outs.append(tmp / f"rank{r}.out")
        procs.append(subprocess.Popen([sys.executable, "-m", "trainers.launch", "--run-dir", str(tmp / "run"), "--",
                                       *COST_ARGS, "--local-ckpt-every", COST_ARMS[arm]], cwd=REPO, env=env,
                                      stdout=open(outs[-1], "w"), stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=900) for p in procs]
    said = "".join(o.read_text() for o in outs)
    if codes != [0, 0]:
        return {"arm": arm, "error": said[-800:], "codes": codes}
    rows = [r for r in rows_of(tmp / "run" / "metrics.jsonl") if "time" in r]
    chosen = re.search(r"local checkpoints every (\d+) step\(s\) \(--local-ckpt-every auto: a save costs the loop "
                       r"([\d.]+) ms, a step takes ([\d.]+) ms", said)
    return {"arm": arm, "step_ms": ms_a_step([r for r in rows if WINDOW[0] <= r["step"] <= WINDOW[1]]),
            "step_ms_all": ms_a_step(rows),
            "auto_every": int(chosen[1]) if chosen else None, "auto_save_cost_ms": float(chosen[2]) if chosen else None,
            "auto_step_ms": float(chosen[3]) if chosen else None}


def ms_a_step(rows: list[dict[str, Any]]) -> float:
    return round(1000 * (rows[-1]["time"] - rows[0]["time"]) / (rows[-1]["step"] - rows[0]["step"]), 3)


def cost_main(rounds: int) -> int:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    runs: list[dict[str, Any]] = []
    for i in range(rounds):
        for arm in (COST_ARMS if i % 2 == 0 else reversed(list(COST_ARMS))):
            with tempfile.TemporaryDirectory(prefix="hpcjobs-bench-tier-cost-") as tmp, \
                    tempfile.TemporaryDirectory(prefix="bench-tier-", dir=SHM) as shm:
                runs.append({"round": i, **cost_run(arm, Path(tmp), Path(shm))})
            print(json.dumps(runs[-1]), flush=True)
    medians = {arm: median_of(runs, arm, "step_ms") for arm in COST_ARMS}
    medians_all = {arm: median_of(runs, arm, "step_ms_all") for arm in COST_ARMS}
    off = medians["off"]
    per_round = {arm: [round(r["step_ms"] / o["step_ms"], 4) for r in runs for o in runs if r["arm"] == arm and
                       o["arm"] == "off" and r["round"] == o["round"] and "step_ms" in r and "step_ms" in o]
                 for arm in COST_ARMS if arm != "off"}
    out = {"commit": commit.strip(), "args": COST_ARGS, "window": WINDOW, "runs": runs, "median_step_ms": medians,
           "median_step_ms_all": medians_all,
           "ratio_of_medians_all": {a: round(m / medians_all["off"], 4) if m and medians_all["off"] else None
                                    for a, m in medians_all.items()},
           "ratio_of_medians": {a: round(m / off, 4) if m and off else None for a, m in medians.items()},
           "median_of_round_ratios": {a: statistics.median(v) if v else None for a, v in per_round.items()},
           "load_average": os.getloadavg()}
    COST.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("median_step_ms", "ratio_of_medians", "median_of_round_ratios",
                                          "ratio_of_medians_all")}))
    return 0 if all("error" not in r for r in runs) else 1


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
    p.add_argument("--cost", action="store_true", help="the tier's cost a step (off / every 5 / auto)")
    ns = p.parse_args()
    if ns.cost:
        return cost_main(ns.rounds)
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
