"""bench/gpu_acceptance: the GPU acceptance suite (P0…P8 of ../shared/docs/gpu-acceptance.md) as one command.

    python bench/gpu_acceptance.py [--budget-min 30] [--parts P0,P1,...] [--work DIR] [--out FILE] [--dry]

Runs the parts in priority order on one GPU, each as the doc writes it (single rank, throughput runs SIGKILLed
before their final save), and writes every figure to bench/results/gpu-<gpu>-acceptance.json after each part, with
a copy in the work folder: each run's command, exit code and seconds; the figures read from its RUN/metrics.jsonl
(median mfu and tokens_per_s, max peak_mem_gib over the intervals after the first two); each check against the
doc's band (pass: true/false, null when the figure is missing). A part that fails is recorded and the next one runs;
a part that no longer fits in the budget is skipped (recorded) and a later, shorter one may still run; P6 (7b) runs
on an H200 only. Ctrl-C or SIGTERM kills the run in progress and keeps what was written.

--dry runs every part end to end on the CPU with the tiny LM (a few steps, gloo, the compiled twins left out:
inductor on a CPU takes minutes; P1 collects the GPU tests without running them; P8 checks bench/gpu.py's command
line): CI runs it so the command cannot rot. Its bands are the GPU's, so on the CPU they read null or false.

On a lent machine (a command runs at most 10 minutes, a lease 15 in all; the whole suite takes ~28 minutes on an
H100), run it in pieces:  timeout 590 python bench/gpu_acceptance.py --budget-min 9  then  --parts P4,P5,P7 ...
with the same results file: a part run again replaces its record, the others stay.

Exit status: 0 when every part that ran had its commands succeed (bands are findings, in the file); 1 when a part
failed; 2 for a bad flag or no GPU without --dry; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from acceptance_parts import PARTS, Part

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
TAIL = 4000  # characters of a command's output kept in the results


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the run in progress was killed; what was written stays."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(signal.Signals(signum).name)


class Suite:
    """How a part runs its commands: from the repository root, in their own session (a timeout or an interrupt
    kills the whole process group: a launcher and its ranks), never past the suite's deadline."""

    def __init__(self, dry: bool, work: Path, deadline: float) -> None:
        self.dry, self.work, self.deadline = dry, work, deadline
        self.gpu = "cpu"
        self.found: dict[str, Any] = {}
        self.env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if dry else {})}
        self.procs: set[subprocess.Popen[str]] = set()  # in flight, for kill_all
        self.stopped = False

    def kill_all(self) -> None:
        for proc in list(self.procs):
            os.killpg(proc.pid, signal.SIGKILL)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, argv: list[str], env: dict[str, str] | None = None, stderr_to: Path | None = None,
            python: bool = True) -> dict[str, Any]:
        if self.stopped:
            raise Interrupted("stopped")
        full = [sys.executable, *argv] if python else argv
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
        shown += (" " if shown else "") + shlex.join(["python", *argv] if python else argv)
        shown += f" 2> {stderr_to}" if stderr_to else ""
        err = open(stderr_to, "w") if stderr_to else None
        t0 = time.monotonic()
        proc = subprocess.Popen(full, cwd=REPO, env={**self.env, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=err or subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        self.procs.add(proc)
        try:
            out, _ = proc.communicate(timeout=max(1.0, self.left()))
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            rc = "timeout"
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            self.procs.discard(proc)
            if err:
                err.close()
        return {"cmd": shown, "rc": rc, "wall_s": round(time.monotonic() - t0, 1), "tail": out[-TAIL:]}


def sdpa_probe(dry: bool) -> dict[str, Any]:
    """P0 in its own process (the suite's own process never touches CUDA): versions, the device, and the kernels
    one causal SDPA forward and backward runs at (8, 16, 2048, 128) in bf16 (dry: (1, 2, 64, 16) on the CPU)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention
    from torch.profiler import DeviceType

    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda" if cuda else "cpu")
    shape = (8, 16, 2048, 128) if cuda else (1, 2, 64, 16)
    found: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                             "cuda": torch.version.cuda,
                             "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}
    try:  # the suite still runs when the profiler fails: P0 records why
        q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            if cuda:
                torch.cuda.synchronize()
        events = prof.key_averages()
        found["kernels"] = sorted({e.key for e in events if e.device_type == DeviceType.CUDA} if cuda else
                                  {e.key for e in events if "attention" in e.key})
    except Exception as e:  # noqa: BLE001  (whatever the profiler raises is the finding)
        found["kernels_error"] = f"{type(e).__name__}: {e}"[:500]
    return found


def slug(gpu: str) -> str:
    words = gpu.replace("NVIDIA", "").split()
    return words[0].lower() if words else "cuda"


def run_part(suite: Suite, part: Part) -> dict[str, Any]:
    """One part, recorded whatever happens to it (a traceback is a finding too)."""
    rec: dict[str, Any] = {"what": part.what, "estimate_min": part.minutes,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if part.h200_only and not suite.dry and "H200" not in suite.gpu:
        return {**rec, "status": "skipped", "why": f"H200 only; this is {suite.gpu}"}
    need = 1.0 if suite.dry else part.minutes * 60
    if suite.left() < need:
        return {**rec, "status": "skipped", "why": f"budget: {suite.left():.0f} s left, ~{need:.0f} s needed"}
    t0 = time.monotonic()
    try:
        rec.update(part.run(suite))
        rec["status"] = "done" if rec.pop("ok") else "failed"
    except Interrupted:
        raise
    except Exception:  # noqa: BLE001  (any part's failure is a finding; the next part runs)
        rec.update(status="failed", error=traceback.format_exc()[-TAIL:])
    checks = [c["pass"] for c in rec.get("checks", []) if c["pass"] is not None]
    rec["pass"] = all(checks) if checks else None
    rec["wall_s"] = round(time.monotonic() - t0, 1)
    return rec


def write(results: dict[str, Any], outs: list[Path]) -> None:
    for out in outs:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        tmp.replace(out)


def summary_line(prio: str, rec: dict[str, Any]) -> str:
    checks = rec.get("checks", [])
    passed = sum(c["pass"] is True for c in checks)
    failed = [c["what"] for c in checks if c["pass"] is False]
    extra = rec.get("why") or (f"bands {passed}/{len(checks)} pass" + (f"; out of band: {', '.join(failed)}"
                                                                        if failed else ""))
    return f"{prio} {rec['status']:8} {rec.get('wall_s', 0):6.0f} s  {rec['what']}: {extra}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/gpu_acceptance.py", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]) + "\n\nParts, in priority order "
                                "(minutes on an H100, model build and compile included):\n" + "\n".join(
                                    f"  {x.prio}  ~{x.minutes:g} min  {x.what}{' (H200 only)' * x.h200_only}"
                                    for x in PARTS),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-min", type=float, default=30.0, help="total minutes for the whole suite (default "
                   "30): a part whose estimate no longer fits is skipped; no command runs past it. Under a "
                   "10-minute command limit give 9")
    p.add_argument("--parts", default=",".join(x.prio for x in PARTS),
                   help="which parts, in priority order whatever the order given (default: all)")
    p.add_argument("--work", type=Path, help="where the runs go (default ~/gpu-acceptance-runs when $OUT is set, as "
                   "on a lent machine, where only a few files of $OUT come back: run folders stay out of it; else a "
                   "new temporary folder); 1b checkpoints are removed after P4")
    p.add_argument("--out", type=Path, help="results file (default $OUT/gpu-<gpu>-acceptance.json when $OUT is set, "
                   "else bench/results/gpu-<gpu>-acceptance.json; with --dry WORK/gpu-dry-acceptance.json); a copy "
                   "goes to WORK/acceptance.json")
    p.add_argument("--dry", action="store_true", help="every part on the CPU with tiny shapes (CI)")
    p.add_argument("--jobs", type=int, default=1, help="with --dry: parts run this many at a time (CI's cores; "
                   "P3 then may not see P2's figures). On a GPU parts always run one at a time: they are timings")
    p.add_argument("--sdpa-probe", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    known = [x.prio for x in PARTS]
    bad = [x for x in a.parts.split(",") if x not in known]
    wrong = {f"--parts {','.join(bad)}": f"parts {','.join(known)}"} if bad else {}
    if a.budget_min <= 0:
        wrong[f"--budget-min {a.budget_min:g}"] = "a positive number of minutes"
    if a.jobs < 1 or (a.jobs > 1 and not a.dry):
        wrong[f"--jobs {a.jobs}"] = "1, or more with --dry (GPU parts are timings: one at a time)"
    if wrong:
        given, valid = next(iter(wrong.items()))
        p.exit(2, f"bench/gpu_acceptance.py: {given}: valid: {valid}. HINT: e.g. --parts P0,P2 --budget-min 11\n")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.sdpa_probe:
        print(json.dumps(sdpa_probe(a.dry)))
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    started = time.monotonic()
    suite = Suite(a.dry, Path(), started + a.budget_min * 60)
    probe = suite.run([__file__, "--sdpa-probe", *(["--dry"] if a.dry else [])])
    env = json.loads(probe["tail"].strip().splitlines()[-1]) if probe["rc"] == 0 else {}
    suite.gpu = env.get("gpu", "unknown")
    if suite.gpu == "unknown" or (suite.gpu == "cpu" and not a.dry):  # before anything is written
        why = ("no CUDA GPU visible" if suite.gpu == "cpu" else
               f"its probe of torch failed ({probe['rc']}: {probe['tail'].strip().splitlines()[-1:]})")
        print(f"bench/gpu_acceptance.py: {why}; valid: a machine where torch.cuda.is_available(). HINT: run it on a "
              "GPU machine, or --dry to run the suite's commands on the CPU", file=sys.stderr)
        return 2
    suite.found["probe"] = {"run": probe, "env": env}
    lent = os.environ.get("OUT")  # a lent machine's: what is written under it comes back, a few files at most
    suite.work = work = a.work or (Path.home() / "gpu-acceptance-runs" if lent else
                                   Path(tempfile.mkdtemp(prefix="gpu-acceptance-")))
    work.mkdir(parents=True, exist_ok=True)
    named = f"gpu-{slug(suite.gpu)}-acceptance.json"
    out = a.out or (work / "gpu-dry-acceptance.json" if a.dry else Path(lent) / named if lent else RESULTS / named)
    outs, chosen, code = [out, work / "acceptance.json"], set(a.parts.split(",")), 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry": a.dry,
                               "commit": commit.stdout.strip(), "budget_min": a.budget_min, "work": str(work),
                               **{k: env.get(k) for k in ("gpu", "torch", "cuda", "nccl")},
                               "parts": {}}
    if out.exists() and not a.dry:  # an earlier piece of the suite: its parts stay unless run again
        results["parts"] = {k: v for k, v in json.loads(out.read_text()).get("parts", {}).items()
                            if k not in chosen}
    print(f"GPU acceptance on {suite.gpu}{' (dry)' if a.dry else ''}: results in {out}, runs in {work}", flush=True)
    pool = ThreadPoolExecutor(a.jobs)
    running = {pool.submit(run_part, suite, part): part for part in PARTS if part.prio in chosen}
    try:
        for done in as_completed(running):  # in priority order when --jobs 1
            part, rec = running[done], done.result()
            suite.found[part.prio] = results["parts"][part.prio] = rec
            code = max(code, int(rec["status"] == "failed"))
            results["wall_s"] = round(time.monotonic() - started, 1)
            results["parts"] = {x.prio: results["parts"][x.prio] for x in PARTS if x.prio in results["parts"]}
            write(results, outs)  # after every part: a cut-off run keeps the rest
            print(summary_line(part.prio, rec), flush=True)
    except Interrupted as e:
        suite.stopped = True  # no new command starts; the ones in flight are killed
        pool.shutdown(wait=False, cancel_futures=True)
        suite.kill_all()
        for part in (x for x in PARTS if x.prio in chosen and x.prio not in results["parts"]):
            results["parts"][part.prio] = {"what": part.what, "status": "interrupted", "why": str(e)}
        write(results, outs)
        print(f"interrupted ({e}): results so far in {out}", file=sys.stderr)
        return 130
    pool.shutdown()
    print(f"wrote {out} ({results.get('wall_s', 0):.0f} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
