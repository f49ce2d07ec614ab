"""`hpcjobs export`: one file of a run's weights from a finished checkpoint, offline (issue 12, part 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, hpcjobs
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

TASK = ["trainers.tasks.classifier", "--steps", "6", "--log-every", "3", "--ckpt-every", "3", "--keep", "3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    base = tmp_path_factory.mktemp("export")
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--json", "--run-dir", str(base / "run"), *TASK,
                  cwd=REPO, env={"HPCJOBS_HOME": str(base / "home")}, timeout=300)
    assert out.returncode == 0, out.stderr
    return base / "run", json.loads(out.stdout)["job_id"], base / "home"


def saved_model(run: Path, step: int) -> dict[str, torch.Tensor]:
    ref = next(r for r in checkpoint.finished(run / "checkpoints") if r.step == step)
    return model_weights(ref)


@pytest.mark.train
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_by_job_id_and_by_folder_writes_the_checkpoints_weights(run: tuple[Path, str, Path], suffix: str,
                                                                      tmp_path: Path) -> None:
    folder, job, home = run
    out = tmp_path / f"model{suffix}"
    done = hpcjobs("export", job, "-o", str(out), env={"HPCJOBS_HOME": str(home)})
    assert done.returncode == 0, done.stderr
    assert "exported step 6" in done.stdout
    if suffix == ".pt":
        got = torch.load(out, weights_only=True)
    else:
        from safetensors.torch import load_file
        got = load_file(str(out))
    want = saved_model(folder, 6)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    earlier = tmp_path / f"step3{suffix}"
    assert hpcjobs("export", str(folder), "--step", "3", "-o", str(earlier)).returncode == 0
    assert earlier.read_bytes() != out.read_bytes()


@pytest.mark.train
@pytest.mark.parametrize("args,said", [
    (["--step", "4"], "--step 4: "),
    (["-o", "model.txt"], "the suffix .txt is not a format"),
    (["-o", "exists.pt"], "already exists; nothing was written"),
    (["-o", "dangling.pt"], "dangling.pt already exists; nothing was written"),  # a link that leads nowhere
    (["-o=-m.txt"], "-o -m.txt: the suffix .txt is not a format"),  # a value, not an option, on the node side too
])
def test_bad_export_requests_are_one_line(run: tuple[Path, str, Path], args: list[str], said: str,
                                          tmp_path: Path) -> None:
    (tmp_path / "exists.pt").write_text("precious")
    (tmp_path / "dangling.pt").symlink_to("nowhere")
    argv = ["export", str(run[0]), *args] + ([] if any(a.startswith("-o") for a in args) else ["-o", "m.pt"])
    out = hpcjobs(*argv, cwd=tmp_path)
    assert out.returncode == 2 and said in out.stderr and "HINT:" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert (tmp_path / "exists.pt").read_text() == "precious" and not (tmp_path / "m.pt").exists()
    assert (tmp_path / "dangling.pt").is_symlink()


@pytest.mark.train
def test_export_of_a_folder_without_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = hpcjobs("export", str(tmp_path / "empty"), "-o", str(tmp_path / "m.pt"))
    assert out.returncode == 2 and "holds no finished checkpoint" in out.stderr


def test_the_cli_does_not_import_torch() -> None:
    import subprocess

    code = "import sys; from hpcjobs import cli; cli.build_parser(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
