"""Users' training libraries joined to the stop protocol without a changed line in their scripts.

The launcher calls `install()` before it runs a user's script or module (never for hpcjobs's own tasks). It adds one
import hook: when the script imports a library module named in HOOKS, the hook runs right after that module's own code
and attaches hpcjobs (trainers/integrations/hf_trainer.py for `transformers.Trainer`, lightning.py beside it for
Lightning's, under either package name; trainers/ddp_buckets.py for torch's DDP, whatever library builds it: a resumed
start reduces its first step's gradients in the bucket layout the uninterrupted run has by then). A script that imports
none of them pays one dictionary lookup per import it makes (measured: 0.37 µs per import; `import torch` makes 1125, so
0.4 ms of a start that spends 2-4 s importing torch). `HPCJOBS_HOOKS=0` in the rank's environment (`hpcjobs submit --env
HPCJOBS_HOOKS=0`) leaves every library as it is.

An `accelerate` loop is the script's own code, with no library call to hook: it takes one line instead
(accelerate_loop.py, the loop's header), and adds nothing here; HPCJOBS_HOOKS=0 turns it into the plain loop.

Torch-free: the hooks import nothing until the library itself is imported.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from hpcjobs.protocol import stopcheck
from hpcjobs.protocol.stopcheck import CHECK_EVERY

HOOKS: dict[str, str] = {"torch.nn.parallel.distributed": "trainers.ddp_buckets",
                         "transformers.trainer": "trainers.integrations.hf_trainer",
                         "lightning.pytorch.trainer.trainer": "trainers.integrations.lightning",
                         "pytorch_lightning.trainer.trainer": "trainers.integrations.lightning"}
"""Library module → the hpcjobs module whose `attach(module)` joins it to the protocol once it is imported."""
SWITCH = "HPCJOBS_HOOKS"
"""`0` turns every hook off."""


def enabled(environ: Mapping[str, str]) -> bool:
    return environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def check_every(environ: Mapping[str, str]) -> int:
    """HPCJOBS_STOP_CHECK_EVERY as a number; anything else is refused in one line (exit 2) on every rank, before the
    script runs (install) or the loop begins (accelerate_loop.resumable). `hpcjobs submit` refused it already."""
    every = stopcheck.parse(environ.get(CHECK_EVERY))
    if every is not None:
        return every
    from trainers.integrations.marks import say  # only on the way out: this module imports nothing at a start

    message, hint = stopcheck.refusal(environ[CHECK_EVERY])
    say(f"{message} HINT: {hint}")
    raise SystemExit(2)


class _Loader:
    """The library module's own loader, then its hook. (Plain classes: importlib.abc would import importlib.resources
    and pathlib, ~25 ms, into every script's start.)"""

    def __init__(self, inner: Any, attach: Callable[[ModuleType], None]) -> None:
        self.inner, self.attach = inner, attach

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.attach(module)


class _Finder:
    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        hook = HOOKS.get(name)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader, importlib.import_module(hook).attach)  # type: ignore[assignment]
        return spec


def install(environ: Mapping[str, str] | None = None) -> bool:
    """Add the import hook (once); False when HPCJOBS_HOOKS=0 turned it off. A library already imported (a module
    the launcher itself ran first: none today) is attached at once. A bad HPCJOBS_STOP_CHECK_EVERY ends the rank
    here (exit 2)."""
    environ = os.environ if environ is None else environ
    if not enabled(environ):
        return False
    check_every(environ)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name, hook in HOOKS.items():
        if name in sys.modules:
            importlib.import_module(hook).attach(sys.modules[name])
    return True
