"""The entry a job runs, found (never imported) on this machine as the ranks will find it: a task module for the
shared trainer (`module` or `module:callable`), a .py script, or `-m module`. A typo is refused here, before the job
waits in the queue, not by every rank once it starts."""

from __future__ import annotations

import ast
import importlib
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path

from hpcjobs.errors import UsageError
from hpcjobs.paths import resolved

MAX_SOURCE_BYTES = 2 * 2**20
"""A task module larger than this is not read for its names (the node finds out)."""


@dataclass(frozen=True)
class Entry:
    """What every rank runs."""

    kind: str
    """`task` (a module or module:callable for the shared trainer), `script` (a .py file) or `module` (-m)."""
    target: str
    """The task reference, the script path (absolute) or the module name."""
    args: tuple[str, ...] = ()
    """Arguments after the entry, passed through unchanged."""

    def describe(self) -> str:
        head = {"task": f"task {self.target}", "script": self.target, "module": f"-m {self.target}"}[self.kind]
        return " ".join([head, *self.args])



def resolve_entry(entry: str, args: tuple[str, ...], module: bool, workdir: Path) -> Entry:
    """Decide what kind of entry this is and check it exists (finding, not importing, a module)."""
    hint = ("e.g. `hpcjobs submit --profile local trainers.tasks.lm --steps 50`, `... train.py --config x.yaml` "
            "or `... -m mypkg.train`.")
    if not entry or entry.startswith("-"):
        raise UsageError(f"entry {entry!r} is not an entry point; valid: a task module, a .py script or -m MODULE.",
                         hint)
    if module:
        _require_module(entry, "-m", hint, workdir)
        return Entry("module", entry, args)
    if entry.endswith(".py") or os.sep in entry:
        path = resolved(workdir / entry, "script", hint)
        if not path.is_file():
            raise UsageError(f"script {entry!r} does not exist (looked in {workdir}).", hint)
        return Entry("script", str(path), args)
    name, colon, attr = entry.partition(":")
    if colon and not attr.isidentifier():
        raise UsageError(f"task {entry!r}: {attr!r} is not a Python name; valid: MODULE or MODULE:CALLABLE.", hint)
    _require_callable(entry, _require_module(name, "task", hint, workdir), attr, hint)
    return Entry("task", entry, args)


def _require_callable(entry: str, source: str | None, attr: str, hint: str) -> None:
    """The task module defines what the node will call (`attr`, else make_task or task), where its source tells
    without running it."""
    try:
        text = Path(source).read_bytes()[:MAX_SOURCE_BYTES + 1].decode("utf-8") if source else None
    except (OSError, UnicodeDecodeError):
        text = None
    names = _top_level_names(text) if text is not None and len(text) <= MAX_SOURCE_BYTES else None
    wanted = [attr] if attr else ["make_task", "task"]
    if names is not None and not names.intersection(wanted):
        raise UsageError(f"task {entry!r}: {source} defines no {' or '.join(wanted)} at its top level; valid: a "
                         "module with make_task(args) or task, or MODULE:CALLABLE naming one it defines.", hint)


def _find_spec(fullname: str, path: Sequence[str] | None) -> ModuleSpec | None:
    """What the import system's finders say of one module, as `import` asks them, without loading anything."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(fullname, path) if find is not None else None
        if spec is not None:
            return spec
    return None


def _module_source(name: str) -> str | None | bool:
    """Whether `name` can be imported, asked of the finders one level at a time (importlib.util.find_spec imports a
    dotted name's parents, which ran pkg/__init__.py (torch, often) here, or for `-m train.py` the whole script):
    False if not; else the path of its .py source, or None where it has none to read (a compiled or loaded one)."""
    if name in sys.modules:  # imported already: what import uses (os.path is found only there)
        return None
    parts = name.split(".")
    search: Sequence[str] | None = None  # the top level: sys.path
    origin: str | None = None
    for depth in range(1, len(parts) + 1):
        fullname = ".".join(parts[:depth])
        if fullname in sys.modules:
            search, origin = getattr(sys.modules[fullname], "__path__", None), None
        else:
            spec = _find_spec(fullname, search)
            if spec is None:
                return False
            search, origin = spec.submodule_search_locations, spec.origin
        if search is None and depth < len(parts):  # a module that is not a package has no submodules
            return False
    return origin if origin and origin.endswith(".py") else None


def _top_level_names(source: str) -> set[str] | None:
    """The names a module's source binds at its top level; None where that cannot be told without running it (it
    does not parse, star-imports, binds names inside if/try/with/loops, or has a module __getattr__)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While, ast.Match)):
            return None
    return None if "__getattr__" in names else names


def _require_module(name: str, what: str, hint: str, workdir: Path) -> str | None:
    """Find (not import) the module as the ranks will: they start with `python -m` in `workdir`, which puts it
    first on their sys.path (the console script's sys.path does not have it). Returns its source's path, if any."""
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
        raise UsageError(f"{what} {name!r} is not a Python module name; valid: dotted names like pkg.mod.", hint)
    sys.path.insert(0, str(workdir))
    importlib.invalidate_caches()
    try:
        found = _module_source(name)
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.remove(str(workdir))
    if found is False:
        raise UsageError(f"{what} module {name!r} cannot be found from {workdir} (nor on sys.path).", hint)
    return found if isinstance(found, str) else None
