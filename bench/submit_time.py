"""bench/submit_time: what checking a bundled task's flags and the trackers' packages before queueing (issue 26
item 4: hpcjobs/request/taskcheck.py) adds to `hpcjobs submit`, timed as `submit --dry-run` (the same argv → profile →
spec → checks as a submit, without sbatch) of this tree against a baseline tree (a git worktree of the commit
before), interleaved rounds, medians.

    git worktree add /tmp/submit-base <commit-before> --detach
    .venv/bin/python bench/submit_time.py --baseline /tmp/submit-base [--rounds 15]
Writes bench/results/submit_time.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "submit_time.json"
REPO = Path(__file__).resolve().parent.parent
CASES = {
    "lm": ["trainers.tasks.lm", "--size", "small", "--steps", "100"],
    "lm+tracker": ["trainers.tasks.lm", "--size", "small", "--steps", "100", "--tracker", "jsonl,mlflow"],
}


def once(tree: Path, argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree), "HPCJOBS_HOME": "/tmp/hpcjobs-bench-submit-home"}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hpcjobs", "submit", "--dry-run", "--profile", "testcluster",
                          "--nodes", "2", "--gpus", "8", *argv], cwd=REPO, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr.strip()}")
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, required=True, help="a worktree of the commit before the checks")
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args()
    times: dict[str, dict[str, list[float]]] = {c: {"baseline": [], "now": []} for c in CASES}
    for _ in range(a.rounds):
        for case, argv in CASES.items():
            for which, tree in (("baseline", a.baseline), ("now", REPO)):
                times[case][which].append(once(tree, argv))
    rows = {}
    for case, t in times.items():
        base, now = statistics.median(t["baseline"]), statistics.median(t["now"])
        rows[case] = {"baseline_s": base, "now_s": now, "added_ms": (now - base) * 1000, "ratio": now / base, **t}
        print(f"{case}: submit --dry-run median {base * 1000:.0f} ms before, {now * 1000:.0f} ms now "
              f"({(now - base) * 1000:+.0f} ms, {now / base:.3f}x), {a.rounds} interleaved rounds")
    RESULTS.write_text(json.dumps({"rounds": a.rounds, "python": sys.version.split()[0], "cases": rows}, indent=1)
                       + "\n")


if __name__ == "__main__":
    main()
