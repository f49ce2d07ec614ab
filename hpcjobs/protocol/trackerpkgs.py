"""Whether a tracker's package is installed, asked without importing it: every rank asks at its start (only rank 0
imports the package), and `hpcjobs submit` asks before queueing, of the Python the ranks will run where it can
(this interpreter, or another one at an absolute path on this machine: a shared filesystem's venv). Torch-free."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence

from hpcjobs.protocol.settings.trainconfig import PIP_NAMES, TRACKERS
from hpcjobs.protocol.settings.trainflags import ConfigError

ASK_TIMEOUT_S = 20.0
"""How long the submit side waits for another Python to say what it has (it starts in ~30 ms; a cold shared
filesystem can take seconds). Past it nothing is said and the ranks check at their start."""


class TrackerUnavailable(ConfigError):
    """A tracker asked for whose package this Python lacks: one line, the pip extra that installs it."""


def require(names: Sequence[str], python: str | None = None) -> None:
    """Raise TrackerUnavailable for the first tracker in `names` whose package `python` (default: this one) lacks.
    Another Python that cannot be asked (not on this machine, or it does not answer) passes: its ranks check."""
    wanted = {name: module for name in names if (module := TRACKERS.get(name)) is not None}
    if not wanted:
        return
    if python is None or _is_this(python):
        missing = {m for m in wanted.values() if not installed(m)}
    else:
        found = _ask(python, sorted(set(wanted.values())))
        if found is None:
            return
        missing = found
    for name, module in wanted.items():
        if module in missing:
            raise unavailable(name, module, python=python or sys.executable)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module object without a spec
        return False


def unavailable(name: str, module: str, why: str = "", python: str | None = None) -> TrackerUnavailable:
    return TrackerUnavailable(f"--tracker {name}: the {module} package is not installed in "
                              f"{python or sys.executable}{why}; valid: --tracker {'|'.join(TRACKERS)} with each "
                              f"one's package installed. HINT: pip install {PIP_NAMES.get(module, module)} into the "
                              f"environment the ranks run in (hpcjobs's {name} extra), or drop {name} from --tracker")


def _is_this(python: str) -> bool:
    try:
        return os.path.samefile(python, sys.executable)
    except OSError:
        return False


def _ask(python: str, modules: list[str]) -> set[str] | None:
    """The modules of `modules` that `python` lacks; None when it cannot be asked here."""
    if not os.path.isabs(python) or not os.access(python, os.X_OK):
        return None
    code = ("import importlib.util as u, sys\n"
            "for m in sys.argv[1:]:\n"
            "    try: ok = u.find_spec(m) is not None\n"
            "    except (ImportError, ValueError): ok = False\n"
            "    print(m, int(ok))\n")
    try:
        out = subprocess.run([python, "-I", "-c", code, *modules], capture_output=True, text=True,
                             timeout=ASK_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    answers = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
    if out.returncode != 0 or set(answers) != set(modules):
        return None
    return {m for m, ok in answers.items() if ok == "0"}
