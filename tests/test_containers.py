"""Containers (hpcjobs.profiles.container): the profile's `container:` keys and `--container IMAGE`, refused in one line
before anything is written when they cannot work, and recorded in the spec when they can. The rendered scripts
are golden-tested in tests/test_render.py; the runs on the test cluster are in tests/cluster/ (marked slow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import REPO, hpcjobs, sbatch_shim

GOOD = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())


@pytest.fixture
def sbatch_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "sbatch-calls.log"
    sbatch_shim(tmp_path, monkeypatch, f'echo "$@" >> {log}\nexit 1\n')
    return log


def profile(tmp_path: Path, container: dict[str, Any] | None, **keys: Any) -> Path:
    path = tmp_path / "c.yaml"
    body = {**GOOD, "runs_dir": str(tmp_path / "runs"), **keys}
    path.write_text(yaml.safe_dump({**body, **({"container": container} if container is not None else {})}))
    return path


def image_dir(tmp_path: Path, config: bool = True) -> str:
    folder = tmp_path / "img"
    (folder / "rootfs").mkdir(parents=True, exist_ok=True)
    for inside in ("runs", "proj", "a"):  # what charliecloud binds onto must be there (run folder, project)
        (folder / str(tmp_path).lstrip("/") / inside).mkdir(parents=True, exist_ok=True)
    (folder / "a").mkdir(exist_ok=True)
    if config:
        (folder / "config.json").write_text("{}")
    return str(folder)


BAD = [  # (container keys, extra flags, what the line says)
    ({"runtime": "docker", "image": "x"}, [], "container.runtime is 'docker'; valid: one of none, pyxis, apptainer"),
    ({"runtime": "pyxis", "image": "x", "mounts": ["data:/data"]}, [], "container.mounts entry 'data:/data': valid"),
    ({"runtime": "pyxis", "image": "x", "mounts": ["/data"]}, [], "container.mounts entry '/data': valid"),
    ({"runtime": "pyxis", "image": "x", "mounts": ["/a:/b:rx"]}, [], "HOST:CONTAINER:ro, both absolute"),
    ({"runtime": "pyxis", "image": "x", "mounts": "a:/b"}, [], "container.mounts entry 'a:/b'"),  # one string
    ({"runtime": "pyxis", "image": "x", "mount": ["/a:/b"]}, [], "Did you mean 'mounts'"),
    ({"runtime": "apptainer", "image": "/nonexistent/train.sif"}, [], "'/nonexistent/train.sif' does not exist here"),
    ({"runtime": "apptainer"}, ["--container", "/nonexistent/x.sif"], "--container '/nonexistent/x.sif' does not"),
    ({"runtime": "charliecloud", "image": "relative/dir"}, [], "'relative/dir' does not exist here"),
    ({"runtime": "pyxis", "image": "./missing.sqsh"}, [], "'./missing.sqsh' does not exist here"),
    ({"runtime": "pyxis"}, [], "container runtime pyxis without an image"),
    (None, ["--container", "nvcr.io#nvidia/pytorch:24.05"], "the profile has no container runtime"),
    ({"runtime": "oci", "image": "IMG"}, ["--gpus", "8"], "one task per node per step (22.05); valid: --gpus 1"),
    ({"runtime": "oci", "image": "IMG", "mounts": ["/a:/a"]}, ["--gpus", "1"], "srun --container takes no mounts"),
    ({"runtime": "oci", "image": "NOCONFIG"}, ["--gpus", "1"], "has no config.json"),
    ({"runtime": "charliecloud", "image": "IMG", "mounts": ["/a:/a:ro"]}, [], "ch-run binds take no :ro/:rw"),
    ({"runtime": "charliecloud", "image": "IMG", "mounts": ["/a:/data"]}, [], "has no folder '/data' to bind onto"),
]


@pytest.mark.parametrize("command", ["submit", "render"])
@pytest.mark.parametrize("container,flags,fragment", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_a_container_that_cannot_work_is_one_line_and_nothing_is_written(
        command: str, container: dict[str, Any] | None, flags: list[str], fragment: str, tmp_path: Path,
        sbatch_log: Path) -> None:
    if container and container.get("image") in ("IMG", "NOCONFIG"):
        container = {**container, "image": image_dir(tmp_path, config=container["image"] == "IMG")}
    prof = profile(tmp_path, container)
    out_file = tmp_path / "job.sbatch"
    extra = ["-o", str(out_file)] if command == "render" else []
    out = hpcjobs(command, "--profile", str(prof), *flags, *extra, "trainers.tasks.lm", "--steps", "5", cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "HINT:" in lines[0], out.stderr
    assert out.stdout == "" and not sbatch_log.exists()
    assert not out_file.exists() and not (tmp_path / "runs").exists()  # no script, no run folder, no snapshot


def test_local_refuses_a_container_in_one_line(tmp_path: Path, sbatch_log: Path) -> None:
    prof = profile(tmp_path, {"runtime": "charliecloud", "image": image_dir(tmp_path)}, scheduler="local")
    out = hpcjobs("submit", "--profile", str(prof), "--gpus", "1", "trainers.tasks.lm", "--steps", "5", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "container runtime charliecloud with profile c (local): valid: no container" in out.stderr
    assert not (tmp_path / "runs").exists()


def test_the_image_is_recorded_with_its_digest_and_mounts(tmp_path: Path, sbatch_log: Path) -> None:
    ref = "nvcr.io#nvidia/pytorch@sha256:" + "ab" * 32
    proj = tmp_path / "proj"
    proj.mkdir()
    prof = profile(tmp_path, {"runtime": "pyxis", "image": "nvcr.io#nvidia/pytorch:24.05",
                              "mounts": ["/lustre:/data:ro"]})
    out = hpcjobs("submit", "--profile", str(prof), "--container", ref, "--no-snapshot", "--dry-run", "--json",
                  "trainers.tasks.lm", "--steps", "5", cwd=proj)
    assert out.returncode == 0, out.stderr
    recorded = json.loads(out.stdout)["spec"]["container"]
    runs = str(tmp_path / "runs")
    assert recorded == {"runtime": "pyxis", "image": ref, "digest": "sha256:" + "ab" * 32,
                        "mounts": [f"{runs}:{runs}", f"{proj}:{proj}", "/lustre:/data:ro"],
                        "workdir": str(proj), "flags": []}
    assert f"--container-image={ref}" in json.loads(out.stdout)["request"]


def test_a_snapshot_inside_the_runs_folder_is_mounted_once(tmp_path: Path, sbatch_log: Path) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "x.py").write_text("print(1)\n")
    prof = profile(tmp_path, {"runtime": "charliecloud", "image": image_dir(tmp_path)})
    out = hpcjobs("render", "--profile", str(prof), "x.py", cwd=tmp_path / "proj")
    assert out.returncode == 0, out.stderr
    runs = str(tmp_path / "runs")
    assert out.stdout.count(f"ch-run -b {runs}:{runs} -c {runs}/") == 2  # the check and the ranks; no 2nd -b
