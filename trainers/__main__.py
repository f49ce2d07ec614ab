"""`python -m trainers TASK [--run-dir DIR] [trainer flags] [task flags]`: the shared trainer without hpcjobs submit,
e.g. under torchrun:  torchrun --nproc_per_node 8 -m trainers trainers.tasks.lm --size small --steps 1000
"""

from __future__ import annotations

import sys

from trainers.launch import main as launch


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    task, rest = argv[0], argv[1:]
    run_dir = f"runs/{task.split(':')[0].rsplit('.', 1)[-1]}"
    if "--run-dir" in rest:
        i = rest.index("--run-dir")
        run_dir = rest[i + 1]
        del rest[i:i + 2]
    return launch(["--run-dir", run_dir, "--kind", "task", "--", task, *rest])


if __name__ == "__main__":
    raise SystemExit(main())
