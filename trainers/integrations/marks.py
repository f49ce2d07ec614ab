"""hpcjobs's marks on the checkpoint folders a user's training library writes (`checkpoint-N`), shared by every
integration (hf_trainer, lightning, accelerate_loop): which folders a save left incomplete, which complete one is
newest, and the two marks that tell them apart.

A save begins with `.hpcjobs-pending` in its folder (rank 0, before any file of the save). Once the library has
written its files, every rank fsyncs what is in the folder and, once all have, rank 0 writes `hpcjobs-complete.json`
(fsynced) and drops the pending mark: only then is the checkpoint complete. A save that dies halfway leaves the
pending mark and no completion mark; the next start moves it aside to `incomplete/` with one line and resumes the
newest complete one before it. A folder with neither mark was written without hpcjobs and is taken as it is.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from hpcjobs.protocol.atomic import fsync_path, write_atomic
from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.runfolder import RunFolder, write_json_atomic
from trainers import ddp_buckets, ranklog
from trainers.faults import maybe_die
from trainers.integrations.account import ACCOUNT

COMPLETE = "hpcjobs-complete.json"
PENDING = ".hpcjobs-pending"
ASIDE = "incomplete"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()] \
        if output_dir.is_dir() else []
    return sorted(found)


def incomplete(folder: Path) -> bool:
    return (folder / PENDING).exists() and not (folder / COMPLETE).exists()


def settle(root: Path, owned: bool = False) -> Path | None:
    """The newest complete checkpoint of `root`; rank 0 moves the incomplete ones aside, once every rank chose.
    `owned`: only hpcjobs writes into `root`, so a folder without the completion mark is incomplete even without the
    pending mark (a rank may write its files before rank 0 wrote that mark, and die)."""
    found = checkpoints(root)
    bad = [p for _, p in found if incomplete(p) or (owned and not (p / COMPLETE).is_file())]
    newest = next((p for _, p in reversed(found) if p not in bad), None)
    barrier()
    if bad and rank() == 0:
        aside = root / ASIDE
        aside.mkdir(exist_ok=True)
        for p in bad:
            target, n = aside / p.name, 0
            while target.exists():
                n += 1
                target = aside / f"{p.name}.{n}"
            os.rename(p, target)
            say(f"{p} was left incomplete by a save that did not finish; moved to {target}")
    barrier()
    return newest


def mark_pending(folder: Path) -> None:
    """Rank 0, before the save writes anything into `folder`. A save into a folder an earlier save completed (a run
    that went back to an earlier step) takes its completion mark away: until it completes, its files are mixed."""
    ACCOUNT.save_began(folder)  # saves.jsonl: how long the loop waits for it (integrations/account.py)
    if rank() == 0:
        ddp_buckets.record()  # the layout a resume from this save needs (trainers/ddp_buckets.py)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / PENDING).touch()
        (folder / COMPLETE).unlink(missing_ok=True)


def mark_complete(folder: Path, step: int) -> None:
    """Every rank fsyncs what is in the folder (its own files among them); once all have, rank 0 writes the mark
    and records the checkpoint in the run folder (found again by a start whose output folder has another name)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fsync_path(path)
    maybe_die("save-written", step)  # fault injection (tests): a rank killed inside the save
    barrier()
    if rank() == 0:
        run = run_folder()
        mark = {"step": step, **({"run": str(run.path.resolve())} if run is not None else {})}
        write_atomic(folder / COMPLETE, json.dumps(mark), durable=True)
        (folder / PENDING).unlink(missing_ok=True)
        if run is not None:
            write_json_atomic(run.script_checkpoint, {"path": str(folder.resolve()), "step": step})
    ACCOUNT.save_done(folder, step)
    barrier()


def written_by(folder: Path) -> str | None:
    """The run folder whose start completed `folder` (its completion mark says), None when unknown: written without
    hpcjobs, by an hpcjobs that did not record it, or outside a run folder."""
    try:
        run = json.loads((folder / COMPLETE).read_text()).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def another_run(folder: Path) -> str | None:
    """The other run folder that completed `folder`, when this start runs in a run folder and it is not that one."""
    here, there = run_folder(), written_by(folder)
    return there if here is not None and there is not None and there != str(here.path.resolve()) else None


def run_folder() -> RunFolder | None:
    contract = LaunchContract.current()
    return RunFolder(contract.run_dir) if contract and contract.run_dir else None


def say(line: str) -> None:
    ranklog.say(f"hpcjobs: {line}")  # rank 0's (RANK)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def barrier() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.barrier()
