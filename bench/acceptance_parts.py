"""The parts of the GPU acceptance suite (../shared/docs/gpu-acceptance.md, P0…P8) for bench/gpu_acceptance.py:
each part's commands, the figures read back from its runs, and the doc's pass bands.

A part is a function of the suite's `Suite` (how to run a command, the shapes, what earlier parts found) that returns
its record: the runs (command, rc, seconds), the figures, and the checks against the bands. `--dry` shrinks every run
to the tiny LM on the CPU (a few steps, gloo, compiled twins not run: inductor on a CPU takes minutes) so the same
code runs end to end in CI.
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SKIP = 2  # intervals dropped before the figures: CUDA warm-up, compilation, first-touch allocations
STATE_1B_GIB = 18.1  # 1b's parameters, gradients and AdamW state on one rank (the doc's P2 row)


class Suite(Protocol):
    dry: bool
    gpu: str
    work: Path
    found: dict[str, Any]

    def run(self, argv: list[str], env: dict[str, str] | None = None, stderr_to: Path | None = None,
            python: bool = True) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Shape:
    """One training run's length: steps, logging interval, the step after which it is SIGKILLed (0: none; the doc's
    runs are killed before their final save, whose 14.6 GB the lent machine's disk cannot spare) and saves."""
    size: str
    steps: int
    log_every: int
    kill: int = 0
    ckpt_every: int = 0


DRY = Shape("tiny", 8, 2, kill=7)


def check(what: str, value: float | None, lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    """One figure against its band ([lo, hi], either side open); pass None when the figure is missing."""
    ok = None if value is None else (lo is None or value >= lo) and (hi is None or value <= hi)
    return {"what": what, "value": value, "band": [lo, hi], "pass": ok}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def records(run: Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    path = run / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def figures(run: Path) -> dict[str, Any]:
    """The doc's figures from RUN/metrics.jsonl: median mfu and tokens_per_s, max peak_mem_gib, over the intervals
    after the first two; and the median seconds a step took (from the records' times)."""
    recs = [r for r in records(run) if "tokens_per_s" in r]
    timed = recs[SKIP:]
    steps = [(b["time"] - a["time"]) / (b["step"] - a["step"]) for a, b in zip(recs, recs[1:], strict=False)]

    def median(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    def top(key: str) -> float | None:
        values = [r[key] for r in timed if r.get(key) is not None]
        return max(values) if values else None

    return {"intervals": len(timed), "mfu": median("mfu"), "tokens_per_s": median("tokens_per_s"),
            "peak_mem_gib": top("peak_mem_gib"), "step_s": statistics.median(steps[SKIP:] or steps)
            if steps else None, "peak_reserved_gib": top("peak_reserved_gib"), "alloc_retries": top("alloc_retries")}


def lm(s: Suite, name: str, shape: Shape, *flags: str, env: dict[str, str] | None = None,
       stderr_to: Path | None = None) -> dict[str, Any]:
    """`python -m trainers trainers.tasks.lm` into WORK/name; dry: the tiny LM, DRY's length, no --compile."""
    if s.dry:
        # Saves every 3 steps, logged every step, killed after 8: the steps after two saves are logged (P4).
        shape = (Shape(DRY.size, 9, 1, kill=8, ckpt_every=3) if shape.ckpt_every else DRY)
        flags = tuple(f for f in flags if f != "--compile")
        if "--batch-size" in flags:
            i = flags.index("--batch-size")
            flags = (*flags[:i], *flags[i + 2:])
    run = s.work / name
    argv = ["-m", "trainers", "trainers.tasks.lm", "--run-dir", str(run), "--size", shape.size, *flags,
            "--steps", str(shape.steps), "--log-every", str(shape.log_every), "--ckpt-every", str(shape.ckpt_every),
            "--seed", "1"]
    fault = {"HPCJOBS_FAULT_INJECT": f"step@{shape.kill}"} if shape.kill else {}
    got = s.run(argv, env={**fault, **(env or {})}, stderr_to=stderr_to)
    got["ok"] = got["rc"] in ((0, -9, 137) if shape.kill else (0,)) and bool(records(run))
    got["figures"] = figures(run)
    return got


def part_record(runs: dict[str, dict[str, Any]], checks: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    return {"runs": runs, "checks": checks, "ok": all(r.get("ok", r["rc"] == 0) for r in runs.values()), **more}


def p0_environment(s: Suite) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    if shutil.which("nvidia-smi"):
        runs["nvidia-smi"] = s.run(["nvidia-smi", "--query-gpu=name,memory.total,power.limit", "--format=csv"],
                                   python=False)
    runs["sdpa"] = s.found["probe"]["run"]  # the suite's first command: it also named the GPU
    probe = s.found["probe"]["env"]
    kernels = probe.get("kernels", [])
    fast = any("flash" in k.lower() or "cudnn" in k.lower() for k in kernels)
    slow = any(w in k.lower() for k in kernels for w in ("efficient_attention", "cutlassf", "cutlassb", "_math"))
    value = float(fast and not slow) if "kernels" in probe else None  # None: the profiler failed (kernels_error)
    checks = [] if s.dry else [check("flash or cuDNN attention kernels, no efficient/math", value, 1.0)]
    return part_record(runs, checks, **probe)


def p1_gpu_tests(s: Suite) -> dict[str, Any]:
    argv = ["-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py", "-q", "-x"]
    got = s.run([*argv, "--collect-only"] if s.dry else argv)
    text = got["tail"]
    counted = re.findall(r"(\d+) (passed|failed|error|errors|skipped|tests? collected)", text)
    tally = {word.split()[-1]: int(n) for n, word in counted}
    if s.dry:  # collected, not run: the set exists and imports
        return part_record({"pytest": got}, [check("gpu tests collected", tally.get("collected"), 10)], tally=tally)
    return part_record({"pytest": got}, [check("gpu tests passed", tally.get("passed"), 13),
                                         check("gpu tests failed", tally.get("failed", 0), 0, 0)], tally=tally)


def p2_1b(s: Suite) -> dict[str, Any]:
    shape = Shape("1b", 80, 10, kill=61)
    runs = {}
    for strategy in ("ddp", "fsdp"):
        runs[strategy] = lm(s, f"1b-{strategy}", shape, "--strategy", strategy)
        if not s.dry:  # the compiled twin (dry: inductor on a CPU takes minutes; same command otherwise)
            runs[strategy + "c"] = lm(s, f"1b-{strategy}c", shape, "--strategy", strategy, "--compile")
    f = {k: r["figures"] for k, r in runs.items()}
    tok = {k: f[k]["tokens_per_s"] if k in f else None for k in ("ddp", "ddpc", "fsdp", "fsdpc")}
    fsdp_peak = f["fsdp"]["peak_mem_gib"]
    checks = [check("DDP eager MFU", f["ddp"]["mfu"], 0.36, 0.44),
              check("DDP eager tokens/s", tok["ddp"], 42e3, 51e3),
              check("DDP compiled / eager", ratio(tok["ddpc"], tok["ddp"]), 1.08),
              check("FSDP eager / DDP eager", ratio(tok["fsdp"], tok["ddp"]), 0.95, 1.08),
              check("FSDP compiled / FSDP eager", ratio(tok["fsdpc"], tok["fsdp"]), 1.05),
              check("DDP peak_mem_gib", f["ddp"]["peak_mem_gib"], 46, 53),
              check("FSDP peak_mem_gib", fsdp_peak, 42, 49),
              check("FSDP activations (peak - 18.1 GiB state), 25.5 +-15%",
                    None if fsdp_peak is None else fsdp_peak - STATE_1B_GIB, 25.5 * 0.85, 25.5 * 1.15)]
    return part_record(runs, checks)


def p3_full_ac(s: Suite) -> dict[str, Any]:
    run = lm(s, "1b-ac", Shape("1b", 40, 10, kill=31), "--strategy", "fsdp", "--activation-checkpointing")
    eager = s.found.get("P2", {}).get("runs", {}).get("fsdp", {}).get("figures", {}).get("tokens_per_s")
    return part_record({"ac": run}, [check("peak_mem_gib", run["figures"]["peak_mem_gib"], 21, 26),
                                     check("tokens/s / P2 FSDP eager", ratio(run["figures"]["tokens_per_s"], eager),
                                           0.72, 0.80)])


def save_blocks(run: Path, every: int) -> dict[str, Any]:
    """Seconds each save held training: the step after it took (record k+1's time − record k's, logged every
    step) less the median step. Saves are at multiples of `every`."""
    recs = {r["step"]: r["time"] for r in records(run) if "loss" in r}
    deltas = {k: recs[k + 1] - recs[k] for k in recs if k + 1 in recs}
    plain = statistics.median([d for k, d in deltas.items() if k % every]) if deltas else 0.0
    blocks = [round(d - plain, 3) for k, d in sorted(deltas.items()) if k % every == 0]
    committed = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    saves = records(run, "saves.jsonl")
    return {"blocks_s": blocks, "step_s": plain, "committed": committed,
            "waited_s": [s.get("waited_s", 0.0) for s in saves]}  # of each block, the wait for the save before


def p4_async_save(s: Suite) -> dict[str, Any]:
    # Saves 60 steps apart, not the doc's 20: on an H200 a 1b save took ~13 s to write and 20 steps 5.6 s, so the
    # second save waited ~8 s for the first (9.6 s blocked, 2026-11-26) and measured the disk, not the D2H copy.
    # The kill comes three steps after the second save (the record of the step after it must be written), while
    # its write (14.6 GB) is still in flight.
    shape = Shape("1b", 130, 1, kill=123, ckpt_every=60)
    every = 3 if s.dry else shape.ckpt_every
    runs, found = {}, {}
    for name, flags in (("async", ()), ("sync", ("--no-async-save",))):
        runs[name] = lm(s, f"1b-ck-{name}", shape, "--strategy", "fsdp", *flags)
        found[name] = save_blocks(s.work / f"1b-ck-{name}", every)
        shutil.rmtree(s.work / f"1b-ck-{name}", ignore_errors=True)  # 14.6 GB each: the disk is 64 GiB
    blocks = found["async"]["blocks_s"]
    checks = [check("first async save blocks (s)", blocks[0] if blocks else None, None, 10),
              check("second async save blocks (s)", blocks[1] if len(blocks) > 1 else None, None, 1.5),
              check("committed step-* (async)", len(found["async"]["committed"]), 1)]
    return part_record(runs, checks, saves=found)


def p5_compile_fsdp(s: Suite) -> dict[str, Any]:
    shape = Shape("large", 60, 10, kill=41)
    log = s.work / "compile.log"
    runs = {"compiled": lm(s, "lg-fc", shape, "--batch-size", "32", "--strategy", "fsdp", "--compile",
                           env={"TORCH_LOGS": "graph_breaks,recompiles"}, stderr_to=log)}
    if not s.dry:
        runs["eager"] = lm(s, "lg-fe", shape, "--batch-size", "32", "--strategy", "fsdp")
    text = log.read_text(errors="replace") if log.exists() else ""
    breaks = [line for line in text.splitlines() if "graph break" in line.lower()]
    limit = sum(text.count(w) for w in ("recompile_limit", "cache_size_limit"))
    checks = [check("FSDP eager MFU (large, b=32)", runs.get("eager", {}).get("figures", {}).get("mfu"), 0.25, 0.27),
              check("FSDP compiled MFU", runs["compiled"]["figures"]["mfu"], 0.30),
              check("recompile/cache size limit hits", limit, 0, 0)]
    return part_record(runs, checks, graph_breaks=len(breaks), first_breaks=breaks[:8])


def p6_7b(s: Suite) -> dict[str, Any]:
    run = lm(s, "7b", Shape("7b", 30, 4, kill=21), "--strategy", "fsdp", "--activation-checkpointing",
             "--batch-size", "4")
    return part_record({"7b": run}, [check("peak_mem_gib", run["figures"]["peak_mem_gib"], 99, 106),
                                     check("MFU", run["figures"]["mfu"], 0.33, 0.40)])


def p7_offload(s: Suite) -> dict[str, Any]:
    run = lm(s, "1b-off", Shape("1b", 20, 4, kill=13), "--strategy", "fsdp", "--cpu-offload")
    if s.dry:  # a CPU rank refuses --cpu-offload in one line: the flag and its check are what can rot here
        run["ok"] = run["rc"] == 2 and "--cpu-offload on a rank without a GPU" in run["tail"]
    return part_record({"offload": run}, [check("peak_mem_gib", run["figures"]["peak_mem_gib"], 26, 30)],
                       step_s=run["figures"]["step_s"])


def p8_ddp_regression(s: Suite) -> dict[str, Any]:
    script = str(Path(__file__).with_name("gpu.py"))
    if s.dry:  # bench/gpu.py needs CUDA: its command line is what can rot here
        return part_record({"gpu.py": s.run([script, "--help"])}, [])
    out = s.work / "gpu-ddp.json"
    got = s.run([script, "--parts", "throughput,compile", "--out", str(out)])
    res = json.loads(out.read_text()) if out.exists() else {}

    def bf16(part: str) -> float | None:
        return next((r["trainer"]["tokens_per_s"] for r in res.get(part, []) if r["precision"] == "bf16"), None)

    return part_record({"gpu.py": got}, [check("bf16 eager tokens/s (large, b=32)", bf16("throughput"), 435e3, 481e3),
                                         check("bf16 compiled tokens/s", bf16("compile"), 556e3, 614e3)],
                       results=res)


@dataclass(frozen=True)
class Part:
    prio: str
    what: str
    minutes: float  # the estimate on an H100, model build and compile included (recalibrated: see PARTS)
    run: Callable[[Suite], dict[str, Any]]
    h200_only: bool = False


PARTS = (  # minutes: the H200 run of 2026-11-26 (bench/results/gpu-h200-acceptance.json) with ~1.5x for an H100
    Part("P0", "environment + attention kernel", 0.5, p0_environment),  # 12 s
    Part("P1", "the GPU tests (pytest -m gpu tests/test_gpu.py)", 6, p1_gpu_tests),  # 259 s
    Part("P2", "1b throughput and memory: DDP/FSDP, eager/compiled", 6, p2_1b),  # not timed whole there
    Part("P3", "full activation checkpointing at 1b", 1, p3_full_ac),  # 33 s
    Part("P4", "asynchronous vs foreground checkpoint cost at 1b", 3.5, p4_async_save),  # 132 s
    Part("P5", "compile under FSDP (large, b=32): graph breaks, MFU", 4, p5_compile_fsdp),  # never run
    Part("P6", "7b on one H200 (fsdp + AC, b=4)", 2.5, p6_7b, h200_only=True),  # 98 s
    Part("P7", "--cpu-offload at 1b", 1.5, p7_offload),  # 44 s
    Part("P8", "the DDP numbers of bench/gpu.py (regression)", 10, p8_ddp_regression),  # never run
)
