"""The README's first quickstart command, as typed, in a fresh clone (run by tests/run_all.sh outside the test
cluster's namespaces, which reach no package index): a venv, torch from the local wheel, the project, the job; then
the README's "run it again" command, with the folder the first run made in place of `runs/lm-…`: it resumes.

    python tests/readme_quickstart.py [CLONE_DIR]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


AGAIN_PLACEHOLDER = "runs/lm-…"  # the run folder the first command made


def quickstart_command() -> str:
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    assert block, "README has no Quickstart block"
    return next(line for line in block.group(1).splitlines() if line.startswith("python3 -m venv .venv"))


def again_command() -> str:
    """The README's command that runs the quickstart's job again on its run folder (issue 26, item 9)."""
    quickstart = (REPO / "README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    again = [line for block in re.findall(r"```bash\n(.*?)```", quickstart, re.S) for line in block.splitlines()
             if f"--run-dir {AGAIN_PLACEHOLDER} " in line]
    assert len(again) == 1, "the README's Quickstart has no block with the command that runs the job again"
    return again[0]


def commands() -> list[str]:
    """The commands this script runs as typed (tests/test_docs.py counts them as cases)."""
    return [quickstart_command(), again_command()]


def main() -> int:
    clone = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="hpcjobs-quickstart-"))
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["HPCJOBS_HOME"] = str(clone / ".hpcjobs-home")
    command = quickstart_command()
    print(f"[readme] in a fresh clone ({clone}): {command}", flush=True)
    out = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=1200)
    text = out.stdout + out.stderr
    runs = list((clone / "runs").glob("lm-*"))
    ok = out.returncode == 0 and len(runs) == 1 and (runs[0] / "checkpoints" / "step-300" / "FINISHED").is_file() \
        and "step 300" in text
    print(f"[readme] quickstart {'works as typed' if ok else 'FAILED'} (exit {out.returncode})", flush=True)
    if not ok:
        print(text[-4000:])
        return 1
    command = again_command().replace(AGAIN_PLACEHOLDER, f"runs/{runs[0].name}")
    print(f"[readme] run it again: {command}", flush=True)
    out = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    ok = out.returncode == 0 and "resumed from " in text and "checkpoints/step-300 (step 300," in text
    print(f"[readme] run it again: {'resumes as typed' if ok else 'FAILED'} (exit {out.returncode})", flush=True)
    if not ok:
        print(text[-4000:])
        return 1
    shutil.rmtree(clone, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
