"""Containers: the profile's `container:` keys, and the image a job runs in, checked before anything is queued.

Four runtimes, in two families (measured on the test cluster: /work/shared/docs/containers-on-the-test-cluster.md):
  srun flags     `pyxis` (`srun --container-image=...`, enroot) and Slurm's own `oci` (`srun --container=BUNDLE`):
                 srun starts every rank inside the image; the batch script stays outside it.
  exec wrappers  `apptainer` (`apptainer exec --nv --bind ... IMAGE CMD`) and `charliecloud` (`ch-run -b ... IMAGE --
                 CMD`, which runs here in Apptainer's place): each rank's command is prefixed.
In every case the batch script runs outside the image, where Slurm's client is: it finds the rendezvous host and
does the requeue a rank asks for (hpcjobs.backends.slurm.runtimes). The renderers are there; this module is pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from hpcjobs.protocol.errors import UsageError, shown

RUNTIMES = ("none", "pyxis", "apptainer", "charliecloud", "oci")
WRAPPERS = ("apptainer", "charliecloud")
"""Runtimes that prefix each rank's command (exec wrappers), the others are srun flags."""
PATH_IMAGES = ("apptainer", "charliecloud", "oci")
"""Runtimes whose image is a path on the shared filesystem (a .sif, a directory, an OCI bundle). pyxis takes a
registry reference (`nvcr.io#nvidia/pytorch:24.05`) or, when it starts with `/` or `.`, a squashfs file."""
MOUNT_OPTIONS = ("ro", "rw")
_DIGEST = re.compile(r"@(sha256:[0-9a-f]{64})$")
CONTAINER_HINT = "see docs/how-to/containers.md"


def parse_mount(value: object, key: str) -> None:
    """One `HOST:CONTAINER[:ro|rw]` bind mount, both paths absolute; raises UsageError (profile load)."""
    parts = str(value).split(":")
    ok = (isinstance(value, str) and len(parts) in (2, 3) and all(p.startswith("/") for p in parts[:2])
          and (len(parts) == 2 or parts[2] in MOUNT_OPTIONS))
    if not ok:
        raise UsageError(f"{key} entry {shown(value)}: valid: HOST:CONTAINER or HOST:CONTAINER:ro, both absolute "
                         "paths, e.g. /scratch/data:/data:ro.", f"fix {key}")


@dataclass(frozen=True)
class Container:
    """The image every rank runs in (the profile's `container:` mapping; none: no container). The field metadata
    are the profile's constraints (see hpcjobs.profiles.cluster_profile)."""

    runtime: str = field(default="none", metadata={"choices": RUNTIMES})
    """How the ranks enter the image: `pyxis` (srun --container-image), `apptainer` (apptainer exec --nv),
    `charliecloud` (ch-run), `oci` (Slurm's srun --container=BUNDLE: one rank per node) or `none`."""
    image: str | None = None
    """The image: a registry reference or squashfs file for pyxis, a .sif or directory for apptainer, an unpacked
    image directory for charliecloud, a bundle directory for oci. `--container IMAGE` overrides it per job."""
    mounts: tuple[str, ...] = field(default=(), metadata={"parse": parse_mount, "max_items": 64})
    """Extra bind mounts, `HOST:CONTAINER[:ro]`, both absolute. The run folder's parent and the job's working
    folder (the code snapshot) are always mounted at their own paths."""
    workdir: str | None = None
    """The folder the ranks start in inside the image (default: the job's working folder, mounted)."""
    flags: tuple[str, ...] = ()
    """Extra runtime flags, as they are: srun flags for pyxis (`--container-remap-root`), `apptainer exec` flags
    (`--contain`), `ch-run` flags (`--no-passwd`)."""

    @property
    def enabled(self) -> bool:
        return self.runtime != "none"


@dataclass(frozen=True)
class Image:
    """The image one job runs in, checked: what the renderers need and what spec.json records."""

    runtime: str
    image: str
    mounts: tuple[str, ...]
    """Every bind mount (the automatic ones first), `HOST:CONTAINER[:ro]`."""
    workdir: str
    flags: tuple[str, ...] = ()
    digest: str | None = None
    """The image's content digest where the reference names one (`...@sha256:...`); see `digest_of`."""

    @property
    def wrapper(self) -> bool:
        return self.runtime in WRAPPERS

    def as_dict(self) -> dict[str, object]:
        return {"runtime": self.runtime, "image": self.image, "digest": self.digest, "mounts": list(self.mounts),
                "workdir": self.workdir, "flags": list(self.flags)}


def digest_of(image: str) -> str | None:
    """The digest a reference pins (`nvcr.io#nvidia/pytorch@sha256:...`). TODO: a tag (pyxis), a .sif or a
    directory has no digest knowable here without reading the whole image (a .sif's sha256 is seconds per GB, a
    registry tag needs the registry, which login nodes may not reach): recorded as None, the image path/tag only."""
    found = _DIGEST.search(image)
    return found.group(1) if found else None


def _check_image(runtime: str, image: str, where: str) -> None:
    path_like = runtime in PATH_IMAGES or image.startswith(("/", "."))
    if "\n" in image or "\r" in image or not image.strip():
        raise UsageError(f"{where} {shown(image)}: valid: a single-line image name or path.", CONTAINER_HINT)
    if path_like and not Path(image).exists():
        what = {"oci": "an OCI bundle directory (config.json and rootfs/)", "charliecloud": "an unpacked image "
                "directory (ch-convert)", "apptainer": "a .sif file or sandbox directory"}.get(runtime, "a file")
        raise UsageError(f"{where} {shown(image)} does not exist here; valid for runtime {runtime}: {what} on a "
                         "filesystem the nodes share.", "give its absolute path as the nodes see it (build it "
                         "first, e.g. `apptainer build x.sif docker://...`), or a registry reference with pyxis.")
    if runtime == "oci" and not (Path(image) / "config.json").is_file():
        raise UsageError(f"{where} {shown(image)} has no config.json; valid for runtime oci: an OCI bundle "
                         "directory (config.json and rootfs/).", "make one with `runc spec` beside a rootfs/ folder.")


def _check_oci(gpus_per_node: int, c: Container) -> None:
    """Slurm 22.05's --container starts one task per node per step (`Task count specification invalid`)."""
    if gpus_per_node > 1:
        raise UsageError(f"--gpus {gpus_per_node} per node with container runtime oci: Slurm's --container starts "
                         "one task per node per step (22.05); valid: --gpus 1.", "ask for --gpus 1 and more "
                         "--nodes, or use runtime charliecloud or apptainer (an exec wrapper: any ranks per node).")
    if c.mounts:
        raise UsageError(f"container.mounts {shown(list(c.mounts))} with runtime oci: srun --container takes no "
                         "mounts; valid: none (the bundle's config.json holds them).", "add them to the bundle's "
                         "config.json `mounts`, with the run folder's and the project's paths.")


def _check_mount_options(c: Container) -> None:
    if c.runtime == "charliecloud" and any(m.count(":") == 2 for m in c.mounts):
        raise UsageError(f"container.mounts {shown(list(c.mounts))}: ch-run binds take no :ro/:rw; valid: "
                         "HOST:CONTAINER.", "drop the option (ch-run's binds follow the host's permissions).")


def _check_mount_points(image: Image) -> None:
    """ch-run binds onto folders the image already has (it cannot make them: the image is mounted read-only;
    measured, ch-run 0.31: `can't mkdir: IMAGE/work/main: Read-only file system`, from inside the job)."""
    if image.runtime != "charliecloud" or not Path(image.image).is_dir():
        return
    missing = [m.split(":")[1] for m in image.mounts if not (Path(image.image) / m.split(":")[1].lstrip("/")).is_dir()]
    if missing:
        raise UsageError(f"container image {shown(image.image)} has no folder {shown(missing[0])} to bind onto; "
                         f"valid: an image with a folder for each mount ({', '.join(missing)}).", "make them once "
                         f"where the image is built: mkdir -p {' '.join(image.image + m for m in missing)}")


def resolve(c: Container, given: str | None, gpus_per_node: int, auto_mounts: list[str],
            workdir: str) -> Image | None:
    """The job's image (None: no container), or UsageError: a `--container` without a runtime, no image, an
    image path that does not exist here, oci with more than one rank per node. `auto_mounts`: host folders the
    ranks need at their own paths (run folder, code snapshot)."""
    if not c.enabled:
        if given is not None:
            raise UsageError(f"--container {shown(given)}: the profile has no container runtime; valid: a profile "
                             f"with container.runtime one of {', '.join(RUNTIMES[1:])}.",
                             "add `container: {runtime: apptainer}` (or pyxis, charliecloud, oci) to the profile.")
        return None
    image = given if given is not None else c.image
    where = "--container" if given is not None else "container.image"
    if image is None:
        raise UsageError(f"container runtime {c.runtime} without an image; valid: container.image in the profile "
                         "or --container IMAGE.", "e.g. --container /shared/images/train.sif")
    _check_image(c.runtime, image, where)
    if c.runtime == "oci":
        _check_oci(gpus_per_node, c)
    _check_mount_options(c)
    mounts = [f"{m}:{m}" for m in _outermost(auto_mounts)] if c.runtime != "oci" else []
    found = Image(c.runtime, image, tuple(mounts + list(c.mounts)), c.workdir or workdir, c.flags, digest_of(image))
    _check_mount_points(found)
    return found


def _outermost(folders: list[str]) -> list[str]:
    """The folders, without those inside another one (a mount of the parent holds them), in the order given."""
    out: list[str] = []
    for f in folders:
        if not any(Path(f).is_relative_to(o) for o in out):
            out = [o for o in out if not Path(o).is_relative_to(f)] + [f]
    return out
