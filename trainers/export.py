"""`python -m trainers.export RUN [--step N] -o model.pt|model.safetensors [--force]`: one file of a run's model
weights, for inference or for loading elsewhere (`model.load_state_dict(torch.load(FILE))`). Offline: no process
group, no GPU; the checkpoint is read without executing pickled code. `hpcjobs export` runs this (hpcjobs itself
never imports torch).

Only finished checkpoints are exported (step-N/ with its FINISHED marker); the newest unless --step names one.
Written to a temporary name and renamed: a file of that name is always whole. An existing file is kept unless
--force. Bad input (no such run folder, no finished checkpoint, a step that was not kept, an unknown suffix, a
missing safetensors package: `pip install safetensors`) is one line with a HINT and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from hpcjobs.protocol.atomic import replacing
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.paths import refuse_output
from hpcjobs.protocol.runfolder import RunFolder
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

FORMATS = (".pt", ".pth", ".safetensors")
USAGE_EXIT = 2


class ExportError(ValueError):
    """Bad input: the message is one line with a HINT."""


def pick(run: RunFolder, step: int | None) -> checkpoint.CheckpointRef:
    if not run.path.is_dir():
        raise ExportError(f"run folder {run.path} does not exist. HINT: give a run folder (RUN/ holds checkpoints/) "
                          "or a job id from `hpcjobs list`.")
    refs = checkpoint.finished(run.checkpoints)
    if not refs:
        raise ExportError(f"{run.path} holds no finished checkpoint (looked in {run.checkpoints}). HINT: a run "
                          "writes one every --ckpt-every steps, and at a stop and at its end.")
    if step is None:
        return refs[-1]
    found = [r for r in refs if r.step == step]
    if not found:
        raise ExportError(f"--step {step}: {run.path} keeps finished checkpoints of steps "
                          f"{', '.join(str(r.step) for r in refs)}; valid: one of those. HINT: --keep and "
                          "--keep-best decide which are kept; leave --step out for the newest.")
    return found[0]


def model_state(ref: checkpoint.CheckpointRef) -> dict[str, torch.Tensor]:
    try:
        weights = model_weights(ref)
    except checkpoint.CorruptCheckpoint as e:
        raise ExportError(f"{ref.path} cannot be read: {e}. HINT: export another step (--step).") from None
    return {k: v.detach().contiguous() for k, v in weights.items()}


def check_output(out: Path, force: bool) -> None:
    """Before anything is read: an -o that would be refused is refused at once."""
    if out.suffix not in FORMATS:
        raise ExportError(f"-o {out}: the suffix {out.suffix or '(none)'} is not a format; valid: "
                          f"{', '.join(FORMATS)}. HINT: e.g. -o model.safetensors")
    try:
        refuse_output(out, force, "-o", "model.safetensors")
    except UsageError as e:
        raise ExportError(e.one_line()) from None


def write(state: dict[str, torch.Tensor], out: Path, force: bool) -> None:
    check_output(out, force)
    with replacing(out) as tmp:
        if out.suffix == ".safetensors":
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise ExportError("-o *.safetensors needs the safetensors package. HINT: pip install "
                                  "safetensors, or -o model.pt") from None
            save_file(state, str(tmp))
        else:
            torch.save(state, tmp)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainers.export", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest finished one)")
    p.add_argument("-o", "--output", required=True, help="the file: .pt/.pth (torch.save) or .safetensors")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    ns = p.parse_args(argv)
    try:
        out = Path(ns.output)
        check_output(out, ns.force)
        ref = pick(RunFolder(ns.run_dir), ns.step)
        state = model_state(ref)
        write(state, out, ns.force)
    except ExportError as e:
        print(f"hpcjobs export: error: {e}", file=sys.stderr)
        return USAGE_EXIT
    except OSError as e:
        print(f"hpcjobs export: error: cannot write {ns.output} ({e.strerror}); nothing was written. HINT: pick a "
              "writable -o.", file=sys.stderr)
        return 1
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"exported step {ref.step} of {ns.run_dir}: {len(state)} tensors, {size / 2**20:.1f} MiB -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
