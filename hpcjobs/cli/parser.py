"""The command line's grammar: the argparse parser that speaks in one line, the flags every job command shares, the
argument types, each subcommand's examples, and the rule that keeps an hpcjobs flag from going to the entry.

argparse, deliberately: it is in the standard library (nothing to import on a login node but what we use), it passes
an entry's own arguments through untouched (REMAINDER), and its help is easy to extend with examples.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.settings.helpflags import HELP_FLAGS

if TYPE_CHECKING:
    from typing import TypeAlias

    from hpcjobs.protocol.states import JobState

EXAMPLES = {
    "submit": """examples:
  hpcjobs submit --profile mycluster --nodes 2 --gpus 8 --time 4:00:00 trainers.tasks.lm --size small --steps 5000
  hpcjobs submit --profile mycluster --nodes 2 --gpus 8 train.py --config configs/x.yaml   # your own script
  hpcjobs submit --profile mycluster -m mypkg.train --lr 3e-4                               # python -m style
  hpcjobs submit --profile local --gpus 2 trainers.tasks.lm --steps 50                     # this machine
  hpcjobs submit --profile mycluster --nodes 2 --gpus 8 --dry-run trainers.tasks.lm        # show, submit nothing
  hpcjobs submit --profile mycluster --sweep lr=1e-3,3e-4 --sweep seed=1,2,3 --max-parallel 2 trainers.tasks.lm
                                                          # a 6-point grid: one array task (and run folder) each
  hpcjobs submit --profile mycluster --after 1234 -m mypkg.evaluate     # starts once job 1234 COMPLETED
  hpcjobs submit --chain chain.yaml                         # train -> eval -> export, queued at once""",
    "doctor": """examples:
  hpcjobs doctor --profile mycluster --nodes 2 --gpus 8 --time 4:00:00    # ✓/✗ per check, exit 0 if none failed
  hpcjobs doctor --profile mycluster --nodes 2 --gpus 8 --json trainers.tasks.lm --size small""",
    "plan": """examples:
  hpcjobs plan --model config.json --profile mycluster --nodes 2 --gpus 8 --strategy fsdp --activation-checkpointing
  hpcjobs plan --model config.json --profile mycluster --batch-size 4 --seq-len 4096 --json""",
    "render": """examples:
  hpcjobs render --profile mycluster --nodes 2 --gpus 8 -o train.sbatch trainers.tasks.lm --size small
  sbatch train.sbatch""",
    "profiles": """examples:
  hpcjobs profiles              # names, where each came from
  hpcjobs profiles show local   # the resolved profile with every key""",
    "status": "examples:\n  hpcjobs status 1234\n  hpcjobs status 1234 --json\n"
              "  hpcjobs status 1240      # a sweep: one row per task\n  hpcjobs status 1240_3    # one task",
    "list": "examples:\n  hpcjobs list\n  hpcjobs list --state RUNNING --profile mycluster --json",
    "logs": "examples:\n  hpcjobs logs 1234                 # rank 0, latest restart\n"
            "  hpcjobs logs 1234 --rank 5 --restart 0\n  hpcjobs logs 1234 --follow",
    "export": "examples:\n  hpcjobs export 4242 -o model.safetensors\n  hpcjobs export runs/lm-x --step 2000 -o m.pt",
    "cancel": "examples:\n  hpcjobs cancel 1234 1235\n  hpcjobs cancel 1240     # every task of a sweep",
    "goodput": "examples:\n  hpcjobs goodput 1234\n  hpcjobs goodput 1240 --json   # a sweep: each task and the total\n"
               "  hpcjobs goodput runs/lm-x     # every job that ran in a run folder",
    "compare": """examples:
  hpcjobs compare RUN_OR_ID... [--plot loss.png] [--json]
  hpcjobs compare 1234 --plot loss.png          # every task of sweep (job array) 1234, and their loss curves
  hpcjobs compare runs/lm-a runs/lm-b --json    # run folders, as JSON rows""",
}

DOCTOR_ENTRY = "trainers.tasks.lm"
"""What doctor checks the request with when no entry is given (it must exist, like any entry); the entry's own
checks (its memory plan) are then left out: it is not the user's."""


class Parser(argparse.ArgumentParser):
    """Usage errors as one line with a hint, exit code 2; long options only as typed in full (a prefix of one of
    ours must never swallow a flag meant for the entry)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # argparse's own arguments, passed through
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self.typed = list(args or ())  # what error() compares a missing flag with (a subcommand's own words)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # argparse quotes unrecognized arguments as typed, newlines and all
        message += self.did_you_mean(message)
        stop = "" if message.endswith(("?", ".")) else "."
        self.exit(2, f"{self.prog}: error: {message}{stop} HINT: {self.prog} --help shows the flags and examples.\n")

    def did_you_mean(self, message: str) -> str:
        """`--profil local` said only that --profile is required: a typed word close to a missing flag is named."""
        import difflib

        missing = [w.strip(",") for w in message.split() if w.startswith("--")] if "are required" in message else []
        known = {o for a in self._actions for o in a.option_strings}
        typed = [w.split("=", 1)[0] for w in getattr(self, "typed", []) if w.startswith("--")]
        close = [(w, m[0]) for w in typed if w not in known and (m := difflib.get_close_matches(w, missing, n=1))]
        return "; " + ", ".join(f"{w} is no flag: did you mean {m}?" for w, m in close) if close else ""


if TYPE_CHECKING:
    Subparsers: TypeAlias = argparse._SubParsersAction[Parser]
    """Where each subcommand adds its parser (`add_subparsers`' action, making Parsers)."""


def command_parser(sub: Subparsers, name: str, help_: str,
                   parents: Sequence[Parser] = ()) -> Parser:
    """A subcommand's parser: its help as the description, its examples as the epilog."""
    return sub.add_parser(name, help=help_, description=help_, epilog=EXAMPLES.get(name),
                          formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents))


def whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


SQLITE_MAX = 2**63 - 1
"""The largest integer the job store's sqlite takes (a larger --limit overflowed it)."""


def limit(text: str) -> int:
    count = whole_number(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"{count}: valid: 1 or more")
    return min(count, SQLITE_MAX)  # more than sqlite counts is all of them


def job_state(text: str) -> JobState:
    from hpcjobs.protocol.states import JobState

    state = JobState.parse(text)
    if state is JobState.UNKNOWN and text.strip().upper() != "UNKNOWN":
        raise argparse.ArgumentTypeError(f"{text!r} is not a job state; valid: {', '.join(s.value for s in JobState)}")
    return state


def job_flags(entry_optional: bool = False) -> Parser:
    """The flags of a job request (submit, render, doctor), then the entry and its arguments."""
    p = Parser(add_help=False)
    p.add_argument("--profile", required=True, help="cluster profile: a name (`hpcjobs profiles`) or a .yaml path")
    p.add_argument("--nodes", type=whole_number, default=1, help="nodes (default 1)")
    p.add_argument("--gpus", type=whole_number, default=None,
                   help="GPUs per node, one rank per GPU (like torchrun's --nproc_per_node); ranks = nodes × gpus. "
                        "Default: all of a node's GPUs per the profile")
    p.add_argument("--time", help="time limit in Slurm notation, e.g. 4:00:00 or 1-00:00:00 (default: profile's)")
    p.add_argument("--name", help="job name (default: from the entry)")
    p.add_argument("--partition", help="override the profile's partition")
    p.add_argument("--account", help="override the profile's account")
    p.add_argument("--qos", help="override the profile's qos")
    p.add_argument("--run-dir", help="run folder (checkpoints, metrics, logs); an existing one is resumed")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE|NAME",
                   help="extra environment (repeat); NAME alone passes this shell's NAME to every rank without "
                        "writing its value anywhere (for keys and tokens: docs/how-to/secrets.md)")
    p.add_argument("--allow-secret-values", action="store_true",
                   help="accept an --env or profile env: value that looks like a key or token: it is then written "
                        "in plain text to the run folder, the job store and the job script")
    p.add_argument("-m", "--module", action="store_true", help="ENTRY is a module run like `python -m ENTRY`")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="sweep a flag of the entry (repeat: the grid of all): one Slurm array task per point, each "
                        "with its own run folder, the point passed as --KEY VALUE")
    p.add_argument("--sweep-file", metavar="YAML", help="the sweep's points from a file: `grid:` (a mapping of "
                   "lists) and/or `points:` (a list of mappings)")
    p.add_argument("--max-parallel", type=whole_number, metavar="K", help="a sweep's most tasks running at once")
    p.add_argument("--after", action="append", default=[], metavar="ID[:ok|any|notok]",
                   help="start once job ID ended: COMPLETED (ok, the default), in any way (any), or badly (notok); "
                        "repeat to wait for several. A requeue is not an end: the wait goes on through it")
    p.add_argument("--max-recoveries", type=whole_number, metavar="N",
                   help="recoveries in a row without a new checkpoint before the job ends failed: a rank killed, a "
                        "hang, a lost peer or a failed node restarts the ranks from the newest checkpoint by itself "
                        "(default: the profile's recovery.max_recoveries; 0: never)")
    p.add_argument("--spare-nodes", type=whole_number, metavar="K",
                   help="hold K more nodes that stand in for a node that fails, so the job recovers without a "
                        "requeue (default: the profile's recovery.spare_nodes)")
    p.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                   help="run from the working tree instead of a copy of the project's code taken at submission "
                        "(the copy is what every restart runs, whatever is edited after)")
    p.add_argument("--container", metavar="IMAGE", help="run every rank in this image (the profile's container "
                   "runtime: pyxis, apptainer, charliecloud, oci) instead of its container.image")
    p.add_argument("--model", metavar="CONFIG_JSON", help="a Hugging Face model's config.json: --dry-run (and its "
                   "--json) and doctor show its memory plan per GPU, as `hpcjobs plan --model` does, and submit warns "
                   "when its stop checkpoint cannot commit within the preemption warning (after the entry, --model "
                   "is the entry's)")
    p.add_argument("entry", metavar="ENTRY", nargs="?" if entry_optional else None, default=None,
                   help="a task module (trainers.tasks.lm, pkg.mod:make_task), a .py script, or with -m a module"
                        + (f" (default: {DOCTOR_ENTRY}, to check the request alone)" if entry_optional else ""))
    rest = p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the entry unchanged")
    rest.required = False  # argparse counts a REMAINDER as required: a missing entry said "required: ENTRY, ARGS"
    return p


SHARED_WITH_ENTRIES = ("--model",)
"""Our flags that a script's own flags often share: typed after the entry they are the entry's, not refused."""


def option_strings(p: argparse.ArgumentParser) -> frozenset[str]:
    """A subcommand's own flags, less -h/--help (after the entry, a request for the entry's help)."""
    return frozenset(o for a in p._actions for o in a.option_strings) - set(HELP_FLAGS) - set(SHARED_WITH_ENTRIES)


def entry_args_as_typed(argv: Sequence[str], entry: str, args: Sequence[str]) -> tuple[list[str], bool]:
    """The entry's arguments as the user typed them, and whether a `--` set them apart (argparse drops a `--`
    right after the entry, so only the raw argv tells)."""
    for i in range(len(argv) - 1, -1, -1):
        if argv[i] != entry:
            continue
        tail = list(argv[i + 1:])
        if tail == list(args):
            return tail, i > 0 and argv[i - 1] == "--"
        if tail[:1] == ["--"] and tail[1:] == list(args):
            return tail[1:], True
    return list(args), True  # cannot tell where the entry was typed: never refuse then


def refuse_own_flags_after_entry(argv: Sequence[str], ns: argparse.Namespace) -> None:
    """`hpcjobs submit ... ENTRY --steps 40 --dry-run` must not submit: an hpcjobs flag typed after the entry would
    silently go to the entry. Everything after a `--` is the entry's, so `ENTRY -- --name x` passes `--name x`."""
    args, separated = entry_args_as_typed(argv, ns.entry, ns.args)
    if separated:
        return
    for word in args[:args.index("--")] if "--" in args else args:
        flag = word.split("=", 1)[0] if word.startswith("--") else word
        if flag in ns.own_flags:
            raise UsageError(
                f"{word!r} comes after the entry {ns.entry}, so it would go to the entry, but it is an hpcjobs "
                f"{ns.command} flag; nothing was submitted.",
                f"move it before the entry (hpcjobs {ns.command} {flag} ... {ns.entry} ...), or pass it to the "
                f"entry on purpose after a `--` ({ns.entry} -- {word}).")


def unrecognized(parser: argparse.ArgumentParser, ns: argparse.Namespace, extras: list[str]) -> NoReturn:
    """Arguments no parser took, refused by the subcommand's parser (its name and help in the line) with the
    nearest of its flags: `--gpu 2` means --gpus."""
    import difflib

    subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    p: argparse.ArgumentParser = subs.choices.get(ns.command, parser) if subs is not None and ns.command else parser
    known = sorted(option_strings(p))
    close = [m for w in extras if w.startswith("--")
             for m in difflib.get_close_matches(w.split("=", 1)[0], known, n=1)]
    p.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {', '.join(close)}?" if close else ""))
