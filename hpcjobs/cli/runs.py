"""The commands that read what runs left behind: `compare` (runs side by side), `goodput` (where a job's time
went) and `export` (one file of a run's weights)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hpcjobs.cli import present
from hpcjobs.cli.parser import Parser, command_parser, whole_number
from hpcjobs.cli.status import one_record
from hpcjobs.protocol.errors import UsageError

if TYPE_CHECKING:
    from hpcjobs.cli.parser import Subparsers
    from hpcjobs.jobs.store import JobRecord, JobStore


def add_compare(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "compare", "Runs side by side (a sweep's points): state, steps, restarts, last and best "
                       "loss; --plot draws their loss curves.")
    p.add_argument("runs", nargs="+", metavar="RUN_OR_ID",
                   help="a run folder, or a job id (a sweep's array id stands for all its tasks)")
    p.add_argument("--plot", metavar="FILE", help="also draw the loss curves into FILE (.png, .pdf or .svg; needs "
                   "matplotlib: pip install matplotlib)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --plot file")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(run=run_compare)


def compare_targets(args: Sequence[str], store: JobStore) -> list[str | JobRecord]:
    """Each argument as a run folder (an existing directory, or anything path-like, which compare then checks) or
    the job records of a job id. Every argument is resolved before anything is read: one typo fails at once."""
    targets: list[str | JobRecord] = []
    for arg in args:
        if Path(arg).is_dir() or "/" in arg or Path(arg).exists():
            targets.append(arg)
            continue
        try:
            from hpcjobs.follow.status import records_for

            targets += records_for(arg, store)
        except UsageError as e:
            raise UsageError(f"{arg!r} is neither a folder here nor a job hpcjobs knows ({e.message.rstrip('.')}).",
                             "give run folders (RUN/ holds spec.json and metrics.jsonl) or job ids from "
                             "`hpcjobs list`.") from None
    return targets


def run_compare(ns: argparse.Namespace) -> int:
    from hpcjobs.goodput import compare, plot
    from hpcjobs.jobs.store import JobStore

    if ns.plot:
        plot.plot_format(ns.plot, ns.force)
        plot.require_matplotlib()
    store = JobStore()
    rows = compare.rows_for(compare_targets(ns.runs, store), store)
    if ns.plot:
        present.plotted(plot.plot(rows, ns.plot, ns.force), len(rows))
    present.compared(rows, ns.json)
    return 0


def add_goodput(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "goodput", "Where a job's wall time and GPU-hours went (queue, start-up, productive "
                       "training, checkpoints, rework, requeue hold, recovery) and its ETTR, with advice.")
    p.add_argument("target", metavar="ID|RUN_FOLDER", help="a job id (a sweep's array id: every task) or a run folder")
    p.add_argument("--json", action="store_true", help="print the buckets as JSON")
    p.add_argument("--plot", metavar="FILE", help="also draw the job's timeline into FILE (.png, .pdf or .svg): a bar "
                   "per start split into start-up, training, saves and rework, how each ended marked (needs "
                   "matplotlib)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --plot file")
    p.set_defaults(run=run_goodput)


def run_goodput(ns: argparse.Namespace) -> int:
    from hpcjobs.goodput import plot
    from hpcjobs.goodput.report import run, timeline

    fmt = plot.plot_format(ns.plot, ns.force) if ns.plot else ""  # before any reading: a wrong name costs nothing
    if ns.plot:
        plot.require_matplotlib()
    code = run(ns.target, ns.json)
    if ns.plot:
        import sys
        from pathlib import Path

        wrote = plot.save_atomic(timeline(ns.target), Path(ns.plot), fmt)
        print(f"wrote {wrote}", file=sys.stderr if ns.json else sys.stdout)
    return code


def add_export(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "export", "One file of a run's model weights from its newest (or --step) finished "
                       "checkpoint; offline, no GPU.")
    p.add_argument("target", metavar="RUN_OR_ID", help="a run folder, or a job id (an array task: ID_N)")
    p.add_argument("--step", type=whole_number, help="the checkpoint of this step (default: the newest finished one)")
    p.add_argument("-o", "--output", required=True, help="the file: .pt/.pth (torch.save) or .safetensors")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.set_defaults(run=run_export)


def run_export(ns: argparse.Namespace) -> int:
    """The reading is the node side's (trainers.export, which imports torch): run there, in this Python."""
    import subprocess

    run_dir = ns.target if Path(ns.target).is_dir() else one_record(ns.target, "export").run_dir
    # "--output=" and "--": an -o or RUN that starts with "-" stays a value there, as it was here
    argv = [f"--output={ns.output}", *(["--step", str(ns.step)] if ns.step is not None else []),
            *(["--force"] if ns.force else []), "--", run_dir]
    return subprocess.run([sys.executable, "-m", "trainers.export", *argv]).returncode
