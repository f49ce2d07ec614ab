"""bench/fault_goodput: a long 2-node run on the test cluster with faults and preemptions injected, recovered with
no person acting; then `hpcjobs goodput` says where the time went (issue 27's campaign).

The faults, one every `--every` seconds once the job trains, in this order: a rank SIGKILLed, a rank SIGSTOPped (a
hang: its peers' collectives time out after HPCJOBS_COLLECTIVE_TIMEOUT), a preemption notice (`scancel
--signal=USR2`: the job saves, requeues and waits out Slurm's requeue hold), a rank SIGKILLed, a rank SIGSTOPped.
The final weights are compared with nothing here (tests/cluster/test_faults_cluster.py does that per fault); the
result is the goodput report: the buckets must add up to the wall time, and ETTR is what it is.

    tests/cluster/testcluster.sh up
    tests/cluster/testcluster.sh exec env -C "$PWD" PATH="$PWD/.venv/bin:$PATH" .venv/bin/python bench/fault_goodput.py
Writes bench/results/fault_goodput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "fault_goodput.json"
FAULTS = ("kill", "stop", "preempt", "kill", "stop")
LOCAL = False
"""--profile local: the same campaign on this machine, 2 ranks (no preemption: nothing requeues a local job)."""
LOCAL_STATE = ["RUNNING"]


def hpcjobs(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "hpcjobs"), *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "HPCJOBS_HOME": str(home)}, check=False)


def state(job: str) -> str:
    if LOCAL:
        return LOCAL_STATE[0]
    out = subprocess.run(["sacct", "-n", "-X", "-j", job, "-o", "State"], capture_output=True, text=True).stdout
    return out.split()[0] if out.split() else ""


def local_rank_pids() -> list[int]:
    """A local job's ranks: this user's `trainers.launch` processes, not a warm spare (hpcjobs.protocol.rejoin)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd, env = (proc / "cmdline").read_bytes(), (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"trainers.launch" in cmd and b"hpcjobs-fault-goodput-" in cmd and b"HPCJOBS_SPARE=" not in env:
            pids.append(int(proc.name))
    return pids


def rank_pids() -> list[int]:
    """The ranks' processes on the nodes (each node is a network namespace of the test cluster)."""
    if LOCAL:
        return local_rank_pids()
    pids = []
    for node in ("node1", "node2"):
        listed = subprocess.run(["ip", "netns", "pids", f"hpcj-{node}"], capture_output=True, text=True).stdout
        for pid in listed.split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            argv0 = Path(cmd.split(b"\0")[0].decode(errors="replace")).name
            # a rank's own Python: not srun, whose command line names trainers.launch too (the first campaign
            # SIGKILLed the batch step's srun once, which the recovery also brought back)
            if b"trainers.launch" in cmd and argv0.startswith("python"):
                pids.append(int(pid))
    return pids


def inject(fault: str, job: str, rng: random.Random) -> str:
    if fault == "preempt":
        subprocess.run(["scancel", "--signal=USR2", job], check=False)
        return "scancel --signal=USR2"
    pids = rank_pids()
    if not pids:
        return "no rank running"
    pid = rng.choice(pids)
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    return f"{'SIGKILL' if fault == 'kill' else 'SIGSTOP'} to pid {pid}"


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every", type=float, default=90.0, help="seconds between faults once the job trains")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local-ckpt-every", default="0", help="the node-local tier's interval (0: off)")
    p.add_argument("--profile", choices=("testcluster", "local"), default="testcluster")
    ns = p.parse_args()
    if ns.profile == "local":
        return local_campaign(ns)
    rng = random.Random(ns.seed)
    folder = Path(tempfile.mkdtemp(prefix="hpcjobs-fault-goodput-", dir="/tmp"))
    folder.chmod(0o755)
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data.update(runs_dir=str(folder / "runs"), recovery={"max_recoveries": 5})
    data["env"] = {**data.get("env", {}), "HPCJOBS_COLLECTIVE_TIMEOUT": "20"}
    (folder / "profile.yaml").write_text(yaml.safe_dump(data))
    run = folder / "runs" / "campaign"
    out = hpcjobs("submit", "--profile", str(folder / "profile.yaml"), "--nodes", "2", "--gpus", "2", "--run-dir",
                  str(run), "--json", "trainers.tasks.lm", "--size", "tiny", "--steps", str(ns.steps),
                  "--log-every", "50", "--ckpt-every", "100", "--local-ckpt-every", ns.local_ckpt_every, home=folder)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["job_id"]
    while not (run / "heartbeat.json").exists():
        time.sleep(1)
    injected: list[dict[str, Any]] = []
    for fault in FAULTS:
        time.sleep(ns.every)
        if state(job) in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        injected.append({"time": time.time(), "fault": fault, "how": inject(fault, job, rng)})
        print(f"injected {injected[-1]}", flush=True)
    while state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        time.sleep(5)
    return write_result(job, folder, run, ns.steps, injected)


def local_campaign(ns: argparse.Namespace) -> int:
    """The campaign on the `local` profile: kill, stop, kill, stop (a lost rank is replaced while the other keeps
    its process, hpcjobs.protocol.rejoin; a hang is ended by the watchdog and every rank starts again)."""
    global LOCAL
    LOCAL = True
    rng = random.Random(ns.seed)
    folder = Path(tempfile.mkdtemp(prefix="hpcjobs-fault-goodput-", dir="/tmp"))
    run = folder / "runs" / "campaign"
    argv = [str(Path(sys.executable).parent / "hpcjobs"), "submit", "--profile", "local", "--gpus", "2", "--run-dir",
            str(run), "trainers.tasks.lm", "--size", "tiny", "--steps", str(ns.steps), "--log-every", "50",
            "--ckpt-every", "100", "--local-ckpt-every", ns.local_ckpt_every]
    job_proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, "HPCJOBS_HOME": str(folder)},
                                stdout=subprocess.DEVNULL, stderr=open(folder / "submit.err", "w"))
    while not (run / "heartbeat.json").exists():
        time.sleep(1)
    injected: list[dict[str, Any]] = []
    for fault in [f for f in FAULTS if f != "preempt"]:
        time.sleep(ns.every)
        if job_proc.poll() is not None:
            break
        injected.append({"time": time.time(), "fault": fault, "how": inject(fault, "", rng)})
        print(f"injected {injected[-1]}", flush=True)
    code = job_proc.wait()
    LOCAL_STATE[0] = "COMPLETED" if code == 0 else f"FAILED ({code})"
    job = json.loads((run / "final.json").read_text()).get("job_id", "")
    return write_result(job, folder, run, ns.steps, injected, ns.local_ckpt_every)


def write_result(job: str, folder: Path, run: Path, steps: int, injected: list[dict[str, Any]],
                 tier: str = "0") -> int:
    """`hpcjobs goodput`'s report of the campaign's job, with the faults injected, into RESULTS."""
    report = json.loads(hpcjobs("goodput", str(run) if LOCAL else job, "--json", home=folder).stdout)
    total = report["total"]
    result = {"date": time.strftime("%Y-%m-%d"), "job": job, "state": state(job), "steps": steps,
              "profile": "local" if LOCAL else "testcluster", "local_ckpt_every": tier, "faults": injected,
              "goodput": total, "advice": report.get("advice"),
              "buckets_sum_minus_wall_s": round(sum(total["buckets_s"].values()) - total["wall_s"], 3),
              "recoveries": [r for r in map(json.loads, (run / "restarts.jsonl").read_text().splitlines())
                             if r.get("stopped") == "fault"]}
    out = RESULTS.with_name(f"fault_goodput{'_local' if LOCAL else ''}{'' if tier == '0' else '_tier'}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("job", "state", "buckets_sum_minus_wall_s")}), total["ettr"],
          json.dumps(total["buckets_s"]))
    return 0 if result["state"] == "COMPLETED" else 1


if __name__ == "__main__":
    raise SystemExit(main())
