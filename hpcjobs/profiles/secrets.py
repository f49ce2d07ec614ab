"""A profile's `secrets:` entries: names of environment variables, never values (docs/how-to/secrets.md). The rest
of the rule, for `--env` and for values that look like credentials, is hpcjobs.request.credentials'."""

from __future__ import annotations

import re

from hpcjobs.protocol.errors import UsageError

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""An environment variable's name."""


def secret_name(value: object, key: str) -> None:
    """A profile `secrets:` entry: an environment variable's name."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise UsageError(f"{key} entry {value!r} is not a variable name; valid: letters, digits and _ "
                         "(e.g. WANDB_API_KEY): the value comes from the submitting shell's environment.")
