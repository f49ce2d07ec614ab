"""A code snapshot per submission: the project's files, copied once into a content-addressed folder beside the run
folders, so every rank and every restart (a requeue days later) runs the code that was submitted, not whatever the
working tree holds by then. Torch-free.

The project is the git work tree around the folder hpcjobs runs from (its tracked files as they are on disk, edits
included, plus untracked files git does not ignore), or that folder alone outside git (minus the usual caches and
environments). `plan` reads the files and decides (pure but for reading); `materialize` is the one side effect.

RUNS/.snapshots/<digest>/             the copy; <digest> is the sha256 of every path, mode and content
RUNS/.snapshots/<digest>/.hpcjobs-snapshot.json   what was copied from where (the git commit, dirty or not)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from hpcjobs.jobs.store import store_path
from hpcjobs.protocol.errors import RuntimeFailure, UsageError

SNAPSHOTS = ".snapshots"
"""The folder of snapshots, inside the runs folder (shared with the nodes, as run folders are)."""
MANIFEST = ".hpcjobs-snapshot.json"
MAX_BYTES = 200 * 2**20
MAX_FILES = 20_000
DIFF_MAX = 256 * 2**10
"""The most of `git diff` spec.json keeps (the snapshot itself holds every byte)."""
PLAIN_EXCLUDES = frozenset({".git", ".hg", ".svn", ".venv", "venv", "env", "__pycache__", ".mypy_cache",
                            ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", "node_modules", "wandb", "mlruns",
                            ".tox", ".nox", "build", "dist", SNAPSHOTS})
"""Folder names a plain (non-git) copy leaves out: environments, caches, trackers' local stores."""
CREDENTIAL_DIRS = frozenset({".ssh", ".aws", ".azure", ".gnupg", ".kube", ".docker"})
_CREDENTIAL_FILE = re.compile(r"\.env(?:\.(?!example$|sample$|template$).+)?|\.netrc|_netrc|\.pgpass|\.pypirc|\.npmrc"
                              r"|\.git-credentials|\.boto|\.s3cfg|.+\.(?:pem|key|p12|pfx|jks|keystore)"
                              r"|id_(?:rsa|dsa|ecdsa|ed25519)(?:\.pub)?|credentials(?:\.json)?"
                              r"|application_default_credentials\.json|.*service[-_]?account.*\.json")
"""Names a plain (non-git) copy leaves out, and says so: files that commonly hold credentials (issue 39)."""
HINT = "pass --no-snapshot to run from the working tree, or leave big files out of the project (.gitignore)."
PLAIN_HINT = ("pass --no-snapshot to run from the working tree, or move the big files out of this folder (outside git "
              "hpcjobs copies the folder it runs from), or run from a git repository whose .gitignore leaves them out.")
PLAIN_FILE_MAX = 8 * 2**20
"""Outside git, a larger file is data or weights, not code: left out of the copy, and said."""
DATA_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".onnx")
"""Outside git, names of model weights (what a run writes, never code): left out of the copy whatever their size,
and said. Data files are left out only by size: a script may read a small one by a relative path."""


@dataclass(frozen=True)
class Snapshot:
    """What a submission's snapshot holds and where it goes; decided before anything is copied."""

    source: str
    """The project's root (the git work tree, or the folder hpcjobs ran from)."""
    files: tuple[str, ...]
    """Paths relative to `source`, sorted."""
    digest: str
    folder: str
    """Where the copy lives: RUNS/.snapshots/<digest>."""
    git_commit: str | None = None
    git_dirty: bool = False
    git_diff: str = ""
    untracked: tuple[str, ...] = field(default=())
    skipped: tuple[str, ...] = field(default=())
    data: tuple[str, ...] = field(default=())
    """Outside git: the data and weights left out (their paths and sizes), said at submit."""
    """Files outside git left out because they commonly hold credentials (.env, .netrc, *.pem, id_rsa, ...)."""

    def where(self, path: str) -> str:
        """`path` (absolute, under the source) as it is in the snapshot; a path outside the project stays as is."""
        try:
            rel = Path(path).resolve().relative_to(Path(self.source).resolve())
        except ValueError:
            return path
        return str(Path(self.folder) / rel) if str(rel) != "." else self.folder

    def origin(self, path: str) -> str:
        """Where `path` (in the snapshot, as `where` gave it) came from in the project; as is if not in the snapshot."""
        try:
            rel = Path(path).relative_to(self.folder)
        except ValueError:
            return path
        return str(Path(self.source) / rel) if str(rel) != "." else self.source

    def as_dict(self) -> dict[str, object]:
        diff = self.git_diff if len(self.git_diff) <= DIFF_MAX else self.git_diff[:DIFF_MAX] + "\n[... cut]\n"
        return {"folder": self.folder, "source": self.source, "files": len(self.files), "digest": self.digest,
                "git_commit": self.git_commit, "git_dirty": self.git_dirty, "git_diff": diff,
                "untracked": list(self.untracked)}


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _git_files(root: Path) -> tuple[list[str], list[str]] | None:
    """The work tree's tracked files that exist, and its untracked files git does not ignore."""
    tracked = _git(["ls-files", "-z", "--cached"], root)
    others = _git(["ls-files", "-z", "--others", "--exclude-standard"], root)
    if tracked is None or others is None:
        return None
    present = [p for p in dict.fromkeys(tracked.split("\0")) if p and os.path.lexists(root / p)]
    return present, [p for p in others.split("\0") if p]


def _is_run_folder(path: Path) -> bool:
    """A run folder (hpcjobs writes spec.json and specs/ into each): never code, and written while we copy."""
    return (path / "spec.json").is_file() and (path / "specs").is_dir()


def _is_output(path: Path) -> bool:
    """What a training run wrote, never code, whoever wrote it: a run folder; a checkpoint folder (Hugging Face's
    checkpoint-N, Lightning's lightning_logs, a `checkpoints` folder with no Python in it); a folder a trainer
    saved into (Hugging Face's trainer_state.json, Hydra's .hydra). Outside git nothing else tells them apart, and
    copied they grew the snapshots by every earlier run's weights (501 MB after two runs of a Trainer script)."""
    name = path.name
    if _is_run_folder(path) or name == "lightning_logs" or re.fullmatch(r"checkpoint-\d+", name):
        return True
    if name == "checkpoints" and not any(path.glob("*.py")):
        return True
    return (path / "trainer_state.json").is_file() or (path / ".hydra").is_dir()


def _plain_files(root: Path, skipped: list[str], data: list[str]) -> list[str]:
    """Outside git: the folder's files, less caches, environments, outputs, credentials (`skipped`) and data or
    weights (`data`: by name, or over PLAIN_FILE_MAX; issue 38: a 210 MiB out/model.pt beside the script made the
    next submit fail)."""
    files = []
    for folder, dirs, names in os.walk(root):
        skipped += [os.path.relpath(os.path.join(folder, d), root) + "/" for d in dirs if d in CREDENTIAL_DIRS]
        dirs[:] = sorted(d for d in dirs if d not in PLAIN_EXCLUDES | CREDENTIAL_DIRS
                         and not d.endswith(".egg-info") and not _is_output(Path(folder, d)))
        rel = [os.path.relpath(os.path.join(folder, n), root) for n in names if not n.endswith((".pyc", ".pyo"))]
        skipped += [p for p in rel if _CREDENTIAL_FILE.fullmatch(os.path.basename(p))]
        for p in (p for p in rel if not _CREDENTIAL_FILE.fullmatch(os.path.basename(p))):
            size = (root / p).lstat().st_size
            if p.lower().endswith(DATA_SUFFIXES) or size > PLAIN_FILE_MAX:
                data.append(f"{p} ({size / 2**20:.1f} MiB)")
            else:
                files.append(p)
    return sorted(files)


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _real(path: Path) -> Path:
    """Where a path leads; the path itself where it leads nowhere (a symlink loop: kept, and copied, as a link)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):  # Path.resolve's symlink loop (RuntimeError until Python 3.13)
        return path


def _largest(sizes: list[tuple[int, str]], n: int = 3) -> str:
    """The `n` largest entries of the project's top level (a folder by all it holds) and its largest file: where
    the bytes are, as one line. `sizes`: (bytes, relative path), sorted."""
    tops: dict[str, int] = {}
    for size, rel in sizes:
        head, sep, _ = rel.partition("/")
        tops[head + sep] = tops.get(head + sep, 0) + size
    named = sorted(tops.items(), key=lambda kv: -kv[1])[:n]
    size, rel = sizes[-1]
    return ", ".join(f"{p} ({b / 2**20:.0f} MiB)" for p, b in named) + f"; largest file {rel} ({size / 2**20:.0f} MiB)"


def _digest(root: Path, files: list[str]) -> tuple[str, int]:
    h = hashlib.sha256()
    total = 0
    for rel in files:
        path = root / rel
        h.update(rel.encode("utf-8", "surrogateescape") + b"\0")
        if path.is_symlink():
            h.update(b"L" + os.readlink(path).encode("utf-8", "surrogateescape") + b"\0")
            continue
        h.update(b"X" if os.access(path, os.X_OK) else b"F")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                total += len(block)
        h.update(b"\0")
    return h.hexdigest()[:24], total


def plan(workdir: Path, runs_root: Path) -> Snapshot:
    """Decide the snapshot of the project around `workdir`: its files and their digest. Reads; writes nothing.
    Refuses (UsageError) a project over the size limits."""
    top = _git(["rev-parse", "--show-toplevel"], workdir)
    root = Path(top.strip()) if top else workdir
    found = _git_files(root) if top else None
    skipped: list[str] = []
    data: list[str] = []
    tracked, untracked = found if found is not None else (_plain_files(root, skipped, data), [])
    hint = HINT if found is not None else PLAIN_HINT
    # Never the snapshots, the run folders or the job store, when they lie inside the project (a runs folder that
    # holds the project, as a scratch folder may, keeps the project's files).
    runs = runs_root.resolve()
    keep_out = [runs / SNAPSHOTS, store_path().parent.resolve()]
    if runs != root.resolve() and _under(runs, root.resolve()):
        keep_out.append(runs)
    files = sorted(p for p in {*tracked, *untracked}
                   if not any(_under(_real(root / p), k) for k in keep_out)
                   and ((root / p).is_file() or (root / p).is_symlink()))
    if len(files) > MAX_FILES:
        raise UsageError(f"the code snapshot of {root} would hold {len(files)} files; valid: at most {MAX_FILES}.",
                         hint)
    sizes = sorted(((root / p).lstat().st_size, p) for p in files)
    total = sum(s for s, _ in sizes)
    if total > MAX_BYTES:
        raise UsageError(f"the code snapshot of {root} would copy {total / 2**20:.0f} MiB (largest: "
                         f"{_largest(sizes)}); valid: at most {MAX_BYTES // 2**20} MiB.", hint)
    digest, _ = _digest(root, files)
    commit = (_git(["rev-parse", "HEAD"], root) or "").strip() or None if top else None
    diff = (_git(["diff", "HEAD", "--no-color"], root) or "") if commit else ""
    untracked_kept = tuple(p for p in untracked if p in set(files))
    return Snapshot(source=str(root), files=tuple(files), digest=digest,
                    folder=str(runs_root.resolve() / SNAPSHOTS / digest), git_commit=commit,
                    git_dirty=bool(diff or untracked_kept), git_diff=diff, untracked=untracked_kept,
                    skipped=tuple(sorted(skipped)), data=tuple(sorted(data)))


def materialize(snap: Snapshot) -> Path:
    """Copy the files into the snapshot's folder, unless an identical snapshot is there already (two submissions
    of the same tree share one copy). Copied into a temporary folder, then renamed: a folder of that name is always
    whole. Files that changed since `plan` read them are copied as they are now only if the digest still matches."""
    folder = Path(snap.folder)
    if (folder / MANIFEST).is_file():
        return folder
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    root = Path(snap.source)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, mode=0o700)  # the owner's alone whatever the umask; a group's: take_snapshot
        for rel in snap.files:
            src, dst = root / rel, tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
            else:
                shutil.copy2(src, dst)
        digest, _ = _digest(tmp, list(snap.files))
        if digest != snap.digest:
            raise RuntimeFailure(f"the project {root} changed while its snapshot was being copied; nothing was "
                                 "submitted.", "submit again once the files are saved.")
        (tmp / MANIFEST).write_text(json.dumps({k: v for k, v in snap.as_dict().items() if k != "git_diff"},
                                               indent=2, sort_keys=True))
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / MANIFEST).is_file():  # not a concurrent submission of the same tree that won
                raise
    except OSError as e:
        raise RuntimeFailure(f"cannot write the code snapshot {folder} ({e.strerror}); nothing was submitted.",
                             "pick a writable runs folder, or pass --no-snapshot.") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
