"""`hpcjobs submit|render ... train.py --help`: the script's flags, read from its source, never by running it.

The submit host is often a shared login node. Running the user's script there to show its help (`python train.py
--help`, as this command once did) starts its imports (torch, CUDA, a tracker) and, for a script whose parser does not
answer --help the usual way (its own parser, `parse_known_args`, a config file read first), its training, on the
login node (issue 37). So the script's source is read instead: every `add_argument(...)` call whose option names are
string literals, with its literal `default`, `type`, `required`, `choices` and `help` — argparse as nearly every
training script uses it. Anything else (HfArgumentParser's dataclasses, click, hydra, options built in a loop) cannot
be read this way, and the line says how to ask the script itself, on a machine where running it is fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

HOW = "run `python {target} --help` where running it is fine (a compute node, your laptop)"
"""How to ask the script itself."""


def options(source: str) -> list[str]:
    """One line per literal `add_argument` call of `source`, in order: its names, metavar-like type, and what the
    call says of it."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if not names:
            continue
        said = {k.arg: k.value for k in node.keywords if k.arg}
        kind = said.get("type")
        words = [", ".join(names) + (f" {kind.id.upper()}" if isinstance(kind, ast.Name) else "")]
        required, helped = said.get("required"), said.get("help")
        if isinstance(required, ast.Constant) and required.value is True:
            words.append("(required)")
        for key in ("default", "choices", "action"):
            if key in said:
                words.append(f"{key} {ast.unparse(said[key])}")
        if isinstance(helped, ast.Constant):
            words.append(f"— {helped.value!s}")
        lines.append("  " + " ".join(words))
    return sorted(lines, key=lambda line: line.lstrip().startswith("-"))  # positionals first, as argparse


def script_file(kind: str, target: str, workdir: Path) -> Path | None:
    """The file of a script entry, or of a module entry found under the working folder; None elsewhere (an
    installed module: finding it would import its packages)."""
    if kind == "script":
        path = workdir / target
        return path if path.is_file() else None
    parts = target.split(".")
    for candidate in (workdir.joinpath(*parts).with_suffix(".py"), workdir.joinpath(*parts, "__main__.py")):
        if candidate.is_file():
            return candidate
    return None


def text(kind: str, target: str, workdir: Path) -> str:
    """What `ENTRY --help` prints for a script or module entry."""
    shown = target if kind == "script" else f"-m {target}"
    path = script_file(kind, target, workdir)
    try:
        found = options(path.read_text()) if path else []
    except (OSError, SyntaxError, ValueError):
        found = []
    if not found:
        return (f"hpcjobs: {target}'s flags could not be read from its source, and hpcjobs does not run your script "
                f"on this host to ask it; {HOW.format(target=shown)}.")
    return "\n".join([f"hpcjobs: {target}'s flags, read from its source (hpcjobs does not run your script on this "
                      f"host; for its own help, {HOW.format(target=shown)}):", *found])
