"""The `hpcjobs` command: the parser of every subcommand, and main, the one error boundary.

One room per kind of command, each an add/run pair per subcommand: submit.py (submit, render), status.py (status,
list, logs, cancel), cluster.py (doctor, profiles), runs.py (compare, goodput, export); parser.py holds the grammar
they share, job.py the job their flags describe, present.py everything they print. Nothing heavy is imported until
a command runs (a login node starts this often; torch is never imported here).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from hpcjobs import __version__
from hpcjobs.cli.chain import asks_chain, run_chain
from hpcjobs.cli.cluster import add_doctor, add_profiles
from hpcjobs.cli.parser import EXAMPLES, Parser, job_flags, refuse_own_flags_after_entry, unrecognized
from hpcjobs.cli.plan import add_plan
from hpcjobs.cli.runs import add_compare, add_export, add_goodput
from hpcjobs.cli.status import add_cancel, add_list, add_logs, add_status
from hpcjobs.cli.submit import add_render, add_submit
from hpcjobs.protocol.errors import HpcjobsError

if TYPE_CHECKING:
    from hpcjobs.cli.parser import Subparsers

COMMANDS: list[Callable[[Subparsers, Parser], None]] = [
    add_submit, add_render, add_doctor, add_profiles, add_status, add_list, add_logs, add_cancel, add_compare,
    add_goodput, add_export, add_plan]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="hpcjobs", description="Take a PyTorch training job from this machine to a multi-node Slurm "
               "cluster; survive preemption; resume exactly.", epilog=EXAMPLES["submit"],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"hpcjobs {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    common = job_flags()
    for add in COMMANDS:
        add(sub, common)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_chain(argv):  # `submit --chain FILE`: no profile or entry of its own (hpcjobs/cli/chain.py)
        return guarded("submit", lambda: run_chain(argv, build_parser))
    parser = build_parser()
    ns, extras = parser.parse_known_args(argv)
    if extras:
        unrecognized(parser, ns, extras)
    if not getattr(ns, "run", None):
        parser.print_help()
        return 2

    def run() -> int:
        if getattr(ns, "own_flags", None):
            refuse_own_flags_after_entry(argv, ns)
        return int(ns.run(ns))

    return guarded(ns.command, run)


def guarded(command: str, run: Callable[[], int]) -> int:
    """The one error boundary: an hpcjobs error as one line and its exit code, Ctrl-C as 130, a reader of stdout
    that left as a quiet SIGPIPE exit."""
    try:
        code = run()
        sys.stdout.flush()  # here, not at exit: a reader that left (`| head -1`) is then caught below
        return code
    except HpcjobsError as e:
        print(f"hpcjobs {command}: error: {e.one_line()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader of stdout is gone: stop quietly, as a command killed by SIGPIPE does. stdout goes to
        # /dev/null so the interpreter's own flush at exit has nothing left to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
