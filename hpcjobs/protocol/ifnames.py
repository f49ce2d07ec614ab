"""The network interface gloo binds to, resolved on the node from NCCL's setting (issue 41, item 2).

NCCL_SOCKET_IFNAME takes prefixes (`ib` is ib0, ib1, ib0.8066...), a comma list, `=` for exact names and `^` to
exclude; GLOO_SOCKET_IFNAME takes exact names only (a name that is no interface fails every gloo group at start:
the trainer's control and checkpoint groups, a script's stop agreement). So a rank whose environment names NCCL's
interfaces and not gloo's gets, at its start, the first of its node's interfaces that NCCL's setting matches, one
that is up where there is one; where none matches, the start is refused in one line naming the node's interfaces.
NCCL's exclusion form names none to take: gloo is then left to the hostname's address, as it was. Stdlib only.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

NCCL_VAR, GLOO_VAR = "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"


class InterfaceError(ValueError):
    """NCCL's setting matches no interface of this node: one line, what was given; valid: what would be. HINT."""


def node_interfaces() -> list[str]:
    """This node's network interfaces, in the kernel's order (lo first)."""
    return [name for _, name in socket.if_nameindex()]


def is_down(name: str, sys_net: Path = Path("/sys/class/net")) -> bool:
    """Whether the kernel says the interface is down (unknown, e.g. lo's `unknown`, counts as not down)."""
    try:
        return (sys_net / name / "operstate").read_text().strip() == "down"
    except OSError:
        return False


def nccl_matches(setting: str, interfaces: Sequence[str]) -> list[str]:
    """The interfaces NCCL's NCCL_SOCKET_IFNAME `setting` selects, in `interfaces`' order: prefixes, `=` exact
    names, `^` (or `^=`) the ones it excludes; each entry of the comma list may carry NCCL's `:port`."""
    exclude = setting.startswith("^")
    rest = setting.removeprefix("^")
    exact = rest.startswith("=")
    names = [entry.split(":", 1)[0] for entry in rest.removeprefix("=").split(",") if entry.split(":", 1)[0]]

    def named(interface: str) -> bool:
        return any(interface == n if exact else interface.startswith(n) for n in names)
    return [i for i in interfaces if named(i) != exclude]


def gloo_interface(environ: Mapping[str, str], interfaces: Callable[[], Sequence[str]] = node_interfaces,
                   down: Callable[[str], bool] = is_down, node: str = "") -> dict[str, str]:
    """{GLOO_SOCKET_IFNAME: the interface} for a rank whose environment sets NCCL's and not gloo's, else {} (the
    interfaces are read only then). Raises InterfaceError when NCCL's setting matches none of them."""
    setting = environ.get(NCCL_VAR, "").strip()
    if not setting or setting.startswith("^") or environ.get(GLOO_VAR):
        return {}
    found = list(interfaces())
    matched = nccl_matches(setting, found)
    if not matched:
        node = node or os.uname().nodename
        raise InterfaceError(
            f"{NCCL_VAR}={setting} matches no network interface of node {node} (it has: {', '.join(found)}), so "
            f"gloo has none to bind to; valid: a prefix of one of them, =NAME for an exact one, or a comma list. "
            f"HINT: set {NCCL_VAR} in the profile's nccl: section to what `ip -br link` shows on a compute node, "
            f"or {GLOO_VAR} in its env: to name gloo's own")
    up = [name for name in matched if not down(name)]
    return {GLOO_VAR: (up or matched)[0]}
