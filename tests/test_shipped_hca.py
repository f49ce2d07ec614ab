"""The shipped profiles name their InfiniBand adapters exactly (issue 41, item 3): NCCL_IB_HCA without a leading `=`
is a prefix match, so `mlx5_1` also takes mlx5_10, mlx5_11, ... (on nodes with 10-12 HCAs: storage or Ethernet
ports)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import REPO

PROFILES = sorted((REPO / "cluster_profiles").glob("*.yaml"))


def exact(value: str) -> bool:
    """NCCL's exact forms: `=a,b` (only these) and `^=a,b` (all but these)."""
    return value.startswith(("=", "^="))


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_every_shipped_profiles_hca_list_matches_exactly(path: Path) -> None:
    data = yaml.safe_load(path.read_text()) or {}
    for section in ("nccl", "env"):
        value = (data.get(section) or {}).get("NCCL_IB_HCA")
        assert value is None or exact(str(value)), f"{path.name} {section}: NCCL_IB_HCA={value} is a prefix match"


def test_some_shipped_profile_names_its_hcas() -> None:
    assert any("NCCL_IB_HCA" in (yaml.safe_load(p.read_text()).get("nccl") or {}) for p in PROFILES)
    assert not exact("mlx5_0,mlx5_1") and exact("=mlx5_0") and exact("^=mlx5_2")
