"""`hpcjobs submit` and `hpcjobs render`: the job the flags describe, submitted (or shown: --dry-run) or written as
a standalone script."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hpcjobs.cli import present
from hpcjobs.cli.job import checked_spec, entry_help, refuse_array_patterns, tasks_args
from hpcjobs.cli.parser import Parser, command_parser, option_strings
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.settings.helpflags import asks_help

if TYPE_CHECKING:
    from hpcjobs.cli.parser import Subparsers
    from hpcjobs.request.spec import JobSpec


def add_submit(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "submit", "Submit a training job (through submitit on Slurm; in the foreground for "
                       "`local`).", parents=[common])
    p.add_argument("--dry-run", action="store_true", help="print the spec and the script; submit nothing")
    p.add_argument("--json", action="store_true", help="print a machine-readable record")
    p.add_argument("--new", action="store_true",
                   help="start a fresh run folder. Without it (and without --run-dir) the same command (entry, its "
                        "arguments, profile, --nodes, --gpus, --env, --container, from the same folder) continues "
                        "the run folder of its newest job: a stopped or failed run resumes from its newest "
                        "checkpoint; a finished one is refused (exit 2); one still running is refused")
    p.set_defaults(run=run_submit, own_flags=option_strings(p))


def run_submit(ns: argparse.Namespace) -> int:
    said: list[str] = []
    spec, backend = checked_spec(ns, snapshot=not asks_help(ns.args),  # the entry's help runs from the working tree
                                 same_command=same_command(ns, said))
    refuse_array_patterns(spec, "submit")
    helped = entry_help(spec)
    if helped is not None:
        return helped
    request = backend.dry_run(spec)
    model_line = model_plan_line(spec, ns.model) if ns.model else None  # a bad --model: one line, nothing queued
    if ns.dry_run:
        print(*said, sep="\n", file=sys.stderr, flush=True) if said else None
        present.dry_run(spec, request, tasks_args(spec), ns.json,
                        model_record(spec, ns.model) if ns.model and ns.json else None)
        print(model_line) if model_line and not ns.json else None
        warn_short_chunks(spec, backend.queued, "submit", ns.model)
        return 0
    from hpcjobs.request.credentials import refuse_missing
    from hpcjobs.submit import submit

    refuse_missing(spec.secrets)  # every rank would start without it
    backend.check_site(spec)  # a partition the cluster lacks: refused before the snapshot and the run folder
    if spec.after:
        wait_for(spec, backend.queued)
    if ns.json:  # stdout is for the record alone; a foreground job's own output goes to stderr
        request = replace(request, params={**request.params, "stdout_to_stderr": True})
    for line in said:  # once every check passed: a refusal stays the one line said
        print(line, file=sys.stderr, flush=True)
    sub = submit(request)
    present.submitted(spec, sub, ns.json)
    warn_short_chunks(spec, backend.queued, "submit", ns.model)  # once submitted: a refusal above stays the one line
    return sub.returncode or 0


def same_command(ns: argparse.Namespace, said: list[str]) -> Callable[[str, str], str | None]:
    """The run folder the same command continues (hpcjobs.follow.samecommand), its line added to `said`; none with
    --new (a fresh run, which the next same command then continues) or for the entry's --help."""
    if ns.new and ns.run_dir is not None:
        raise UsageError(f"--new with --run-dir {ns.run_dir}: --new asks for a fresh run folder, --run-dir names one; "
                         "valid: one of them.", "leave --run-dir out for a fresh run folder, or --new out to use the "
                         "one --run-dir names.")

    def continued(key: str, kind: str) -> str | None:
        if ns.new or asks_help(ns.args):
            return None
        from hpcjobs.follow.samecommand import continued_run

        found = continued_run(key, kind)
        if found is None:
            return None
        said.append(found.line)
        return found.run_dir

    return continued


def wait_for(spec: JobSpec, queued: bool) -> None:
    """The jobs --after names, checked before anything is queued (hpcjobs.request.after); a foreground (local) job then
    waits here for them to end, as Slurm holds a queued one."""
    import sys

    from hpcjobs.follow.status import job_state
    from hpcjobs.jobs.store import JobStore
    from hpcjobs.request.after import check_upstream, wait_for_upstream

    store = JobStore()
    check_upstream(spec.after, spec.profile.scheduler, lambda job: job_state(job, store))
    if not queued:
        wait_for_upstream(spec.after, lambda job: job_state(job, store),
                          lambda line: print(f"hpcjobs: {line}", file=sys.stderr, flush=True))


def model_plan_line(spec: JobSpec, model: str) -> str:
    """`--model config.json`'s memory line (hpcjobs.request.hf_plan), with the entry's first point's arguments."""
    from hpcjobs.request.hf_plan import model_plan_line

    return model_plan_line(spec.profile, model, (tasks_args(spec) or [spec.entry.args])[0], spec.ranks)


def model_record(spec: JobSpec, model: str) -> dict[str, object]:
    """`--model config.json`'s plan for `--dry-run --json` (hpcjobs.request.hf_plan), the first point's arguments."""
    from hpcjobs.request.hf_plan import model_plan_record

    return model_plan_record(spec.profile, model, (tasks_args(spec) or [spec.entry.args])[0], spec.ranks)


def warn_short_chunks(spec: JobSpec, queued: bool, command: str, model: str | None = None) -> None:
    """One line on stderr when the time limit leaves little of each chunk for training (hpcjobs.request.chunks): a
    queued job requeues at its limit and goes on; a local one does not. Another when the stop checkpoint cannot
    commit within the preemption warning (hpcjobs.request.ckpt_window): of `--model config.json`'s model when one is
    given (hpcjobs.request.hf_plan), else of the bundled LM. Said once the command did its work, so that a refusal
    stays the one line said."""
    import sys

    from hpcjobs.request.chunks import chunk_warning
    from hpcjobs.request.ckpt_window import submit_window_line
    from hpcjobs.request.hf_plan import model_window_line

    args = tasks_args(spec)
    window = (model_window_line(spec.profile, model, (args or [spec.entry.args])[0], spec.ranks) if model else
              submit_window_line(spec.profile, spec.entry.target, args, spec.ranks)) if queued else None
    lines = (chunk_warning(spec), window) if queued else ()
    for line in filter(None, lines):
        print(f"hpcjobs {command}: warning: {line}", file=sys.stderr)


def add_render(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "render", "Write a standalone sbatch script for the same job (for people who run "
                       "sbatch).", parents=[common])
    p.add_argument("-o", "--output", help="write the script here (default: print it)")
    p.add_argument("--force", action="store_true", help="overwrite an existing -o file")
    p.set_defaults(run=run_render, own_flags=option_strings(p))


def run_render(ns: argparse.Namespace) -> int:
    spec, backend = checked_spec(ns, job_id_in_run_dir=True, snapshot=not asks_help(ns.args))
    helped = entry_help(spec)
    if helped is not None:
        return helped
    script = backend.script(spec)
    from hpcjobs.protocol.paths import refuse_output
    from hpcjobs.submit import take_snapshot, write_script

    if ns.output:
        refuse_output(Path(ns.output), ns.force)  # before the snapshot: a refused render copies nothing
    backend.check_site(spec)
    take_snapshot(spec)  # the script runs the code as it is now, however long it waits to be submitted
    if not ns.output:
        print(script.text, end="")
        warn_short_chunks(spec, backend.queued, "render", ns.model)
        return 0
    path = write_script(script, Path(ns.output), ns.force)
    present.rendered(path, spec)
    warn_short_chunks(spec, backend.queued, "render", ns.model)
    return 0
