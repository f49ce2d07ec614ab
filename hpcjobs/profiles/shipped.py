"""Where the shipped data lives: inside the wheel (hpcjobs/_data/...) or, in a source checkout, the repo's top level."""

from __future__ import annotations

from pathlib import Path


def data_dir(name: str) -> Path:
    """`templates` or `cluster_profiles`, wherever this installation keeps them."""
    packaged = Path(__file__).parent.parent / "_data" / name
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent.parent / name
