"""The LoRA example (trainers.tasks.lora) and lm's large sizes: in-process, on the CPU, tiny models, no process group.
(An end-to-end run through the trainer is the local-profile tests' business.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from trainers.task import TaskArgError
from trainers.tasks import lm, lora


def base_gpt(size: str = "tiny", seed: int = 0) -> lm.GPT:
    """What the LoRA task's base must be without --base: lm's GPT drawn from `seed`."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return lm.GPT(lm.SIZES[size])


def batch(n: int = 4, t: int = 33) -> torch.Tensor:
    return torch.randint(0, lm.VOCAB, (n, t), generator=torch.Generator().manual_seed(5))


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}


def write(state: dict[str, torch.Tensor], path: Path) -> None:
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)


def one_line(e: pytest.ExceptionInfo[TaskArgError]) -> str:
    message = str(e.value)
    assert "\n" not in message and "valid" in message and "HINT: " in message, message
    return message


def test_the_untrained_lora_model_is_the_base_exactly_whatever_the_global_rng() -> None:
    torch.manual_seed(1)
    first = lora.make_task([]).model()
    torch.manual_seed(2)  # the trainer seeds from --seed: the base must not depend on it, the adapters do
    second = lora.make_task([]).model()
    x = batch()
    assert torch.equal(first(x), base_gpt()(x)) and torch.equal(second(x), base_gpt()(x))
    frozen = {k: v for k, v in first.state_dict().items() if ".lora_" not in k}
    assert all(torch.equal(v, second.state_dict()[k]) for k, v in frozen.items())
    assert not torch.equal(first.blocks[0].qkv.lora_A, second.blocks[0].qkv.lora_A)
    assert not torch.equal(lora.make_task(["--base-seed", "1"]).model()(x), first(x))


@pytest.mark.parametrize(("flags", "targets"), [([], ("qkv", "proj")), (["--rank", "4", "--targets", "fc,out,qkv"],
                                                                        ("fc", "out", "qkv"))])
def test_only_the_adapters_train(flags: list[str], targets: tuple[str, ...]) -> None:
    task = lora.make_task(flags)
    model = task.model()
    r, d, layers = (4 if flags else 8), 64, 2
    inout = {"qkv": 4 * d, "proj": 2 * d, "fc": 5 * d, "out": 5 * d}
    expected = layers * r * sum(inout[t] for t in targets)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == expected == task.config["adapter_params"]
    assert sorted(trainable) == sorted(f"blocks.{i}.{t}.lora_{ab}" for i in range(layers) for t in targets
                                       for ab in "AB")
    assert task.save_frozen is False and task.name == "lora-tiny"


def test_a_few_steps_change_the_adapters_and_not_one_bit_of_the_base() -> None:
    task = lora.make_task(["--targets", "qkv,proj,fc,out"])
    model = task.model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)  # all of them: decay would move the base
    data = task.train_data()
    fixed = torch.stack([data[i] for i in range(8)])
    losses = []
    for _ in range(4):
        loss = task.loss(model, fixed)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    after = model.state_dict()
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == sorted(adapters(model)), changed
    assert losses[-1] < losses[0], losses


def test_merged_weights_are_a_plain_gpt_with_the_same_outputs() -> None:
    model = lora.make_task(["--targets", "qkv,fc"]).model()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # B is zero at the start: give the adapters something to fold in
                p.copy_(torch.randn_like(p) * 0.05)
    merged = lora.merged_state_dict(model)
    gpt = lm.GPT(lm.SIZES["tiny"])
    gpt.load_state_dict(merged)  # strict: exactly lm's keys
    x = batch()
    assert torch.allclose(gpt(x), model(x), atol=1e-5)
    assert not torch.allclose(gpt(x), base_gpt()(x), atol=1e-3)  # the adapters did change something
    assert torch.equal(merged["blocks.0.proj.weight"], model.blocks[0].proj.weight)  # not adapted: the same


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_base_file_round_trips(tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    base = base_gpt(seed=7)
    path = tmp_path / f"base{suffix}"
    state = {k: v.contiguous() for k, v in base.state_dict().items()}
    write(state, path)
    task = lora.make_task(["--base", str(path)])
    model = task.model()
    x = batch()
    assert torch.equal(model(x), base(x))
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)
    assert len(task.config["base_sha256"]) == 64 and task.config["base_bytes"] == path.stat().st_size
    other = tmp_path / f"other{suffix}"
    state["pos"] = state["pos"] + 1
    write(state, other)
    assert lora.make_task(["--base", str(other)]).config["base_sha256"] != task.config["base_sha256"]

    def read_base(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a rank built on the meta device read the base")

    monkeypatch.setattr(lora, "read_base", read_base)  # --meta-init: rank 0 sends the other ranks the weights
    with torch.device("meta"):
        meta = task.model()
    assert all(t.device.type == "meta" for t in (*meta.parameters(), *meta.buffers()))


def test_a_wrong_base_is_refused_before_training(tmp_path: Path) -> None:
    small = tmp_path / "small.pt"
    torch.save(lm.GPT(lm.SIZES["small"]).state_dict(), small)
    with pytest.raises(TaskArgError) as e:
        lora.make_task(["--base", str(small)])
    message = one_line(e)
    assert message.startswith(f"trainers.tasks.lora: --base {small} is not a GPT of --size tiny")
    assert "pos is [128, 128], not [64, 64]; tok.weight is [256, 128], not [256, 64]" in message
    assert message.endswith("HINT: export the base from a trainers.tasks.lm run with --size tiny: hpcjobs export RUN "
                            "-o base.pt")
    checkpoint = tmp_path / "shared.safetensors"
    save_file({"model.pos": torch.zeros(2)}, str(checkpoint))
    with pytest.raises(TaskArgError, match="missing pos; missing tok.weight; missing blocks.0.ln1.weight"):
        lora.make_task(["--base", str(checkpoint)])
    for path, why in ((tmp_path / "none.pt", "is not a file"), (small.with_suffix(".bin"), "is not a format")):
        with pytest.raises(TaskArgError, match=why) as e:
            lora.make_task(["--base", str(path)])
        one_line(e)
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(TaskArgError, match="junk.pt cannot be read") as e:
        lora.make_task(["--base", str(tmp_path / "junk.pt")])
    one_line(e)


@pytest.mark.parametrize("targets", ["qkv,mlp", "qkv,", "ln1"])
def test_unknown_targets_are_refused(targets: str) -> None:
    with pytest.raises(TaskArgError, match=r"--targets .*valid: comma-separated names of qkv, proj, fc, out") as e:
        lora.make_task(["--targets", targets])
    one_line(e)


def test_targets_are_the_linear_layers_of_a_block() -> None:
    block = lm.Block(lm.SIZES["tiny"])
    assert lora.TARGETS == tuple(n for n, m in block.named_children() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("make", [lm.make_task, lora.make_task])
def test_7b_needs_cuda(monkeypatch: pytest.MonkeyPatch, make: Callable[[list[str]], Any]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TaskArgError) as e:
        make(["--size", "7b"])
    message = one_line(e)
    assert "--size 7b needs GPUs (about " in message and "this machine has no CUDA" in message
    assert "valid here: tiny, small, medium, large, 1b. HINT: submit it to a GPU profile" in message
    make(["--size", "1b"])  # allowed on the CPU; nothing is built until model()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert make(["--size", "7b"]).name.endswith("-7b")


@pytest.mark.parametrize(("size", "stated"), [("1b", 1.21e9), ("7b", 6.45e9)])
def test_the_large_sizes_have_the_parameters_they_say(size: str, stated: float) -> None:
    with torch.device("meta"):  # nothing allocated
        model = lm.GPT(lm.SIZES[size])
    count = sum(p.numel() for p in model.parameters())
    assert count == lm.n_params(lm.SIZES[size]) and abs(count / stated - 1) < 0.02, count
    assert sum(p.numel() for p in lm.GPT(lm.SIZES["tiny"]).parameters()) == lm.n_params(lm.SIZES["tiny"])


@pytest.mark.train
def test_through_the_trainer_checkpoints_and_exports_hold_the_adapters_only_and_resume(tmp_path: Path) -> None:
    """The trainer side of Task.save_frozen=False, on 2 ranks under fsdp: the checkpoint holds the adapters (and no
    frozen base weight), a later start resumes from it (loading non-strictly), and the export is the adapters."""
    from conftest import REPO, hpcjobs, newest_log
    from trainers import checkpoint
    from trainers.checkpoint.dcp_files import model_weights

    run = tmp_path / "run"
    args = ["trainers.tasks.lora", "--steps", "4", "--ckpt-every", "2", "--log-every", "2", "--strategy", "fsdp"]
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), *args, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None
    saved = model_weights(ref)
    assert saved and all(".lora_" in k for k in saved), sorted(saved)[:5]
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), *args, "--steps", "6",
                  "--extend", cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed from" in newest_log(run)
    exported = tmp_path / "adapters.pt"
    assert hpcjobs("export", str(run), "-o", str(exported), cwd=REPO).returncode == 0
    assert sorted(torch.load(exported, weights_only=True)) == sorted(saved)
