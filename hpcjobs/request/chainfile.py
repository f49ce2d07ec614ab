"""A chain file: named steps, each one `hpcjobs submit` command line, and who waits for whom.

    # chain.yaml                     hpcjobs submit --chain chain.yaml [--dry-run] [--json]
    train:
      submit: --profile mycluster --nodes 2 --gpus 8 trainers.tasks.lm --size small --steps 5000
    eval:
      after: train                   # a step's name, `name:any`, `name:notok`, or a list of them
      submit: --profile mycluster --nodes 1 --gpus 1 eval.py --run runs/lm
    export:
      after: [eval]
      submit: --profile mycluster --nodes 1 --gpus 1 export.py

Each `submit:` is read by the same parser as `hpcjobs submit`, so a step is whatever a submit can be (a sweep too);
`after:` becomes `--after ID` once the step it names has its job id. Every step is checked (each spec built, each
name known, no cycle) before the first is queued, and the steps are queued upstream first. Pure: reading and
ordering only (hpcjobs/cli/chain.py queues).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from hpcjobs.protocol.errors import UsageError
from hpcjobs.request.after import CONDITIONS

KEYS = ("submit", "after")
HINT = "a mapping of step names, each with `submit: FLAGS ENTRY ARGS` and optionally `after: STEP[:ok|any|notok]`"


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    """The step's `hpcjobs submit` arguments."""
    after: tuple[tuple[str, str], ...] = ()
    """(upstream step, condition) pairs."""


def read_chain(path: Path) -> list[Step]:
    """The chain's steps, each after every step it waits for; UsageError (one line) for a file that is not one."""
    from hpcjobs.profiles import yamlfile

    kind = yamlfile.Kind("chain file", "--chain", "step names, each a mapping of submit and after")
    data = yamlfile.load(kind, path)
    if not isinstance(data, dict) or not data:
        raise UsageError(f"--chain {path}: holds {type(data).__name__}; valid: {HINT}", "see `hpcjobs submit --help`")
    steps = [_step(path, str(name), body) for name, body in data.items()]
    return ordered(path, steps)


def _step(path: Path, name: str, body: object) -> Step:
    where = f"--chain {path}: step {name!r}"
    if not isinstance(body, dict):
        raise UsageError(f"{where} is {type(body).__name__}; valid: {HINT}", f"e.g. {name}: {{submit: --profile ...}}")
    unknown = [k for k in body if k not in KEYS]
    if unknown:
        raise UsageError(f"{where} has the key {unknown[0]!r}; valid: {', '.join(KEYS)}", HINT)
    submit = body.get("submit")
    if not isinstance(submit, (str, list)) or not submit:
        raise UsageError(f"{where} has no `submit:`; valid: the flags, entry and arguments of `hpcjobs submit`, as "
                         "one string or a list", "e.g. submit: --profile local trainers.tasks.lm --steps 50")
    try:
        argv = tuple(shlex.split(submit) if isinstance(submit, str) else (str(w) for w in submit))
    except ValueError as e:
        raise UsageError(f"{where}: submit: {e}; valid: a command line as a shell reads it", "close the quote") \
            from None
    if "--after" in argv or any(w.startswith("--after=") for w in argv):
        raise UsageError(f"{where}: --after inside submit:; valid: `after:` with step names", "move it to after:")
    after = body.get("after") or []
    names = [after] if isinstance(after, str) else after
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"{where}: after: {after!r}; valid: a step name or a list of them", "e.g. after: train")
    pairs = []
    for text in names:
        upstream, _, condition = text.partition(":")
        if condition and condition not in CONDITIONS:
            raise UsageError(f"{where}: after: {text!r}; valid: STEP[:{'|'.join(CONDITIONS)}]", "e.g. after: train")
        pairs.append((upstream.strip(), condition or "ok"))
    return Step(name, argv, tuple(pairs))


def ordered(path: Path, steps: list[Step]) -> list[Step]:
    """Upstream first, in the file's order otherwise; an unknown name or a cycle is refused."""
    by_name = {s.name: s for s in steps}
    for s in steps:
        for upstream, _ in s.after:
            if upstream not in by_name:
                raise UsageError(f"--chain {path}: step {s.name!r} waits for {upstream!r}, which is no step; valid: "
                                 f"{', '.join(by_name)}", "name a step of this file")
    done: list[Step] = []
    visiting: list[str] = []

    def visit(s: Step) -> None:
        if s in done:
            return
        if s.name in visiting:
            cycle = " → ".join([*visiting[visiting.index(s.name):], s.name])
            raise UsageError(f"--chain {path}: a cycle, {cycle}; valid: steps that wait only for earlier ones",
                             "remove one of these after:")
        visiting.append(s.name)
        for upstream, _ in s.after:
            visit(by_name[upstream])
        visiting.pop()
        done.append(s)

    for s in steps:
        visit(s)
    return done
