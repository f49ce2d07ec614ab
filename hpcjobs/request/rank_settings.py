"""What every rank of a job finds in its environment beyond the rendezvous: the profile's env and NCCL settings and
the user's --env, checked before anything is queued (a name hpcjobs sets per rank, a value every rank would refuse).
Where only NCCL's interface is named, gloo's is resolved by each rank from its node's interfaces
(hpcjobs.protocol.ifnames): NCCL takes prefixes, gloo exact names, and only the node knows which names exist."""

from __future__ import annotations

import re
from collections.abc import Mapping

from hpcjobs.protocol import stopcheck
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.rankvars import RENDEZVOUS
from hpcjobs.request import credentials

_ENV_ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)


def job_env(profile_env: Mapping[str, str], nccl: Mapping[str, str], flags: tuple[str, ...],
            allow_values: bool = False) -> dict[str, str]:
    """Every rank's environment: the profile's env and NCCL settings, then each --env NAME=VALUE over them."""
    given = _env_pairs(flags)
    check_env_names(given, "--env")  # the profile's env: checked when it was loaded
    credentials.refuse_values(profile_env, "the profile's env:", allow_values)
    credentials.refuse_values(given, "--env", allow_values)
    env = {**profile_env, **nccl, **given}
    if stopcheck.parse(env.get(stopcheck.CHECK_EVERY)) is None:  # every rank would refuse it at its start
        raise UsageError(*stopcheck.refusal(env[stopcheck.CHECK_EVERY]))
    return env


def _env_pairs(items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        m = _ENV_ASSIGN.match(item)
        if not m and credentials.NAME.fullmatch(item):
            continue  # --env NAME: a secret passed by name (hpcjobs.request.credentials)
        if not m:
            raise UsageError(f"--env {item!r} is not NAME=VALUE or NAME.", "e.g. --env WANDB_MODE=offline, or "
                             "--env WANDB_API_KEY to pass that variable of this shell")
        out[m.group(1)] = m.group(2)
    return out


def check_env_names(env: Mapping[str, str], where: str) -> None:
    """A rank's identity and rendezvous are set for each rank when it starts: one given for the whole job would be
    every rank's (all rank 0), or be overwritten without a word."""
    taken = [name for name in env if name in RENDEZVOUS]
    if taken:
        raise UsageError(f"{where} sets {taken[0]}, which hpcjobs sets for each rank; valid: other names (not "
                         f"{', '.join(RENDEZVOUS)}).", "drop it: every rank gets its own from the launcher.")
