"""bench/startup: how start-up grows with the node count on the real test cluster, both submit paths, cold and after
a requeue.

For each N (one rank per node, the example LM, tiny), a job is submitted (`hpcjobs submit`, or `hpcjobs render` +
plain `sbatch`), runs to its first step, is asked to stop by `scancel --signal=USR2` (checkpoint, requeue, as a
preemption does), and comes back to its first resumed step; then it is cancelled. Each rank writes when it was
launched, had torch imported, joined the group and finished its first step (RUN/startup.jsonl, trainers/startup.py);
Slurm gives when the job ran (StartTime, whole seconds). Stages are cumulative seconds since submit (cold) or since
the stop was committed and the requeue asked for (requeue), each the slowest rank's.

Each rank also writes the CPU time it had used at each mark, so the split says which stage's own work grows with N:
16 "nodes" of the test cluster share this host's cores, so a stage whose CPU per rank stays flat still takes N times
longer in wall time. `floor` is what a bare process that imports torch and takes one AdamW step costs on this host
(torch.optim imports torch._dynamo when the optimizer is built), read inside it as a rank's marks are: alone, its CPU
over the cores; and N of them started at once, for each N of the sweep, with the slope of the time until the last
has taken its step: no trainer that uses torch.optim can start N ranks on these cores with a slope under that one.
`import torch` alone is also given.

Targets (issue 13): cold submit → first step grows at most linearly, slope ≤ 0.5 s per node; requeue → first resumed
step ≤ 1.2 × submit → first step; requeue → running ≤ 10 s.

    tests/cluster/testcluster.sh exec .venv/bin/python bench/startup.py [--nodes 2,4,8,16] [--paths submit,sbatch]
(the cluster started with HPCJOBS_CLUSTER_NODES ≥ the largest N). Writes bench/results/startup.json.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from hpcjobs.protocol.runfolder import STARTUP_MARKS, RunFolder, read_jsonl

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "startup.json"
HPCJOBS = [str(Path(shutil.which("hpcjobs") or REPO / ".venv" / "bin" / "hpcjobs"))]
ENTRY = ["trainers.tasks.lm", "--size", "tiny", "--steps", "1000000", "--log-every", "1000", "--ckpt-every", "100000"]
RANK_STAGES = STARTUP_MARKS
CPU_STAGES = RANK_STAGES[1:]  # marks with the CPU used by then (trainers.startup); "launched" is the process's start
# A bare torch process, timed as a rank is (trainers.startup.mark: the process's own CPU clock, read in it, so its
# exit, which collects every object torch made, is not counted): after `import torch`, and after one AdamW step; and
# the wall-clock moments of both, for processes started together.
TORCH_FLOOR = ("import json, time; import torch; t, w = time.process_time(), time.time(); m = torch.nn.Linear(4, 4); "
               "o = torch.optim.AdamW(m.parameters()); m(torch.ones(4)).sum().backward(); o.step(); "
               "print(json.dumps({'cpu': [t, time.process_time()], 'wall': [w, time.time()]}))")


def sh(*args: str) -> str:
    out = subprocess.run(args, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def test_profile() -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text()))


def make_profile(folder: Path, nodes: int) -> Path:
    data = test_profile()
    data.update(runs_dir=str(folder / "runs"), max_nodes=nodes)
    path = folder / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def submit(path: str, nodes: int, profile: Path, run: Path) -> str:
    common = ["--profile", str(profile), "--nodes", str(nodes), "--gpus", "1", "--run-dir", str(run)]
    if path == "submit":
        return json.loads(sh(*HPCJOBS, "submit", *common, "--json", *ENTRY))["job_id"]
    script = run.parent / f"{run.name}.sbatch"
    sh(*HPCJOBS, "render", *common, "-o", str(script), *ENTRY)
    return sh("sbatch", "--parsable", str(script)).strip()


def wait_for_ranks(run: Path, restart: int, nodes: int, timeout: float = 300) -> list[dict[str, Any]]:
    """The startup lines of `restart`, once every rank wrote its own."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        lines = [r for r in read_jsonl(RunFolder(run).startup) if r.get("restart") == restart]
        if len(lines) >= nodes:
            return lines
        time.sleep(0.2)
    raise SystemExit(f"{run}: restart {restart} did not reach its first step on {nodes} ranks in {timeout:.0f} s")


def slurm_start(job: str) -> float:
    fields = dict(f.split("=", 1) for f in sh("scontrol", "show", "job", "-o", job).split() if "=" in f)
    return datetime.datetime.fromisoformat(fields["StartTime"]).timestamp()


def stages(t0: float, running: float, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"running": running - t0}
    for stage in RANK_STAGES:
        row[stage] = max(r[stage] for r in ranks) - t0
    row["cpu_s_per_rank"] = statistics.mean(r["cpu_s"] for r in ranks)
    used = [statistics.mean(r["cpu_at"][stage] for r in ranks) for stage in CPU_STAGES]
    row["cpu_s_per_rank_by_stage"] = {stage: b - a for stage, (a, b) in
                                      zip(CPU_STAGES, itertools.pairwise((0.0, *used)), strict=True)}
    return round_all(row)


def round_all(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round_all(v) if isinstance(v, dict) else round(v, 2) for k, v in row.items()}


def bare_torch(n: int, env: dict[str, str]) -> list[dict[str, list[float]]]:
    """`n` bare torch processes started at once: each one's CPU seconds and its wall-clock seconds since the start,
    when it had imported torch and when it had taken its step."""
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, "-c", TORCH_FLOOR], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(n)]
    said = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a bare torch process failed")
    return [{"cpu": r["cpu"], "wall": [w - t0 for w in r["wall"]]} for r in said]


def started_together(n: int, env: dict[str, str]) -> dict[str, float]:
    """Seconds until the last of `n` bare torch processes started at once had imported torch, and had taken its
    step; median of three."""
    runs = [bare_torch(n, env) for _ in range(3)]
    return {stage: round(statistics.median(max(r["wall"][i] for r in run) for run in runs), 2)
            for i, stage in enumerate(("imported", "first_step"))}


def floor(counts: list[int]) -> dict[str, Any]:
    """What bare torch costs here, in the ranks' environment (the test profile's: one thread). Alone (median of
    five): the CPU to import torch and to take a first optimizer step (torch.optim imports torch._dynamo), each over
    the cores the least slope of a start whose ranks share them. Together (median of three): N such processes started
    at once, as N one-rank nodes start here, and the seconds until the last has imported torch and until the last
    has taken its step; their least-squares slope over N is the floor with the cost of sharing the cores included."""
    env = {**os.environ, **{k: str(v) for k, v in test_profile()["env"].items()}}
    alone = [bare_torch(1, env)[0] for _ in range(5)]
    imported, stepped = (statistics.median(r["cpu"][i] for r in alone) for i in (0, 1))
    cores = len(os.sched_getaffinity(0))
    together = {n: started_together(n, env) for n in counts}
    result: dict[str, Any] = {
        "cpu_s": round(stepped, 2), "import_torch_cpu_s": round(imported, 2), "cores": cores,
        "least_slope_s_per_node": round(stepped / cores, 2),
        "least_slope_import_torch_only_s_per_node": round(imported / cores, 2),
        "started_together_s": {str(n): t for n, t in together.items()}}
    if len(counts) > 1:
        result["started_together_slope_s_per_node"] = {
            stage: least_squares(counts, [together[n][stage] for n in counts]) for stage in ("imported", "first_step")}
    return result


def stop_time(run: Path) -> float:
    deadline = time.time() + 120
    while time.time() < deadline:
        stops = [r for r in RunFolder(run).read_restarts() if "stopped" in r]
        if stops:
            return float(stops[0]["time"])
        time.sleep(0.2)
    raise SystemExit(f"{run}: the stop asked by scancel --signal=USR2 was never committed")


def measure(path: str, nodes: int, folder: Path) -> dict[str, Any]:
    run = folder / f"{path}-{nodes}"
    t0 = time.time()
    job = submit(path, nodes, make_profile(folder, nodes), run)
    ranks = wait_for_ranks(run, 0, nodes)
    cold = stages(t0, slurm_start(job), ranks)
    sh("scancel", "--signal=USR2", job)
    t1 = stop_time(run)
    ranks = wait_for_ranks(run, 1, nodes)
    requeue = stages(t1, slurm_start(job), ranks)
    sh("scancel", job)
    while sh("squeue", "-h", "-j", job, "-o", "%T").strip():
        time.sleep(0.5)
    row = ratios({"path": path, "nodes": nodes, "job": job, "cold": cold, "requeue": requeue})
    print(json.dumps(row), flush=True)
    return row


def ratios(row: dict[str, Any]) -> dict[str, Any]:
    """requeue → first resumed step over submit → first step; and the same from the moment each start ran (what the
    resumed start itself costs, without Slurm's hold of a requeued job: AuthInfo's cred_expire + 1 s)."""
    cold, requeue = row["cold"], row["requeue"]
    return {**row, "requeue_over_cold": round(requeue["first_step"] / cold["first_step"], 2),
            "resumed_start_over_cold_start": round((requeue["first_step"] - requeue["running"]) /
                                                   (cold["first_step"] - cold["running"]), 2)}


def slope(rows: list[dict[str, Any]], phase: str, stage: str) -> float:
    """Least-squares seconds per node of one stage over the node counts measured."""
    return least_squares([r["nodes"] for r in rows], [r[phase][stage] for r in rows])


def least_squares(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return round(sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="2,4,8,16")
    ap.add_argument("--paths", default="submit,sbatch")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    folder = Path(f"/tmp/hpcjobs-bench-startup-{int(time.time())}")
    folder.mkdir()
    folder.chmod(0o755)
    rows = [measure(path, n, folder) for path in args.paths.split(",") for n in counts]
    slopes = {path: {f"{phase}.{stage}": slope([r for r in rows if r["path"] == path], phase, stage)
                     for phase in ("cold", "requeue") for stage in ("running", *RANK_STAGES)}
              for path in args.paths.split(",")} if len(counts) > 1 else {}
    result = {"host": "2-core VM, every node a network namespace on it", "nodes": counts, "rows": rows,
              "slope_s_per_node": slopes, "floor": floor(counts), "when": time.strftime("%Y-%m-%d %H:%M")}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(slopes, indent=1))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
