"""`--model config.json` on `hpcjobs submit` (issue 41, items 2 and 3, what was left): the user's model's memory plan in
`--dry-run --json` (it was in the text dry run only), and the checkpoint-window line for the model's stop checkpoint
(it was said for the bundled LM and in `plan` only)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import REPO, hpcjobs

DATA = REPO / "tests" / "data" / "hf"
SLOW = "scheduler: slurm\ngpus_per_node: 8\ngpu_memory: 80GB\nmax_nodes: 64\npreemption:\n  seconds_before: 120\n"
MODEL = str(DATA / "llama-2-70b.json")


def setup(tmp_path: Path, rate: str) -> tuple[str, str]:
    profile = tmp_path / f"cluster-{rate}.yaml"
    profile.write_text(SLOW + f"storage:\n  write_gb_per_s: {rate}\n")
    script = tmp_path / "train.py"
    script.write_text("import argparse\nargparse.ArgumentParser().add_argument('--model')\n")
    return str(profile), str(script)


def test_dry_run_json_carries_the_models_plan_as_plan_computes_it(tmp_path: Path) -> None:
    profile, script = setup(tmp_path, "2")
    out = hpcjobs("submit", "--profile", profile, "--nodes", "8", "--dry-run", "--json", "--no-snapshot",
                  "--model", MODEL, script, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)["model_plan"]
    plan = json.loads(hpcjobs("plan", "--model", MODEL, "--profile", profile, "--nodes", "8", "--json").stdout)
    assert found["plan"] == plan["plan"] and found["what"] == plan["what"], (found, plan)
    assert (found["model_type"], found["parameters"], found["checkpoint_bytes"]) == ("llama", 68_976_648_192,
                                                                                    12 * 68_976_648_192)
    assert found["gpu_memory"] == 80 * 2**30 and found["fits"] is False  # ddp, unsharded: as `plan` says
    assert "stop checkpoint" in found["checkpoint_warning"]
    without = json.loads(hpcjobs("submit", "--profile", profile, "--dry-run", "--json", "--no-snapshot", script,
                                 cwd=tmp_path).stdout)
    assert "model_plan" not in without


def test_submit_with_model_says_the_checkpoint_window_in_one_line(tmp_path: Path) -> None:
    profile, script = setup(tmp_path, "2")
    out = hpcjobs("submit", "--profile", profile, "--nodes", "8", "--dry-run", "--no-snapshot", "--model", MODEL,
                  script, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    said = [ln for ln in out.stderr.splitlines() if "stop checkpoint" in ln]
    assert len(said) == 1 and said[0].startswith(f"hpcjobs submit: warning: the stop checkpoint of {MODEL} (llama) "
                                                 "is about 828 GB: at 2 GB/s"), out.stderr
    assert "HINT: preemption.seconds_before 450 or more" in said[0]
    fast, _ = setup(tmp_path, "10")
    quiet = hpcjobs("submit", "--profile", fast, "--nodes", "8", "--dry-run", "--no-snapshot", "--model", MODEL,
                    script, cwd=tmp_path)
    assert quiet.returncode == 0 and "stop checkpoint" not in quiet.stderr, quiet.stderr
