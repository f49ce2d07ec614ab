"""bench/hf_trainer: an unchanged Hugging Face Trainer script (tests/scripts/hf_trainer_script.py: a tiny GPT-2, 2
CPU ranks on gloo) under `hpcjobs submit --profile local` against the same script under `torchrun`, in interleaved
rounds (this machine drifts ±10% between runs). Reported: each run's step time (the Trainer's own train_runtime over
its steps, no checkpoint in between), the median ratio hpcjobs / torchrun of the rounds (target ≤ 1.02); hpcjobs's
runs carry the stop checks at the integrations' cadence (trainers/integrations/checks.py: every step end over the
first 12, then about once a second; the all-reduce bench/stop_agreement.py times alone).

    .venv/bin/python bench/hf_trainer.py [--rounds 4] [--steps 100] [--control]
Writes bench/results/hf_trainer.json and prints a summary.
"""

from __future__ import annotations

import argparse
import ast
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
SCRIPT = REPO / "tests" / "scripts" / "hf_trainer_script.py"
RESULTS = Path(__file__).parent / "results" / "hf_trainer.json"
BIN = Path(sys.executable).parent


def step_seconds(output: str, steps: int) -> float:
    """train_runtime / steps from the Trainer's last log line ({'train_runtime': '12.3', ...})."""
    line = next(x for x in reversed(output.splitlines()) if x.startswith("{'train_runtime'"))
    return float(ast.literal_eval(line)["train_runtime"]) / steps


def run(how: str, folder: Path, steps: int) -> float:
    args = [str(SCRIPT), "--output_dir", str(folder / "out"), "--max_steps", str(steps), "--save_steps", "1000000"]
    if how == "hpcjobs":
        cmd = [str(BIN / "hpcjobs"), "submit", "--profile", "local", "--gpus", "2", "--run-dir", str(folder / "run"),
               *args]
    else:
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the local launcher gives each of its 2 ranks on 2 cores
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=folder, env=env, timeout=900)
    said = out.stdout + out.stderr
    # Under torchrun the script's ranks can abort at exit after training (the script never destroys its process
    # group: "terminate called without an active exception", exit -6); its step times are still whole.
    if "{'train_runtime'" not in said:
        raise SystemExit(f"{how} failed (exit {out.returncode}):\n{said[-3000:]}")
    return step_seconds(said, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--control", action="store_true", help="a second torchrun run each round: the spread of "
                   "torchrun / torchrun is what this machine's noise alone makes of a ratio")
    a = p.parse_args()
    rounds: list[dict[str, Any]] = []
    hows = ["hpcjobs", "torchrun", *(["torchrun-again"] if a.control else [])]
    for r in range(a.rounds):
        order = hows[r % len(hows):] + hows[:r % len(hows)]  # each takes each place in turn
        row: dict[str, Any] = {}
        for how in order:
            with tempfile.TemporaryDirectory() as tmp:
                row[how] = run(how.removesuffix("-again"), Path(tmp), a.steps)
        row["ratio"] = row["hpcjobs"] / row["torchrun"]
        if a.control:
            row["control_ratio"] = row["torchrun-again"] / row["torchrun"]
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{how} {1000 * row[how]:.1f} ms/step" for how in hows) +
              f", ratio {row['ratio']:.3f}" + (f", control {row['control_ratio']:.3f}" if a.control else ""),
              flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "steps": a.steps, "ranks": 2,
              "rounds": rounds, "ratio_median": statistics.median(r["ratio"] for r in rounds)}
    if a.control:
        result["control_ratio_median"] = statistics.median(r["control_ratio"] for r in rounds)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"median ratio hpcjobs / torchrun: {result['ratio_median']:.3f} (target ≤ 1.02)" +
          (f"; torchrun / torchrun: {result['control_ratio_median']:.3f}" if a.control else "") + f"; {RESULTS}")

if __name__ == "__main__":
    main()
