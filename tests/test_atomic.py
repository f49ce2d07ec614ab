"""hpcjobs.protocol.atomic: the one write-aside-then-rename helper every record, script, plot and export uses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpcjobs.protocol.atomic import replacing, write_atomic


def test_a_failed_write_leaves_the_old_file_and_nothing_aside(tmp_path: Path) -> None:
    path = tmp_path / "record.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), replacing(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_a_write_replaces_whole_with_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    write_atomic(path, "#!/bin/bash\n", mode=0o755)
    write_atomic(path, b"#!/bin/sh\n", durable=True, mode=0o755)
    assert path.read_text() == "#!/bin/sh\n" and os.stat(path).st_mode & 0o777 == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch"]
