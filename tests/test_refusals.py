"""One refusal on the node (issue 36, item 5): every way a rank's start is refused derives from
hpcjobs.protocol.errors.StartRefused, which the launcher turns into one line and exit 2, whatever raised it; each keeps
its standard base, so code that caught ValueError or RuntimeError still does."""

from __future__ import annotations

import ast
from pathlib import Path

from hpcjobs.protocol.contract import ContractError
from hpcjobs.protocol.errors import StartRefused
from hpcjobs.protocol.settings.trainflags import ConfigError, ResumeError
from trainers.jobenv.base import JobEnvError
from trainers.runlock import RunFolderBusy, RunFolderUnwritable
from trainers.versions import TorchTooOld

REPO = Path(__file__).resolve().parent.parent


def test_every_refusal_of_a_start_shares_one_base_and_keeps_its_own() -> None:
    for cls, std in ((ContractError, ValueError), (ConfigError, ValueError), (ResumeError, ValueError),
                     (JobEnvError, ValueError), (TorchTooOld, RuntimeError)):
        assert issubclass(cls, StartRefused) and issubclass(cls, std), cls
    for lock in (RunFolderBusy, RunFolderUnwritable):  # a run folder the start cannot have: refused the same way
        assert issubclass(lock, StartRefused), lock


def test_the_launcher_refuses_by_the_base_not_by_a_list() -> None:
    tree = ast.parse((REPO / "trainers" / "launch.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    caught = [ast.unparse(h.type) for h in ast.walk(main) if isinstance(h, ast.ExceptHandler) and h.type is not None]
    assert caught.count("StartRefused") == 2 and not {"ConfigError", "ContractError"} & set(caught), caught
