"""bench/fault_recovery: fault → first resumed step on the test cluster, for each fault issue 27 names, in the
allocation and via a requeue (target here: ≤ 30 s in the allocation).

It runs the cluster tests that inject each fault and check the weights against an uninterrupted twin
(tests/cluster/test_faults_cluster.py: a rank SIGKILLed, SIGSTOPped (hung), failing in a collective; a node's link,
slurmd and processes killed, with a spare node and without one), `--rounds` times, and collects the figures each
prints (`FAULT REPORT {json}`): the measurement is the tested run itself, not a copy of it. Needs the cluster with 3
nodes (the spare-node case):

    HPCJOBS_CLUSTER_NODES=3 tests/cluster/testcluster.sh up
    tests/cluster/testcluster.sh exec env -C "$PWD" PATH="$PWD/.venv/bin:$PATH" .venv/bin/python bench/fault_recovery.py

Writes bench/results/fault_recovery.json (every round's figures, and the median per case). `--only EXPR` (a
pytest -k expression, e.g. spare_node_stands_in) runs those cases alone: their new figures replace their earlier ones
in the file, the other cases' stay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "fault_recovery.json"
CASES = "recovered_in_the_allocation or spare_node_stands_in or dead_node_requeues"


def one_round(cases: str) -> list[dict[str, Any]]:
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s", "-m", "slow or not slow",
            "tests/cluster/test_faults_cluster.py", "-k", cases]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    reports = [json.loads(line.split("FAULT REPORT ", 1)[1]) for line in out.stdout.splitlines()
               if "FAULT REPORT {" in line]  # pytest's progress dot may come first on the line
    if out.returncode != 0:
        print("\n".join(line for line in out.stdout.splitlines() if line.startswith(("E ", "FAILED"))),
              file=sys.stderr)
        reports.append({"case": "pytest failed", "rc": out.returncode})
    return reports


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", help="a pytest -k expression: run these cases alone and keep the others' figures")
    ns = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    rounds = []
    for i in range(ns.rounds):
        began = time.time()
        rounds.append(one_round(f"({CASES}) and ({ns.only})" if ns.only else CASES))
        print(f"round {i}: {time.time() - began:.0f} s: " + "; ".join(
            f"{r['case']}: {r.get('fault_to_first_resumed_step_s')} s" for r in rounds[-1]), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit.strip(), "rounds": rounds}
    if ns.only and RESULTS.is_file():
        before = json.loads(RESULTS.read_text())
        again = {r["case"] for rnd in rounds for r in rnd}
        kept = [[r for r in rnd if r["case"] not in again] for rnd in before["rounds"]]
        result = {**before, "rounds": [rnd for rnd in kept if rnd] + rounds,
                  "measured_again": {**before.get("measured_again", {}),
                                     **{case: f"{result['date']} {result['commit']}" for case in again}}}
    by_case: dict[str, list[float]] = {}
    for r in (r for rnd in result["rounds"] for r in rnd if "fault_to_first_resumed_step_s" in r):
        by_case.setdefault(r["case"], []).append(r["fault_to_first_resumed_step_s"])
    median = {case: statistics.median(v) for case, v in by_case.items()}
    RESULTS.write_text(json.dumps({**result, "median_fault_to_first_resumed_step_s": median}, indent=1) + "\n")
    print(json.dumps(median))
    return 0 if all(r["case"] != "pytest failed" for rnd in rounds for r in rnd) else 1


if __name__ == "__main__":
    raise SystemExit(main())
