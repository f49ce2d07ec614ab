"""`python -m trainers TASK [--run-dir DIR] [trainer flags] [task flags]`: the shared trainer without hpcjobs submit,
e.g. under torchrun:  torchrun --nproc_per_node 8 -m trainers trainers.tasks.lm --size small --steps 1000

Without --run-dir the run folder is runs/<task's last name>; the preemption settings are hpcjobs.contract's defaults
(no profile, no known time limit).
"""

from __future__ import annotations

import sys

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    run_dir, rest = split_run_dir(argv[0], argv[1:])
    return launch(["--run-dir", run_dir, "--kind", "task", "--", argv[0], *rest])


if __name__ == "__main__":
    raise SystemExit(main())
