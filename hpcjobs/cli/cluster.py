"""The commands about the cluster a job would run on: `doctor` (the request checked against it before it queues)
and `profiles` (the cluster profiles, listed or one shown resolved)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hpcjobs.cli import present
from hpcjobs.cli.job import checked_spec, refuse_array_patterns, tasks_args
from hpcjobs.cli.parser import DOCTOR_ENTRY, Parser, command_parser, job_flags, option_strings, whole_number
from hpcjobs.protocol.errors import UsageError

if TYPE_CHECKING:
    from hpcjobs.cli.parser import Subparsers


def add_doctor(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "doctor", "Check the exact request against the cluster before it queues (one row per "
                       "check).", parents=[job_flags(entry_optional=True)])
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--probe", action="store_true", help="also run a one-node, two-minute job that runs the setup and "
                   "checks the node side: torch and the entry import, the entry's flags as a rank reads them, "
                   "GPUs, interfaces, the runs folder")
    p.add_argument("--probe-wait", type=whole_number, default=300, metavar="SECONDS",
                   help="how long --probe waits for its job to start and end (default 300; then it is cancelled)")
    p.set_defaults(run=run_doctor, own_flags=option_strings(p))


def run_doctor(ns: argparse.Namespace) -> int:
    from hpcjobs.request.checks import exit_code

    if ns.probe and not 10 <= ns.probe_wait <= 86400:
        raise UsageError(f"--probe-wait {ns.probe_wait}: valid: 10 to 86400 seconds.", "e.g. --probe-wait 600")
    named = ns.entry is not None  # none: the request alone is checked, with a stand-in entry (DOCTOR_ENTRY)
    ns.entry = ns.entry or DOCTOR_ENTRY
    # as submit builds it, but checked against the working tree: nothing copied
    spec, backend = checked_spec(ns, snapshot=False)
    refuse_array_patterns(spec, "doctor")
    checks = backend.doctor(spec, ns.probe_wait if ns.probe else None)
    from hpcjobs.request.credentials import doctor_checks
    from hpcjobs.request.rundir import snapshot_root

    checks += doctor_checks(spec.secrets, snapshot_root(spec.run_dir))
    if ns.model:  # the user's Hugging Face model (hpcjobs.request.hf_plan)
        from hpcjobs.request.hf_plan import model_doctor_check

        checks.append(model_doctor_check(spec.profile, ns.model, (tasks_args(spec) or [spec.entry.args])[0],
                                         spec.ranks))
    elif spec.entry.kind == "task" and named:  # a memory plan for a task the user never named would mislead
        from hpcjobs.request.gpu_fit import doctor_check

        checks.append(doctor_check(spec.profile, spec.entry.target, tasks_args(spec), spec.ranks))
    present.doctor(spec, checks, ns.json)
    return exit_code(checks)


def add_profiles(sub: Subparsers, common: Parser) -> None:
    p = command_parser(sub, "profiles", "List cluster profiles, or show one resolved.")
    p.add_argument("action", nargs="?", choices=["list", "show"], default="list")
    p.add_argument("name", nargs="?", help="with show: the profile name or path")
    p.set_defaults(run=run_profiles)


def run_profiles(ns: argparse.Namespace) -> int:
    from hpcjobs.profiles.cluster_profile import available_profiles, load_profile, profile_as_dict

    if ns.action == "show":
        if not ns.name:
            raise UsageError("profiles show needs a NAME.", "e.g. hpcjobs profiles show local")
        present.yaml_text(profile_as_dict(load_profile(ns.name)))
        return 0
    rows = [(name, origin, str(path)) for name, origin, path in available_profiles()]
    present.table(["profile", "from", "path"], rows)
    return 0
