"""`python -m trainers TASK [--run-dir DIR] [trainer flags] [task flags]`: the shared trainer without hpcjobs submit,
e.g. under torchrun:  torchrun --nproc_per_node 8 -m trainers trainers.tasks.lm --size small --steps 1000

`python -m trainers help TASK` (or TASK --help) lists the trainer's flags and the task's own, and touches nothing.
`python -m trainers check TASK [FLAGS...]` says whether a rank would start with those flags (exit 0) or the line it
would refuse them with (exit 2), and touches nothing.

Without --run-dir the run folder is runs/<task's last name>; the preemption settings are
hpcjobs.protocol.contract's defaults (no profile, no known time limit).
"""

from __future__ import annotations

import sys

from hpcjobs.protocol.settings.helpflags import asks_help
from trainers.launch import main as launch

RUN_DIR = "--run-dir"


def split_run_dir(task: str, rest: list[str]) -> tuple[str, list[str]]:
    """(the run folder, the other arguments): `--run-dir DIR` or `--run-dir=DIR`, matched exactly, anywhere."""
    run_dir = f"runs/{task.split(':')[0].rsplit('.', 1)[-1]}"
    others: list[str] = []
    words = iter(rest)
    for word in words:
        if word == RUN_DIR:
            run_dir = next(words, "")  # an empty one is refused by the launcher, with what is valid
        elif word.startswith(RUN_DIR + "="):
            run_dir = word.partition("=")[2]
        else:
            others.append(word)
    return run_dir, others


def show_help(task: str) -> int:
    """No launcher: no run folder, no log, no process group (the submit side calls this for `ENTRY --help`)."""
    from trainers.run import task_help  # imports torch

    return task_help(task)


def check(task: str, args: list[str]) -> int:
    """Whether a rank would start `task` with `args` (exit 0), or the one line it would refuse them with (exit 2);
    read as `python -m trainers TASK ARGS` reads them (a --run-dir is the launcher's, --help shows the flags)."""
    _, args = split_run_dir(task, args)
    if asks_help(args):
        return show_help(task)
    from trainers.run import check_task  # imports torch

    refused = check_task(task, args)
    if refused is not None:
        print(f"hpcjobs: {refused}", file=sys.stderr)
        return 2
    print(f"{task} accepts {' '.join(args) if args else 'its defaults'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "check":
        if len(argv) < 2 or argv[1].startswith("-"):
            print("usage: python -m trainers check TASK [FLAGS...]   (e.g. python -m trainers check "
                  "trainers.tasks.lm --size small --steps 100)", file=sys.stderr)
            return 2
        return check(argv[1], argv[2:])
    if argv[0] == "help":
        if len(argv) != 2 or argv[1].startswith("-"):
            print("usage: python -m trainers help TASK   (e.g. python -m trainers help trainers.tasks.lm)",
                  file=sys.stderr)
            return 2
        return show_help(argv[1])
    run_dir, rest = split_run_dir(argv[0], argv[1:])
    if asks_help(rest):
        return show_help(argv[0])
    return launch(["--run-dir", run_dir, "--kind", "task", "--", argv[0], *rest])


if __name__ == "__main__":
    raise SystemExit(main())
