"""bench/hf_trainer: an unchanged Hugging Face Trainer script (tests/scripts/hf_trainer_script.py: a tiny GPT-2, 2
CPU ranks on gloo) under `hpcjobs submit --profile local` against the same script under `torchrun`, in interleaved
rounds. Reported: each run's step time (the Trainer's own train_runtime over its steps, no checkpoint in between), and
over the rounds the geometric mean of the ratios hpcjobs / torchrun with its 95% bootstrap interval (target ≤ 1.02),
beside their median. Why so many rounds: this machine's speed wanders in time, not by run: one torchrun run's steps
per 5 s window ranged 269-331 (±10%), the ranks' main threads needing 9.0-11.8 ms of CPU a step from run to run, and
the wall time of a step followed that CPU time; a 600-step run's ratio is ±10%, and only the mean of many rounds can
tell 2% apart. `--control` adds a second torchrun run a round: its interval must hold 1.0. hpcjobs's
runs carry the stop checks at the integrations' cadence (trainers/integrations/checks.py: every step end over the
first 12, then about once a second; the all-reduce bench/stop_agreement.py times alone). What this bench found: ranks
left in the shell's session ran several % slower than torchrun's, each in a session of its own as fast: the kernel
shares CPU time by session (hpcjobs/backends/local/ranks.py rank_preexec; the figures in bench/README.md).

    .venv/bin/python bench/hf_trainer.py [--rounds 4] [--steps 100] [--control] [--variants hpcjobs,torchrun-launch]
Writes bench/results/hf_trainer.json and prints a summary.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hpcjobs.protocol.contract import LaunchContract

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "hf_trainer_script.py"
RESULTS = Path(__file__).parent / "results" / "hf_trainer.json"
BIN = Path(sys.executable).parent


def step_seconds(output: str, steps: int) -> float:
    """train_runtime / steps from the Trainer's last log line ({'train_runtime': '12.3', ...})."""
    line = next(x for x in reversed(output.splitlines()) if x.startswith("{'train_runtime'"))
    return float(ast.literal_eval(line)["train_runtime"]) / steps


VARIANTS = {
    "hpcjobs": "hpcjobs submit --profile local",
    "torchrun": "torchrun",
    "torchrun-again": "torchrun again: what the machine's noise alone makes of a ratio",
    "hpcjobs-hooks-off": "hpcjobs submit --env HPCJOBS_HOOKS=0: no callback, watchdog or agreement",
    "torchrun-launch": "torchrun starting hpcjobs's rank launcher (python -m trainers.launch --kind script): the rank "
                       "as under hpcjobs (log tee, signals, hooks), spawned by torchrun",
}
"""The variants a round can run; every ratio is taken to torchrun's run of the same round."""


def command(how: str, folder: Path, steps: int) -> list[str]:
    args = [str(SCRIPT), "--output_dir", str(folder / "out"), "--max_steps", str(steps), "--save_steps", "1000000"]
    torchrun = [str(BIN / "torchrun"), "--nproc_per_node", "2"]
    if how.startswith("hpcjobs"):
        off = ["--env", "HPCJOBS_HOOKS=0"] if how == "hpcjobs-hooks-off" else []
        return [str(BIN / "hpcjobs"), "submit", "--profile", "local", "--gpus", "2", "--run-dir", str(folder / "run"),
                *off, *args]
    if how == "torchrun-launch":
        (folder / "run").mkdir()
        contract = LaunchContract(run_dir=str(folder / "run"), submit_dir=str(folder)).to_json()
        return [*torchrun, "-m", "trainers.launch", "--contract", contract, "--kind", "script", "--", *args]
    return [*torchrun, *args]


def run(how: str, folder: Path, steps: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the local launcher gives each of its 2 ranks on 2 cores
    out = subprocess.run(command(how, folder, steps), capture_output=True, text=True, cwd=folder, env=env, timeout=900)
    said = out.stdout + out.stderr
    # Under torchrun the script's ranks can abort at exit after training (the script never destroys its process
    # group: "terminate called without an active exception", exit -6); its step times are still whole.
    if "{'train_runtime'" not in said:
        raise SystemExit(f"{how} failed (exit {out.returncode}):\n{said[-3000:]}")
    return step_seconds(said, steps)


def interval(ratios: list[float], resamples: int = 10000) -> dict[str, float]:
    """The geometric mean of `ratios` and its 95% bootstrap interval (seeded: the same rounds give the same figures)."""
    logs = [math.log(r) for r in ratios]
    pick = random.Random(0)
    means = sorted(statistics.fmean(pick.choices(logs, k=len(logs))) for _ in range(resamples))
    return {"mean": math.exp(statistics.fmean(logs)), "low": math.exp(means[int(0.025 * resamples)]),
            "high": math.exp(means[int(0.975 * resamples) - 1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--control", action="store_true", help="add torchrun-again: the spread of torchrun / torchrun is "
                   "what this machine's noise alone makes of a ratio")
    p.add_argument("--variants", default="hpcjobs,torchrun", help="which of " + ", ".join(VARIANTS) +
                   " (torchrun always)")
    a = p.parse_args()
    hows = list(dict.fromkeys([*a.variants.split(","), "torchrun", *(["torchrun-again"] if a.control else [])]))
    if unknown := [h for h in hows if h not in VARIANTS]:
        raise SystemExit(f"--variants {','.join(unknown)}: valid: {', '.join(VARIANTS)}")
    others = [h for h in hows if h != "torchrun"]
    rounds: list[dict[str, Any]] = []
    for r in range(a.rounds):
        order = hows[r % len(hows):] + hows[:r % len(hows)]  # each takes each place in turn
        row: dict[str, Any] = {}
        for how in order:
            with tempfile.TemporaryDirectory() as tmp:
                row[how] = run(how, Path(tmp), a.steps)
        row["ratios"] = {h: row[h] / row["torchrun"] for h in others}
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{h} {1000 * row[h]:.1f} ms/step" for h in hows) + "; " +
              ", ".join(f"{h} {v:.3f}" for h, v in row["ratios"].items()), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "steps": a.steps, "ranks": 2,
              "variants": {h: VARIANTS[h] for h in hows}, "rounds": rounds,
              "ratios": {h: {**interval([r["ratios"][h] for r in rounds]),
                             "median": statistics.median(r["ratios"][h] for r in rounds)} for h in others}}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    for h, x in result["ratios"].items():
        print(f"{h} / torchrun: {x['mean']:.3f} (95% {x['low']:.3f}-{x['high']:.3f}), median {x['median']:.3f}" +
              (" (target ≤ 1.02)" if h == "hpcjobs" else ""))
    print(RESULTS)


if __name__ == "__main__":
    main()
