"""`hpcjobs plan --model config.json` (issue 41 item 2): a Hugging Face decoder's memory plan from its config.json, the
bundled LM's arithmetic over the model's own counts. Checked against transformers' real model classes on the CPU
(bench/hf_memplan.py, bench/results/hf_memplan.json) and on the public 7-8B shapes (tests/data/hf/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.planning.memory_plan import GIB, Setup, plan
from hpcjobs.request.hf_config import model_shape

DATA = REPO / "tests" / "data" / "hf"
RESULTS = REPO / "bench" / "results" / "hf_memplan.json"
SEVEN_B = ("llama-3-8b", "qwen2.5-7b", "mistral-7b")
PUBLISHED = {"llama-3-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512, "mistral-7b": 7_248_023_552,
             "gpt2": 124_439_808}
"""Parameter counts the models' own cards and safetensors indexes give (GPT-2: transformers' GPT2LMHeadModel)."""
TOLERANCE = 0.05


@pytest.fixture
def h100(tmp_path: Path) -> str:
    profile = tmp_path / "h100.yaml"
    profile.write_text("scheduler: slurm\ngpus_per_node: 8\ngpu_memory: 80GB\nmax_nodes: 64\n")
    return str(profile)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_ones(name: str) -> None:
    shape, _ = model_shape(str(DATA / f"{name}.json"))
    assert shape.params == PUBLISHED[name]


@pytest.mark.parametrize("name", SEVEN_B)
def test_7b_fits_2x8x80gb_under_fsdp_and_ddp_is_refused_with_the_flags_that_fit(name: str, h100: str) -> None:
    common = ["plan", "--model", str(DATA / f"{name}.json"), "--profile", h100, "--nodes", "2", "--gpus", "8"]
    fsdp = hpcjobs(*common, "--strategy", "fsdp", "--activation-checkpointing")
    assert fsdp.returncode == 0, fsdp.stderr
    assert "fsdp over 16 ranks" in fsdp.stdout and ": fits" in fsdp.stdout, fsdp.stdout
    ddp = hpcjobs(*common, "--strategy", "ddp")
    assert ddp.returncode == 1 and "does NOT fit" in ddp.stdout, ddp
    hint = ddp.stdout.strip().splitlines()[-1]
    assert hint.startswith("HINT: --strategy fsdp") and hint.endswith("would fit"), hint
    fix = hint.removeprefix("HINT: ").split("; or ")[0].removesuffix(" would fit").split()
    assert hpcjobs(*common, *fix).returncode == 0, fix  # the flags named do fit


def test_json_has_the_per_rank_plan_and_the_verdict(h100: str) -> None:
    out = hpcjobs("plan", "--model", str(DATA / "qwen2.5-7b.json"), "--profile", h100, "--nodes", "2",
                  "--strategy", "fsdp", "--activation-checkpointing", "--batch-size", "4", "--seq-len", "4096",
                  "--json")
    found = json.loads(out.stdout)
    assert found["fits"] is True and found["gpu_memory"] == 80 * GIB and found["setup"]["ranks"] == 16
    assert {"weights", "gradients", "optimizer", "activations", "working", "transient", "total"} <= set(found["plan"])
    assert found["logits"] == 4 * 4096 * 152064 * 4  # the fp32 log-softmax of a 152K vocabulary


def test_without_a_profile_nothing_is_judged() -> None:
    out = hpcjobs("plan", "--model", str(DATA / "gpt2.json"))
    assert out.returncode == 0 and "not checked: no --profile" in out.stdout, out


@pytest.mark.parametrize(("text", "said"), [
    (None, "no such file"), ("not json", "is not JSON"), ('{"model_type": "bert"}', "is not a decoder's config"),
    ('{"model_type": "falcon", "architectures": ["FalconForCausalLM"]}', "has model_type 'falcon'"),
    ('{"model_type": "llama", "hidden_size": 64}', "has no num_hidden_layers"), ("[1]", "holds a JSON list"),
])
def test_bad_configs_are_refused_in_one_line(tmp_path: Path, text: str | None, said: str) -> None:
    path = tmp_path / "config.json"
    if text is not None:
        path.write_text(text)
    out = hpcjobs("plan", "--model", str(path))
    assert out.returncode == 2 and out.stdout == "", out
    line = out.stderr.strip()
    assert "\n" not in line and said in line and "valid:" in line and "HINT:" in line, line


def test_a_sequence_past_the_learned_positions_is_refused() -> None:
    out = hpcjobs("plan", "--model", str(DATA / "gpt2.json"), "--seq-len", "4096")
    assert out.returncode == 2 and "--seq-len 4096; valid: 1 to 1024" in out.stderr, out


def test_a_config_read_as_a_module() -> None:
    """The shape under the plan, without the CLI: Llama-3-8B's GQA k/v (8 of 32 heads) and untied head."""
    shape, cfg = model_shape(str(DATA / "llama-3-8b.json"))
    assert cfg["model_type"] == "llama" and shape.vocab == 128256 and shape.n_layer == 32
    assert shape.block_params == 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    with pytest.raises(UsageError, match="no such file"):
        model_shape(str(DATA / "absent.json"))
    setup = Setup(strategy="fsdp", ranks=16, micro_batch=8, seq_len=2048, activation_checkpointing=True)
    assert plan(shape, setup).total <= 80 * GIB < plan(shape, Setup(ranks=16, micro_batch=8)).total


def test_plan_imports_no_torch() -> None:
    code = ("import sys; from hpcjobs.cli import main; main(['plan', '--model', sys.argv[1], '--json']); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code, str(DATA / "llama-3-8b.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_recorded_measurement_is_within_5_percent() -> None:
    """bench/hf_memplan.py's rows: four families, ddp and fsdp, fp32 and bf16, no, full and selective activation
    checkpointing, the parameters counted exactly. With checkpointing the step peaks in the loss's forward or
    backward or in a block's backward (the phases the plan counts: checkpointed_moments); every row names its
    phase (issue 41: three checkpointed rows were at 0.938-1.059 when the plan had only the loss's backward and the
    end of the backward, and the CPU's unfused AdamW was measured)."""
    rows = json.loads(RESULTS.read_text())["rows"]
    assert {r["model"] for r in rows} >= {"llama", "qwen2", "mistral", "gpt2"}
    assert {r["strategy"] for r in rows} == {"ddp", "fsdp"}
    assert all(r["params"] == r["params_planned"] for r in rows)
    off = {f"{r['model']} {r['strategy']}×{r['ranks']} {r['precision']} AC={r['ac_mode']} "
           f"{r['batch']}×{r['seq_len']}": round(r["ratio"], 3) for r in rows}
    assert sum(not r["activation_checkpointing"] for r in rows) >= 12
    assert all(abs(v - 1) <= TOLERANCE for v in off.values()), off
    assert {r["ac_mode"] for r in rows} == {None, "full", "selective"}
    assert all(r["peak_phase"] in r["phase_peaks"] and "optimizer" not in r["peak_phase"] for r in rows)


@pytest.mark.train
@pytest.mark.parametrize(("name", "precision", "strategy", "ranks"), [
    ("llama", "bf16", "ddp", 1), ("qwen2", "fp32", "ddp", 1), ("gpt2", "bf16", "ddp", 1),
    ("mistral", "bf16", "fsdp", 2), ("llama", "fp32", "fsdp", 2)])
def test_a_live_measurement_of_the_real_model_agrees(name: str, precision: str, strategy: str, ranks: int) -> None:
    """Measured now: transformers' own class built from the config, two training steps, peak live tensor bytes
    (fsdp: rank 0 of 2 under torch's fake process group, in a child process); llama fsdp fp32 with full
    checkpointing peaks in a block's backward beside the root's gathered weights and unsharded head gradients."""
    sys.path.insert(0, str(REPO / "bench"))
    import hf_memplan as bench

    row = bench.measure(name, 2, 64, precision, "full" if name == "llama" and strategy == "fsdp" else "",
                        strategy=strategy, ranks=ranks)
    assert row["params"] == row["params_planned"]
    assert abs(row["ratio"] - 1) <= TOLERANCE, row


def test_dry_run_and_doctor_show_the_models_plan(tmp_path: Path, h100: str) -> None:
    """`--model config.json` on submit --dry-run and doctor: the same plan; after the entry, --model is the entry's."""
    script = tmp_path / "train.py"
    script.write_text("import argparse\nargparse.ArgumentParser().add_argument('--model')\n")
    model = str(DATA / "qwen2.5-7b.json")
    out = hpcjobs("submit", "--profile", h100, "--nodes", "2", "--gpus", "8", "--dry-run", "--no-snapshot",
                  "--model", model, str(script), "--model", "Qwen/Qwen2.5-7B", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(f"# memory plan per GPU (--model {model})"))
    assert "qwen2 (7.62B parameters" in line and "ddp over 16 ranks" in line and "does NOT fit" in line, line
    bad = hpcjobs("submit", "--profile", h100, "--dry-run", "--no-snapshot", "--model", str(tmp_path / "x.json"),
                  str(script), cwd=tmp_path)
    assert bad.returncode == 2 and "--model" in bad.stderr and "no such file" in bad.stderr, bad
    local = tmp_path / "local.yaml"
    local.write_text("scheduler: local\ngpus_per_node: 8\ngpu_memory: 80GB\n")
    rows = [json.loads(hpcjobs("doctor", "--profile", str(local), "--model", model, "--json", *flags,
                               cwd=tmp_path).stdout)["checks"][-1]
            for flags in ([], ["trainers.tasks.lm", "--strategy", "fsdp", "--activation-checkpointing"])]
    assert [r["name"] for r in rows] == ["memory plan"] * 2 and [r["result"] for r in rows] == ["fail", "pass"], rows
    assert "hpcjobs plan --model" in rows[0]["fix"]


def test_plan_help_has_examples() -> None:
    out = hpcjobs("plan", "--help")
    assert out.returncode == 0 and "examples:" in out.stdout and "hpcjobs plan --model config.json" in out.stdout


def test_selective_checkpointing_is_planned_between_full_and_none() -> None:
    """Each block keeps its input and its matmuls' and attention's outputs (issue 41: selective was planned as no
    checkpointing; the bundled 7b on 2 × 8 GPUs then needed ~87 GiB, refused, where it fits)."""
    from hpcjobs.request.gpu_fit import job_plan

    shape, _ = model_shape(str(DATA / "llama-3-8b.json"))
    full, selective, none = (plan(shape, Setup(strategy="fsdp", ranks=16, micro_batch=2, seq_len=4096,
                                              activation_checkpointing=ac, ac_mode=mode)).total
                             for ac, mode in ((True, "full"), (True, "selective"), (False, "full")))
    assert full < selective < none
    seven = job_plan("trainers.tasks.lm", ["--size", "7b", "--ac-mode", "selective"], 16)
    assert seven is not None and seven.setup.ac_mode == "selective" and seven.plan.total <= 80 * GIB
