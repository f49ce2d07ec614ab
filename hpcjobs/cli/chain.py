"""`hpcjobs submit --chain FILE`: every step of a chain file (hpcjobs.request.chainfile) checked as `submit` checks a
job, then queued upstream first, each with `--after` the job ids of the steps it waits for. On Slurm the whole chain is
queued at once and Slurm starts each step when its upstream ends; on the local profile the steps run one after the
other in the foreground, and a step whose upstream ended the wrong way is not started."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hpcjobs.cli import present
from hpcjobs.cli.parser import Parser
from hpcjobs.protocol.errors import HpcjobsError, UsageError

if TYPE_CHECKING:
    from hpcjobs.backends import Backend
    from hpcjobs.request.chainfile import Step
    from hpcjobs.request.spec import JobSpec


def asks_chain(argv: Sequence[str]) -> bool:
    """`submit --chain FILE ...`: --chain among submit's own flags (before any --profile: after an entry it would be
    the entry's)."""
    if not argv or argv[0] != "submit":
        return False
    for word in argv[1:]:
        if word == "--chain" or word.startswith("--chain="):
            return True
        if word == "--profile" or word.startswith("--profile="):
            return False
    return False


def chain_parser() -> Parser:
    p = Parser(prog="hpcjobs submit", description="Submit every step of a chain file, upstream first.")
    p.add_argument("--chain", required=True, metavar="FILE", help="the chain file (named steps: submit, after)")
    p.add_argument("--dry-run", action="store_true", help="check every step and show the order; submit nothing")
    p.add_argument("--json", action="store_true", help="print the steps' job ids as JSON")
    return p


def run_chain(argv: Sequence[str], parser: Callable[[], argparse.ArgumentParser]) -> int:
    """`parser` makes the whole command line's parser (hpcjobs.cli.build_parser), which reads each step."""
    from hpcjobs.request.chainfile import read_chain

    ns = chain_parser().parse_args(list(argv)[1:])
    steps = read_chain(Path(ns.chain))
    specs = {s.name: step_spec(s, parser()) for s in steps}  # every step checked before the first is queued
    schedulers = {spec.profile.scheduler for spec, _ in specs.values()}
    if len(schedulers) > 1:
        raise UsageError(f"--chain {ns.chain}: steps on {' and '.join(sorted(schedulers))}; valid: every step on one "
                         "scheduler (a job waits only for jobs its scheduler runs)", "give every step one cluster")
    if ns.dry_run:
        rows = [(s.name, specs[s.name][0].entry.target, specs[s.name][0].world(),
                 [f"{up}:{cond}" for up, cond in s.after]) for s in steps]
        present.chain_planned(rows, ns.json)
        return 0
    from hpcjobs.request.credentials import refuse_missing

    for spec, _ in specs.values():
        refuse_missing(spec.secrets)  # before any step is queued: every rank of that step would start without it
    ids = submit_steps(steps, specs, ns.json)
    present.chain_submitted(ids, ns.json)
    return 0 if all(v is not None for v in ids.values()) else 1


def step_spec(step: Step, parser: argparse.ArgumentParser) -> tuple[JobSpec, Backend]:
    """A step's spec, as `hpcjobs submit STEP'S ARGUMENTS` would check it."""
    from hpcjobs.cli.job import checked_spec, refuse_array_patterns
    from hpcjobs.cli.parser import refuse_own_flags_after_entry

    argv = ["submit", *step.argv]
    try:
        ns, extras = parser.parse_known_args(argv)
        if extras:
            raise UsageError(f"unrecognized arguments: {' '.join(extras)}", "hpcjobs submit --help shows the flags")
        refuse_own_flags_after_entry(argv, ns)
        spec, backend = checked_spec(ns)
        refuse_array_patterns(spec, "submit")
    except SystemExit:  # argparse's own refusal (a missing --profile), already printed as one line
        raise UsageError(f"step {step.name!r}: its submit: line is not a submit command line", "see above") from None
    except HpcjobsError as e:
        raise type(e)(f"step {step.name!r}: {e.message}", e.hint) from None
    return spec, backend


def submit_steps(steps: list[Step], specs: dict[str, tuple[JobSpec, Backend]],
                 as_json: bool = False) -> dict[str, str | None]:
    """Queue (or, locally, run) each step upstream first; a step's job id, or None when it was not started. With
    `as_json` a foreground job's own output goes to stderr (stdout is for the record alone)."""
    from hpcjobs.cli.submit import wait_for
    from hpcjobs.request.after import After
    from hpcjobs.submit import submit

    ids: dict[str, str | None] = {}
    for s in steps:
        spec, backend = specs[s.name]
        if any(ids[up] is None for up, _ in s.after):
            ids[s.name] = None
            print(f"hpcjobs: step {s.name} not started: a step it waits for was not", file=sys.stderr)
            continue
        spec = replace(spec, after=tuple(After(str(ids[up]), cond) for up, cond in s.after))
        try:
            if spec.after:
                wait_for(spec, backend.queued)
            request = backend.dry_run(spec)
            if as_json:
                request = replace(request, params={**request.params, "stdout_to_stderr": True})
            sub = submit(request)
        except UsageError as e:  # locally: the upstream ended so that this step must not start
            print(f"hpcjobs: step {s.name} not started: {e.one_line()}", file=sys.stderr)
            ids[s.name] = None
            continue
        except HpcjobsError as e:
            queued = ", ".join(f"{n} ({i})" for n, i in ids.items() if i is not None) or "none"
            raise type(e)(f"step {s.name!r}: {e.message} (queued before it: {queued})",
                          e.hint or "`hpcjobs cancel ID` the queued steps, fix this one and submit again") from None
        ids[s.name] = sub.job_id
        if sub.returncode is not None:
            print(present.ended_line(sub), file=sys.stderr)
    return ids
