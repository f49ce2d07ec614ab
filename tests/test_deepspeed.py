"""An unchanged Hugging Face Trainer script with DeepSpeed (the Trainer's `deepspeed=` config: ZeRO-2, ZeRO-3,
ZeRO-2 with the optimizer offloaded to the CPU), 2 local ranks on CPU and gloo, under hpcjobs: one Ctrl-C saves at
the step all ranks agree on (the Trainer's checkpoint-N with DeepSpeed's global_stepN inside, its per-rank ZeRO
shards among them), the same command resumes there, and the losses step by step and the final weights equal an
uninterrupted run's. A resume at another world size is refused in one line before DeepSpeed loads the shards."""

from __future__ import annotations

from pathlib import Path

import ctrl_c_runs
import pytest
from test_hf_trainer import command, loss_lines, same_as

from conftest import REPO, hpcjobs
from trainers.integrations import marks

pytest.importorskip("deepspeed")
CONFIGS = REPO / "tests" / "scripts"
SLOWER = ("--sample_seconds", "0.01")  # ~40 ms a step: the Ctrl-C lands mid-run, not after the 30th step


def deepspeed(config: str) -> tuple[str, ...]:
    return ("--deepspeed", str(CONFIGS / config), *SLOWER)


@pytest.mark.train
@pytest.mark.parametrize("config", ["ds_zero2.json", "ds_zero3.json",
                                    pytest.param("ds_zero2_offload.json", marks=pytest.mark.slow)])
def test_ctrl_c_saves_and_the_same_command_resumes_exactly(tmp_path: Path, config: str) -> None:
    done = hpcjobs(*command(tmp_path, "twin", *deepspeed(config)), cwd=tmp_path, timeout=900)
    assert done.returncode == 0 and "AFTER TRAIN" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    first = ctrl_c_runs.interrupt(command(tmp_path, "out", *deepspeed(config)), tmp_path, loss_lines, 7)
    out = tmp_path / "out"
    saved = [n for n, p in marks.checkpoints(out) if (p / marks.COMPLETE).is_file()]
    assert saved and "AFTER TRAIN" not in first, first[-3000:]
    stop = saved[-1]
    assert (out / f"checkpoint-{stop}" / f"global_step{stop}").is_dir()  # DeepSpeed's own shards, per rank
    again = hpcjobs(*command(tmp_path, "out", *deepspeed(config)), cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from {out / f'checkpoint-{stop}'}" in again.stdout
    same_as(out, tmp_path / "twin")


@pytest.mark.train
def test_a_resume_at_another_world_size_is_refused_in_one_line(tmp_path: Path) -> None:
    first = ctrl_c_runs.interrupt(command(tmp_path, "out", *deepspeed("ds_zero2.json")), tmp_path, loss_lines, 7)
    assert [n for n, p in marks.checkpoints(tmp_path / "out") if (p / marks.COMPLETE).is_file()], first[-3000:]
    again = hpcjobs(*command(tmp_path, "out", *deepspeed("ds_zero2.json"), ranks=1), cwd=tmp_path, timeout=900)
    said = [line for line in again.stderr.splitlines() + again.stdout.splitlines() if "universal" in line]
    assert again.returncode == 2 and len(said) == 1, again.stdout[-3000:] + again.stderr[-3000:]
    assert "2 ranks" in said[0] and "1 rank" in said[0] and "ds_to_universal" in said[0]
