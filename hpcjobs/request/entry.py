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

from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.paths import resolved

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
        if entry.endswith(".py") or os.sep in entry:
            raise UsageError(f"-m {entry!r}: -m takes a module name, not a file; valid: -m pkg.mod, or a .py script "
                             "without -m.", _file_given_to_m(entry, args, workdir) or hint)
        _require_module(entry, "-m", hint, workdir)
        return Entry("module", entry, args)
    _refuse_folder(entry, workdir, hint)
    if entry.endswith(".py") or os.sep in entry:
        path = resolved(workdir / entry, "script", hint)
        if not path.is_file():
            raise UsageError(f"script {entry!r} does not exist (looked in {workdir}).", hint)
        _refuse_task_file(entry, path, args, workdir)
        return Entry("script", str(path), args)
    name, colon, attr = entry.partition(":")
    if colon and not attr.isidentifier():
        raise UsageError(f"task {entry!r}: {attr!r} is not a Python name; valid: MODULE or MODULE:CALLABLE.", hint)
    _require_callable(entry, _require_module(name, "task", hint, workdir), attr, hint)
    return Entry("task", entry, args)


def _file_given_to_m(entry: str, args: tuple[str, ...], workdir: Path) -> str | None:
    """How to say `-m train.py` as meant: the script without -m (where it is a file), or the module without .py."""
    module = entry.removesuffix(".py").replace(os.sep, ".")
    as_module = f"`-m {module}`" if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module) else None
    if (workdir / entry).is_file():
        script = f"drop -m to run the script: `{' '.join(['hpcjobs submit ...', entry, *args])}`"
        return f"{script}, or drop the .py to run it as a module: {as_module}." if as_module else f"{script}."
    return f"drop the .py: {as_module}." if as_module else None


def _refuse_folder(entry: str, workdir: Path, hint: str) -> None:
    """A folder typed as the entry (`hpcjobs submit ... profiles`): one without an __init__.py was found as a
    namespace package, so a rank started only to find no task in it (exit 1, a run folder and a job record)."""
    folder = workdir / entry
    try:
        if not folder.is_dir() or (os.sep not in entry and (folder / "__init__.py").is_file()):
            return  # a package with code of its own is a task module (whose make_task is checked)
        scripts = sorted(p.name for p in folder.glob("*.py"))[:3]
    except OSError:
        return
    name = entry.rstrip(os.sep) or entry
    raise UsageError(f"{name!r} is a folder, not an entry point; valid: a task module, a .py script or -m MODULE.",
                     f"name a script in it, e.g. `hpcjobs submit ... {name}/{scripts[0]}`, or a task module."
                     if scripts else hint)


def _refuse_task_file(entry: str, path: Path, args: tuple[str, ...], workdir: Path) -> None:
    """A task's file given as a script (`hpcjobs submit trainers/tasks/lm.py --steps 5`) would run as a script that
    only defines make_task: nothing trains, exit 0, no word. Refused with the module name to give instead, rather
    than run as the task: the ranks import a task by its module name, which the path does not always give (a file
    outside the submit's folder, a folder that is no package), and a file that once ran as a script must not start
    to mean something else because a make_task appeared in it. A file whose source cannot be read or parsed, or
    that does anything when run (a call, a loop, a `__main__` guard), is a script and runs as one."""
    try:
        text = path.read_bytes()[:MAX_SOURCE_BYTES + 1].decode("utf-8")
        tree = ast.parse(text) if len(text) <= MAX_SOURCE_BYTES else None
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return
    if tree is None or not _only_defines(tree.body):
        return
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} | {
        t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    defined = [name for name in ("make_task", "task") if name in names]
    if not defined:
        return
    module = _module_name(path, workdir)
    raise UsageError(
        f"{entry} defines {defined[0]} (a task for the shared trainer) and does nothing when run as a script: "
        "nothing would train; valid: a task by its module name, or a script that trains.",
        f"name the task by its module: `{' '.join(['hpcjobs submit ...', module, *args])}`" if module else
        "name the task by its module, submitting from the folder its package is in (e.g. `hpcjobs submit ... "
        "pkg.mytask --steps 5`).")


def _only_defines(body: list[ast.stmt]) -> bool:
    """Whether running these statements only defines names: imports, functions, classes, assignments, docstrings,
    and if/try blocks of those (`try: import x except ImportError`); no call of its own, no loop, no `__main__`."""
    for node in body:
        if isinstance(node, ast.Expr):
            if not isinstance(node.value, ast.Constant):
                return False
        elif isinstance(node, ast.If):
            if any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test)):
                return False
            if not (_only_defines(node.body) and _only_defines(node.orelse)):
                return False
        elif isinstance(node, ast.Try):
            blocks = [node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)]
            if not all(_only_defines(b) for b in blocks):
                return False
        elif not isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                   ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Pass)):
            return False
    return True


def _module_name(path: Path, workdir: Path) -> str | None:
    """The dotted name under which the ranks (started in `workdir`, which comes first on their sys.path) import
    exactly this file, if it has one."""
    file = path.resolve()
    for base in (workdir, *map(Path, filter(None, sys.path))):
        try:
            parts = file.with_suffix("").relative_to(base.resolve()).parts
        except (ValueError, OSError):
            continue
        if not parts or not all(p.isidentifier() for p in parts):
            continue
        if base == workdir and all((base.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            return ".".join(parts)  # first on the ranks' sys.path: its packages win over any installed copy
        try:
            found = _require_module(".".join(parts), "task", "", workdir)
        except (UsageError, ImportError, KeyError, ValueError):  # KeyError: importlib, of a namespace whose parent
            continue                                           # was never imported (`/tmp/a/b.py` from /: `tmp.a`)
        if found is not None and Path(found).resolve() == file:
            return ".".join(parts)
    return None


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
