"""The plan of the house, read from the sources (ast, nothing imported): the submit side (`hpcjobs/`) and the node
side (`trainers/`) meet only in `hpcjobs/protocol/`, and no module imports itself back through others.

Every import statement counts, also one inside a function (a lazy import still ties two modules: the cycles
launch ↔ run and slurm ↔ its doctor hid there); only `if TYPE_CHECKING:` blocks are left out, since they never
run. An import of a package's name that is a submodule counts as an import of that submodule.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("hpcjobs", "trainers")
SHARED = "hpcjobs.protocol"


def module_files() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module of ours, line) for every import that runs."""
    tree = ast.parse(path.read_text())
    type_only = {id(node) for guard in ast.walk(tree)
                 if isinstance(guard, ast.If) and "TYPE_CHECKING" in ast.unparse(guard.test)
                 for stmt in guard.body for node in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found += [(f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module, node.lineno)
                      for a in node.names]
    return [(target, line) for target, line in found if target.split(".")[0] in PACKAGES]


@functools.cache  # read once: three tests walk it
def graph() -> dict[str, list[tuple[str, int]]]:
    mods = module_files()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def side(module: str) -> str:
    return "shared" if module == SHARED or module.startswith(SHARED + ".") else module.split(".")[0]


ALLOWED = {"shared": {"shared"}, "hpcjobs": {"hpcjobs", "shared"}, "trainers": {"trainers", "shared"}}
"""Which side may import which: the shared layer only itself, each side itself and the shared layer."""


def crossings(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    return [f"{m}:{line} imports {t}" for m, targets in sorted(g.items()) for t, line in targets
            if side(t) not in ALLOWED[side(m)]]


def cycles(g: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in g[v]:
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in g:
        if v not in index:
            visit(v)
    return found


def test_the_sides_meet_only_in_the_shared_layer() -> None:
    assert crossings(graph()) == []


def test_no_module_imports_itself_back() -> None:
    assert cycles(graph()) == []


ROOMS = ("hpcjobs.protocol", "hpcjobs.profiles", "hpcjobs.jobs", "hpcjobs.request", "hpcjobs.backends",
         "hpcjobs.follow", "hpcjobs.goodput", "hpcjobs.submit", "hpcjobs.cli", "hpcjobs.__main__")
"""The submit side's rooms, lowest first (docs/design/index.md draws them): the shared vocabulary; the profiles a user
writes; the job store; a job request built from argv (spec, entry, checks, renderers); the schedulers' backends;
jobs followed; what runs left behind (goodput, compare); submission's side effects; the command line. A room imports
only rooms before it, and the package root only for its version (hpcjobs/__init__.py imports nothing)."""


def room(module: str) -> str:
    return ".".join(module.split(".")[:2])


def arrows_up(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    rank = {r: i for i, r in enumerate(ROOMS)}
    return [f"{m}:{line} imports {t}" for m, targets in sorted(g.items()) if m.startswith("hpcjobs.")
            for t, line in targets if t != "hpcjobs" and rank[room(t)] > rank[room(m)]]


def test_the_submit_side_is_rooms_each_importing_only_rooms_below_it() -> None:
    g = graph()
    assert sorted({room(m) for m in g if m.startswith("hpcjobs.")}) == sorted(ROOMS), "a new room: place it in ROOMS"
    assert arrows_up(g) == []
    assert graph()["hpcjobs"] == [], "the package root holds the version and imports nothing"


def test_the_top_of_hpcjobs_holds_entry_points_only() -> None:
    loose = sorted(p.name for p in (REPO / "hpcjobs").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "submit.py"], "put a new module in the room of what it holds"


def test_the_checks_see_a_crossing_and_a_cycle() -> None:
    """The two checks above, on a made-up graph: a node module reaching into a backend, a function-local cycle."""
    g = {"trainers.preemption": [("hpcjobs.backends.slurm_control", 35)], "hpcjobs.backends.slurm_control": [],
         "trainers.launch": [("trainers.run", 84)], "trainers.run": [("trainers.launch", 36)],
         "hpcjobs.request.spec": [("hpcjobs.protocol.settings.trainflags", 139)],
         "hpcjobs.protocol.settings.trainflags": []}
    assert crossings(g) == ["trainers.preemption:35 imports hpcjobs.backends.slurm_control"]
    assert cycles(g) == [["trainers.launch", "trainers.run"]]
    assert arrows_up({"hpcjobs.request.spec": [("hpcjobs.backends.slurm.slurm", 7), ("hpcjobs.protocol.states", 8)]}) \
        == ["hpcjobs.request.spec:7 imports hpcjobs.backends.slurm.slurm"]


def test_lazy_and_relative_imports_are_read() -> None:
    mods = module_files()
    lazy = imports_of("hpcjobs.backends.slurm.slurm", mods["hpcjobs.backends.slurm.slurm"], mods)
    assert "hpcjobs.backends.slurm.preflight" in {t for t, _ in lazy}  # inside doctor(), and counted
