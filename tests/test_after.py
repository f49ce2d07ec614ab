"""Jobs that wait for others (issue 29 item 2): `--after ID[:ok|any|notok]` and chain files. Pure parts here, the
rendered sbatch lines, refusals before anything is queued (a fake sbatch proves none reached it), and a local chain
of plain scripts run for real: a step whose upstream failed is never started. The Slurm chain through requeues is
tests/cluster/test_chain_cluster.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, hpcjobs, sbatch_shim
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.states import JobState
from hpcjobs.request.after import After, dependency, parse_after, parse_all
from hpcjobs.request.chainfile import read_chain


def test_after_parses_each_form_and_joins_slurms_dependency() -> None:
    assert parse_after("1234") == After("1234", "ok")
    assert parse_after("1240_3:notok") == After("1240_3", "notok")
    assert parse_after("local-20261125180307-6764-1:any") == After("local-20261125180307-6764-1", "any")
    assert dependency(parse_all(("12", "13:any", "14"))) == "afterok:12:14,afterany:13"
    assert dependency(()) is None
    for bad, said in (("x", "not a job id"), ("12:maybe", "the condition 'maybe'"), ("12:", "not a job id")):
        with pytest.raises(UsageError, match=said):
            parse_after(bad)
    with pytest.raises(UsageError, match="job 12 twice with two conditions"):
        parse_all(("12", "12:any"))
    assert parse_all(("12", "12")) == (After("12"),)


@pytest.mark.parametrize("condition,state,met", [
    ("ok", JobState.COMPLETED, True), ("ok", JobState.FAILED, False), ("ok", JobState.RUNNING, None),
    ("ok", JobState.PENDING, None), ("notok", JobState.TIMEOUT, True), ("notok", JobState.COMPLETED, False),
    ("any", JobState.CANCELLED, True), ("any", JobState.UNKNOWN, None)])
def test_a_condition_is_met_only_once_the_upstream_ended(condition: str, state: JobState, met: bool | None) -> None:
    assert After("1", condition).met_by(state) is met


def test_render_asks_slurm_to_wait_and_to_cancel_a_dependent_that_can_never_start(tmp_path: Path) -> None:
    out = hpcjobs("render", "--profile", "testcluster", "--no-snapshot", "--after", "12", "--after", "13:any",
                  "--sweep", "lr=1e-3,3e-3", "trainers.tasks.lm", cwd=REPO, env={"HPCJOBS_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --dependency=afterok:12,afterany:13\n" in out.stdout
    assert "#SBATCH --kill-on-invalid-dep=yes\n" in out.stdout and "#SBATCH --array=0-1\n" in out.stdout
    plain = hpcjobs("render", "--profile", "testcluster", "--no-snapshot", "trainers.tasks.lm", cwd=REPO,
                    env={"HPCJOBS_HOME": str(tmp_path)})
    assert "--dependency" not in plain.stdout and "kill-on-invalid-dep" not in plain.stdout


@pytest.fixture
def sbatch_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "sbatch-calls.log"
    sbatch_shim(tmp_path, monkeypatch, f'echo "$@" >> {log}\nexit 1\n')
    return log


def refused(out: subprocess.CompletedProcess[str], fragment: str, sbatch_log: Path) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and fragment in out.stderr and "HINT:" in out.stderr, out.stderr
    assert not sbatch_log.exists(), "sbatch was called"


def test_after_an_unknown_job_or_a_bad_form_is_refused_before_the_queue(tmp_path: Path, sbatch_log: Path) -> None:
    env = {"HPCJOBS_HOME": str(tmp_path / "home")}
    out = hpcjobs("submit", "--profile", "testcluster", "--after", "999", "trainers.tasks.lm", cwd=REPO, env=env)
    refused(out, "--after 999:ok: no job '999'", sbatch_log)
    out = hpcjobs("submit", "--profile", "testcluster", "--after", "12:later", "trainers.tasks.lm", cwd=REPO, env=env)
    refused(out, "--after '12:later': the condition 'later'; valid: --after ID[:ok|any|notok]", sbatch_log)


SCRIPTS = {"ok.py": "import sys\nprint('ran', *sys.argv[1:])\n", "fail.py": "import sys\nsys.exit(3)\n"}


def local_step(name: str, script: str, *args: str) -> str:
    return f"--profile local --gpus 1 --no-snapshot --run-dir runs/{name} {script} {' '.join(args)}".strip()


def test_a_local_chain_runs_upstream_first_and_never_starts_a_step_whose_upstream_failed(tmp_path: Path) -> None:
    for name, text in SCRIPTS.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "chain.yaml").write_text(
        f"train:\n  submit: {local_step('train', 'ok.py', 'train')}\n"
        f"eval:\n  after: train\n  submit: {local_step('eval', 'ok.py', 'eval')}\n"
        f"broken:\n  submit: {local_step('broken', 'fail.py')}\n"
        f"needs_broken:\n  after: broken\n  submit: {local_step('nb', 'ok.py', 'nb')}\n"
        f"on_failure:\n  after: broken:notok\n  submit: {local_step('of', 'ok.py', 'of')}\n"
        f"after_that:\n  after: [needs_broken]\n  submit: {local_step('at', 'ok.py', 'at')}\n")
    env = {"HPCJOBS_HOME": str(tmp_path / "home")}
    out = hpcjobs("submit", "--chain", "chain.yaml", "--json", cwd=tmp_path, env=env)
    assert out.returncode == 1, out.stderr  # not every step started
    ids = {s["step"]: s["job_id"] for s in json.loads(out.stdout)["steps"]}
    assert list(ids) == ["train", "eval", "broken", "needs_broken", "on_failure", "after_that"]
    assert ids["needs_broken"] is None and ids["after_that"] is None
    assert len({ids[k] for k in ("train", "eval", "broken", "on_failure")}) == 4  # four jobs, four ids
    assert not (tmp_path / "runs" / "nb").exists() and not (tmp_path / "runs" / "at").exists()
    assert "step needs_broken not started: --after" in out.stderr and "already ended FAILED" in out.stderr
    status = hpcjobs("status", ids["eval"], cwd=tmp_path, env=env)
    assert f"after:       {ids['train']} (ok): COMPLETED, met\n" in status.stdout, status.stdout
    status = hpcjobs("status", ids["on_failure"], "--json", cwd=tmp_path, env=env)
    assert json.loads(status.stdout)["after"] == [{"job_id": ids["broken"], "condition": "notok",
                                                   "state": "FAILED"}]
    again = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--no-snapshot", "--after", ids["train"] + ":notok",
                    "ok.py", cwd=tmp_path, env=env)
    assert again.returncode == 2 and "already ended COMPLETED, so this job would never start" in again.stderr


@pytest.mark.parametrize("text,said", [
    ("a:\n  after: b\n  submit: --profile local x.py\nb:\n  after: a\n  submit: --profile local x.py\n",
     "a cycle, a → b → a"),
    ("a:\n  after: nope\n  submit: --profile local x.py\n", "step 'a' waits for 'nope', which is no step"),
    ("a:\n  submitt: --profile local x.py\n", "step 'a' has the key 'submitt'; valid: submit, after"),
    ("a:\n  after: b\n", "step 'a' has no `submit:`"),
    ("a:\n  submit: --profile local --after 3 x.py\n", "--after inside submit:"),
    ("a:\n  submit: --profile local x.py\n  after: 'a:maybe'\n", "after: 'a:maybe'; valid: STEP[:ok|any|notok]"),
    ("- a\n", "holds list"),
])
def test_a_chain_file_that_cannot_be_is_one_line(text: str, said: str, tmp_path: Path) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(text)
    with pytest.raises(UsageError, match=said.replace("[", r"\[").replace("]", r"\]")):
        read_chain(path)


def test_a_chain_refuses_a_bad_step_or_two_schedulers_before_anything_runs(tmp_path: Path, sbatch_log: Path) -> None:
    (tmp_path / "ok.py").write_text(SCRIPTS["ok.py"])
    env = {"HPCJOBS_HOME": str(tmp_path / "home")}
    (tmp_path / "chain.yaml").write_text(f"a:\n  submit: {local_step('a', 'ok.py')}\n"
                                         "b:\n  after: a\n  submit: --profile local trainers.tasks.lm --size huge\n")
    out = hpcjobs("submit", "--chain", "chain.yaml", cwd=tmp_path, env=env)
    refused(out, "step 'b': trainers.tasks.lm: --size: invalid choice: 'huge'", sbatch_log)
    (tmp_path / "chain.yaml").write_text(f"a:\n  submit: {local_step('a', 'ok.py')}\n"
                                         "b:\n  after: a\n  submit: --profile testcluster --no-snapshot ok.py\n")
    out = hpcjobs("submit", "--chain", "chain.yaml", cwd=tmp_path, env=env)
    refused(out, "steps on local and slurm; valid: every step on one scheduler", sbatch_log)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "home").exists()
