"""Credentials pass by name, never by value (docs/how-to/secrets.md).

`--env NAME` (no `=`) and a profile's `secrets:` list name variables whose values every rank takes from the
environment of the submitting shell: Slurm hands sbatch's environment to the job (its default `--export=ALL`; submitit
runs sbatch from this process), and the local backend starts its ranks from this process's environment. Only the
names are written (the spec, the store, a rendered script's check that each is set); a value never is.

A value that looks like a credential where it would be written (`--env NAME=VALUE`, a profile's `env:`) is refused
before anything is written, unless `--allow-secret-values` says the user means it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from hpcjobs.profiles.secrets import NAME
from hpcjobs.protocol.access import world_readable
from hpcjobs.protocol.errors import UsageError
from hpcjobs.request.checks import Check, Result

ALLOW_FLAG = "--allow-secret-values"
_WORDS = ("KEY", "KEYS", "APIKEY", "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIAL",
          "CREDENTIALS")
_CREDENTIAL_NAME = re.compile(rf"(?:^|_)(?:{'|'.join(_WORDS)})(?:_|$)", re.I)
"""A name one of whose `_`-separated words says key, token, secret, password or credential (WANDB_API_KEY, HF_TOKEN,
AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD), not one that merely holds the letters (TOKENIZERS_PARALLELISM)."""
_CREDENTIAL_VALUE = re.compile(r"(?:hf_[A-Za-z0-9]{16,}|sk-[A-Za-z0-9_-]{16,}|gh[pousr]_[A-Za-z0-9]{16,}"
                               r"|github_pat_[A-Za-z0-9_]{16,}|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abprs]-[A-Za-z0-9-]{10,})")
"""Common token formats: Hugging Face, OpenAI-style `sk-`, GitHub, AWS access key ids, Slack."""


def bare_names(flags: Iterable[str]) -> tuple[str, ...]:
    """The `--env NAME` flags (no `=`): secrets forwarded by name."""
    return tuple(f for f in flags if NAME.fullmatch(f))


def looks_secret(name: str, value: str) -> bool:
    return bool(_CREDENTIAL_NAME.search(name) or _CREDENTIAL_VALUE.search(value))


def masked(value: str) -> str:
    return f"{value[:3]}…" if len(value) > 8 else "…"


def refuse_values(env: Mapping[str, str], where: str, allowed: bool) -> None:
    """One line, before anything is written, for the first NAME=VALUE that looks like a credential."""
    if allowed:
        return
    for name, value in env.items():
        if looks_secret(name, value):
            raise UsageError(f"{where} {name}={masked(value)} looks like a credential and would be written to the "
                             "run folder, the job store and the job script; valid: --env NAME (the value stays in "
                             "this shell's environment) or a profile's secrets: [NAME].",
                             f"export {name}=... in this shell, then pass --env {name} (or, knowing that the value "
                             f"is written in plain text, {ALLOW_FLAG}).")


def states(names: Iterable[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each name: "set" or "missing" in `environ` (this process's), never its value."""
    env = os.environ if environ is None else environ
    return {n: "set" if env.get(n) else "missing" for n in names}


def refuse_missing(names: Iterable[str]) -> None:
    """A listed secret unset in this shell: every rank would start without it. One line, exit 2."""
    missing = [n for n, s in states(names).items() if s == "missing"]
    if missing:
        raise UsageError(f"secret {missing[0]} is not set in this shell's environment (the ranks take its value "
                         "from it); valid: an exported, non-empty variable; nothing was submitted.",
                         f"export {missing[0]}=... (or read it from a file: export {missing[0]}=$(cat FILE)), "
                         "then submit again.")


def check_lines(names: Iterable[str]) -> list[str]:
    """Shell lines ending the job with one line when a secret is missing from the environment sbatch gave it."""
    return [f': "${{{n}:?hpcjobs: secret {n} is not set: export it in the shell that runs sbatch}}"' for n in names]


def group_id(group: str | None) -> int | None:
    """The id of the profile's `group:` (None: none named); one line when this machine has no such group."""
    if not group:
        return None
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise UsageError(f"the profile's group {group!r} does not exist here; valid: a group you are in "
                         f"(`id -Gn` lists them).", "fix group: in the profile, or leave it out to keep runs "
                         "readable by you alone.") from None


def doctor_checks(secrets: Iterable[str], runs_root: Path) -> list[Check]:
    """Each secret set or missing in this shell (never its value), and run folders any user can read."""
    checks = [Check(f"secret {n}", Result.PASS if s == "set" else Result.FAIL, s,
                    f"export {n}=... in this shell before submitting") for n, s in states(secrets).items()]
    try:
        found = sorted(p.name for p in runs_root.iterdir() if p.is_dir() and world_readable(p))
    except OSError:
        found = []
    if found:
        checks.append(Check("run folders private", Result.FAIL, f"{len(found)} run folder(s) in {runs_root} any "
                            f"user can read: {', '.join(found[:3])}{' …' if len(found) > 3 else ''}",
                            f"chmod -R go-rwx {runs_root}/NAME (or chmod o-rwx, for a group's runs)"))
    return checks
