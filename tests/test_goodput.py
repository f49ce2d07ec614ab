"""hpcjobs goodput over recorded run folders: exact buckets, a resumed run's rework, a sweep's total, the advice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpcjobs.backends.slurm.slurm import parse_sacct
from hpcjobs.cli import main
from hpcjobs.goodput import advice as goodput_advice
from hpcjobs.goodput.buckets import BUCKETS, AllocationTimes, JobTimes, Save, Start, compute
from hpcjobs.goodput.report import report, text
from hpcjobs.jobs.store import JobRecord, JobStore
from hpcjobs.protocol.states import JobState

J = "4711"


def lines(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def marks(job: str, restart: int, start_step: int, *ranks: tuple[float, float, float, float, float],
          ) -> list[dict[str, Any]]:
    return [{"job_id": job, "restart": restart, "rank": rank, "start_step": start_step,
             **dict(zip(("launched", "imported", "joined", "ready", "first_step"), t, strict=True))}
            for rank, t in enumerate(ranks)]


def save(job: str, restart: int, step: int, at: float, blocking: float, background: bool = True) -> dict[str, Any]:
    return {"job_id": job, "restart": restart, "step": step, "time": at, "blocking_s": blocking,
            "background": background}


def requeued_run(run: Path) -> Path:
    """A Slurm job (2 nodes × 4 GPUs) stopped at a checkpoint by the time-limit signal at step 250, requeued, held
    121 s, then finished at step 400. Every instant is chosen so each bucket is a round number."""
    run.mkdir(parents=True)
    (run / "spec.json").write_text(json.dumps({"nodes": 2, "gpus_per_node": 4, "preemption": {"seconds_before": 5}}))
    lines(run / "restarts.jsonl", [
        {"time": 1012.0, "restart": 0, "job_id": J, "world_size": 8},
        {"time": 1095.0, "restart": 0, "stopped": "timeout", "step": 250, "signal_to_commit_s": 6.0},
        {"time": 1232.0, "restart": 1, "job_id": J, "world_size": 8}])
    lines(run / "startup.jsonl", marks(J, 0, 0, (1011, 1020, 1022, 1030, 1031), (1012, 1021, 1022.5, 1029, 1031.5))
          + marks(J, 1, 250, (1231, 1240, 1241, 1250, 1251)))
    lines(run / "saves.jsonl", [save(J, 0, 100, 1050, 2), save(J, 0, 200, 1070, 2), save(J, 0, 250, 1090, 5, False),
                                save(J, 1, 300, 1270, 2), save(J, 1, 400, 1285, 3, False)])
    lines(run / "metrics.jsonl", [{"step": s, "loss": 1.0, "time": t, "restart": r}
                                  for s, t, r in ((100, 1050, 0), (200, 1070, 0), (300, 1270, 1), (400, 1285, 1))])
    (run / "final.json").write_text(json.dumps({"state": "finished", "step": 400, "time": 1290.0, "job_id": J}))
    return run


SACCT = "2026-01-01T00:00:00|2026-01-01T00:00:10|2026-01-01T00:01:40\n" \
        "2026-01-01T00:03:41|2026-01-01T00:03:50|2026-01-01T00:05:00\n"
"""Eligible|Start|End of the two allocations: 0 → 10 → 100 s, then eligible at 221 s (held 121 s), 230 → 300 s."""


class Sacct:
    def __init__(self, origin: float) -> None:
        self.origin = origin

    def __call__(self, argv: Any) -> Any:
        assert argv[:2] == ["sacct", "-n"] and "-D" in argv
        shifted = "\n".join("|".join(_shift(f, self.origin) for f in line.split("|")) for line in SACCT.splitlines())
        return type("Done", (), {"returncode": 0, "stdout": shifted})()


def _shift(field: str, origin: float) -> str:
    import datetime

    base = datetime.datetime.strptime("2026-01-01T00:00:00", "%Y-%m-%dT%H:%M:%S").timestamp()
    t = datetime.datetime.strptime(field, "%Y-%m-%dT%H:%M:%S").timestamp() - base + origin
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%dT%H:%M:%S")


def test_requeued_job_buckets_are_exact_and_add_up_to_the_wall_time(tmp_path: Path) -> None:
    run = requeued_run(tmp_path / "run")
    JobStore().add(JobRecord(J, "lm", "c", "slurm", 2, 4, str(run), {}, {}, 1000.0))
    rep = report(J, runner=Sacct(1000.0), state_of=lambda _: JobState.COMPLETED)
    g = rep.total
    assert g.wall_s == 300.0
    # training ended with the final save's commit (1285 + 3 s); final.json came 2 s later: the exit, "other"
    assert g.buckets == {"queue": 19.0, "startup": 42.5, "productive": 86.5, "checkpoint": 14.0, "rework": 0.0,
                         "detection": 0.0, "requeue_hold": 121.0, "recovery": 5.0, "other": 12.0}
    assert sum(g.buckets.values()) == g.wall_s
    assert g.startup_parts == {"launch": 3.0, "imports": 18.0, "rendezvous": 2.5, "build_and_load": 16.5,
                               "first_step": 2.5}
    assert g.allocated_s == 160.0 and g.ettr == 86.5 / 160
    assert g.gpu_hours()["productive"] == 86.5 * 8 / 3600 and g.gpu_hours()["queue"] == 0.0
    assert (g.starts, g.interruptions, g.holds) == (2, 1, 1)
    said = "\n".join(rep.advice)
    assert "held the job 121 s" in said and "cred_expire" in said
    assert "warns 5 s before the time limit, but a stop or save here took 6 s" in said
    assert "sum (= wall time)" in text(rep) and "ETTR 54.1%" in text(rep)


def test_without_accounting_the_gap_is_recovery_and_the_end_is_the_last_record(tmp_path: Path) -> None:
    run = requeued_run(tmp_path / "run")
    JobStore().add(JobRecord(J, "lm", "c", "slurm", 2, 4, str(run), {}, {}, 1000.0))
    no_sacct = type("Done", (), {"returncode": 1, "stdout": ""})()
    g = report(J, runner=lambda _: no_sacct, state_of=lambda _: JobState.COMPLETED).total
    # the first start begins at its first rank's launch (1011), the second at its launch (1231)
    assert g.buckets["queue"] == 11.0 and g.buckets["requeue_hold"] == 0.0
    assert g.buckets["recovery"] == 1231.0 - 1095.0 and g.buckets["other"] == 1290.0 - 1288.0  # after training
    assert g.wall_s == 290.0 == sum(g.buckets.values())


def killed_and_resumed(run: Path) -> Path:
    """Job A trains, saves at 20 and 40, then a rank is killed (failure at 2035); job B resumes at step 40 and
    finishes. A's training from its step-40 save to its failure was done again."""
    run.mkdir(parents=True)
    lines(run / "restarts.jsonl", [{"time": 2001.0, "restart": 0, "job_id": "A", "world_size": 2},
                                   {"time": 2051.0, "restart": 0, "job_id": "B", "world_size": 2}])
    lines(run / "startup.jsonl", marks("A", 0, 0, (2001, 2005, 2006, 2008, 2009))
          + marks("B", 0, 40, (2051, 2055, 2056, 2058, 2059)))
    lines(run / "saves.jsonl", [save("A", 0, 20, 2015, 0.5), save("A", 0, 40, 2025, 0.5), save("B", 0, 60, 2065, 0.5)])
    lines(run / "failures.jsonl", [{"time": 2035.0, "job_id": "A", "restart": 0, "rank": 1}])
    lines(run / "allocations.jsonl", [{"job_id": "A", "start": 2000.5, "end": 2040.0, "code": 1},
                                      {"job_id": "B", "start": 2050.5, "end": 2080.0, "code": 0}])
    (run / "final.json").write_text(json.dumps({"state": "finished", "step": 80, "time": 2075.0, "job_id": "B"}))
    (run / "checkpoints" / "step-60").mkdir(parents=True)
    return run


def test_a_resumed_run_counts_the_steps_done_again_as_rework(tmp_path: Path) -> None:
    run = killed_and_resumed(tmp_path / "run")
    for job, submitted in (("A", 2000.0), ("B", 2050.0)):
        JobStore().add(JobRecord(job, "lm", "local", "local", 1, 2, str(run), {}, {}, submitted))
    rep = report(str(run), state_of=lambda _: JobState.COMPLETED)
    a, b = rep.parts
    assert a.buckets == {"queue": 0.5, "startup": 8.5, "productive": 15.5, "checkpoint": 1.0, "rework": 9.5,
                         "detection": 0.0, "requeue_hold": 0.0, "recovery": 0.0, "other": 5.0}
    assert a.wall_s == 40.0 and b.wall_s == 30.0 and b.buckets["rework"] == 0.0 and b.buckets["productive"] == 15.5
    assert rep.total.wall_s == 70.0 == sum(rep.total.buckets.values())
    assert rep.total.ettr == 31.0 / 69.0  # allocated: less each job's 0.5 s in the queue
    only_a = report("A", state_of=lambda _: JobState.COMPLETED)
    assert [p.job_id for p in only_a.parts] == ["A"] and only_a.total.buckets["rework"] == 9.5


def test_a_hangs_wait_to_be_noticed_is_detection_not_rework(tmp_path: Path) -> None:
    """Issue 40: job A's rank hung at 2027 (its watchdog recorded the failure at 2035, 8 s idle): the steps redone
    are the 1.5 s after the step-40 save, and the 8 s the hang took to be noticed are detection (all 9.5 s were
    booked as rework before)."""
    run = killed_and_resumed(tmp_path / "run")
    lines(run / "failures.jsonl", [{"time": 2035.0, "job_id": "A", "restart": 0, "rank": 1, "idle_s": 8.0,
                                    "error": "hung: no step progress for 8 s after step 41"}])
    for job, submitted in (("A", 2000.0), ("B", 2050.0)):
        JobStore().add(JobRecord(job, "lm", "local", "local", 1, 2, str(run), {}, {}, submitted))
    a, b = report(str(run), state_of=lambda _: JobState.COMPLETED).parts
    assert a.buckets == {"queue": 0.5, "startup": 8.5, "productive": 15.5, "checkpoint": 1.0, "rework": 1.5,
                         "detection": 8.0, "requeue_hold": 0.0, "recovery": 0.0, "other": 5.0}
    assert a.wall_s == 40.0 == sum(a.buckets.values()) and b.buckets["detection"] == 0.0


def test_a_sweeps_total_is_the_sum_of_its_tasks(tmp_path: Path) -> None:
    for i in range(2):
        run = killed_and_resumed(tmp_path / f"sweep-{i}")
        JobStore().add(JobRecord(f"9_{i}", "lm", "local", "local", 1, 2 + 2 * i, str(run), {}, {}, 2000.0))
        for name in ("restarts.jsonl", "startup.jsonl", "saves.jsonl", "allocations.jsonl", "failures.jsonl"):
            path = run / name  # job A alone: task 1 as on Slurm, where its ranks name its own SLURM_JOB_ID, not 9_1
            kept = [line for line in path.read_text().splitlines() if '"B"' not in line]
            path.write_text("".join(line.replace('"A"', '"9_0"' if i == 0 else '"4251"') + "\n" for line in kept))
    rep = report("9", state_of=lambda _: JobState.COMPLETED)
    assert [p.job_id for p in rep.parts] == ["9_0", "9_1"]
    t = rep.total
    for b in BUCKETS:
        assert t.buckets[b] == sum(p.buckets[b] for p in rep.parts)
    assert rep.parts[0].buckets == rep.parts[1].buckets and rep.parts[0].wall_s == 40.0
    assert t.gpu_hours()["productive"] == pytest.approx(rep.parts[0].buckets["productive"] * (2 + 4) / 3600)
    assert t.ettr == sum(p.buckets["productive"] for p in rep.parts) / sum(p.allocated_s for p in rep.parts)


def test_clocks_out_of_order_never_make_a_bucket_negative() -> None:
    start = Start(0, begin=100.0, marks={"launched": 90.0, "imported": 130.0, "joined": 120.0, "ready": 140.0,
                                         "first_step": 135.0}, start_step=0, end=125.0, ended="lost")
    g = compute(JobTimes("x", 1, 110.0, (start,), end=124.0), [None], now=0.0)
    assert all(v >= 0 for v in g.buckets.values()) and sum(g.buckets.values()) == g.wall_s == 25.0


def test_a_running_job_ends_now() -> None:
    start = Start(0, begin=10.0, marks={"first_step": 20.0}, start_step=0, end=None, ended="running")
    g = compute(JobTimes("x", 1, 0.0, (start,), running=True), [None], now=100.0)
    assert g.buckets["productive"] == 80.0 and g.wall_s == 100.0 and g.ettr == 80.0 / 90.0


def test_sacct_lines_parse_and_unknown_times_are_skipped() -> None:
    got = parse_sacct("2026-01-01T00:00:00|2026-01-01T00:00:10|Unknown\nNone|Unknown|Unknown\n")
    assert len(got) == 1 and got[0][2] is None and got[0][1] - got[0][0] == 10  # type: ignore[operator]


def test_young_daly_advice_when_the_interval_is_far_off() -> None:
    starts = [Start(0, 0.0, saves=tuple(Save(s, 0.0, 4.0) for s in (10, 20, 30)), ended="lost")]
    g = compute(JobTimes("x", 1, 0.0, (Start(0, 0.0, {"first_step": 0.0}, 0, 3600.0, None, "lost"),)), [None], 0.0)
    line = goodput_advice.checkpoint_interval(g, starts, step_s=1.0)
    assert line is not None and "sqrt(2 × 4 × 3.6e+03) = 170 s" in line and "--ckpt-every 170" in line
    assert goodput_advice.young_daly_s(4, 3600) == pytest.approx(169.7, abs=0.1)


def test_no_interval_shorter_than_a_few_saves_is_advised() -> None:
    """Issue 38: a run interrupted twice within seconds was advised --ckpt-every 17 (0.85 s) with saves that cost
    more than that: checkpointing that often would only save."""
    starts = [Start(0, 0.0, saves=tuple(Save(s, 0.0, 1.0) for s in (100, 200, 300)), ended="lost")]
    g = compute(JobTimes("x", 1, 0.0, (Start(0, 0.0, {"first_step": 0.0}, 0, 4.0, None, "lost"),)), [None], 0.0)
    assert goodput_advice.young_daly_s(1.0, g.allocated_s) < goodput_advice.MIN_SAVES_APART * 1.0
    assert goodput_advice.checkpoint_interval(g, starts, step_s=0.2) is None  # saves 20 s apart now: no advice


def chunk(restart: int, begin: float, startup: float, trained: float, first: int) -> Start:
    """A start of a job in 2-minute chunks, stopped at the limit: periodic saves every 10 steps, then its stop's."""
    saves = tuple(Save(first + s, begin + startup + s, 0.02) for s in (10, 20, 30))
    return Start(restart, begin, {"first_step": begin + startup}, first, begin + startup + trained, first + 31,
                 "stopped", saves, stop_to_commit_s=2.5)


CHUNKS = [chunk(n, 70.0 * n, 45.0, 12.0, 31 * n) for n in range(6)]
"""Issue 38's busier machine: a 60 s warning before a 2:00 limit, ~45 s of start-up, a few steps a chunk."""


def test_a_job_in_time_limit_chunks_is_not_told_to_checkpoint_more_often() -> None:
    """Stops at the time limit commit a checkpoint of their step: no work lost, no Young/Daly interval from them
    (the old code advised --ckpt-every 5 for a job that had lost nothing); a killed start still counts."""
    g = compute(JobTimes("x", 1, 0.0, tuple(CHUNKS)), [c.start_step for c in CHUNKS[1:]] + [None], 0.0)
    assert g.interruptions == 6 and goodput_advice.checkpoint_interval(g, CHUNKS, step_s=0.03) is None
    killed = [*CHUNKS[:-1], Start(5, 350.0, {"first_step": 395.0}, 155, 407.0, 186, "lost", CHUNKS[-1].saves)]
    line = goodput_advice.checkpoint_interval(g, killed, step_s=0.03)
    assert line is not None and "(1 seen)" in line, line


def test_a_time_limit_that_leaves_each_start_little_to_train_gets_the_time_that_would_work() -> None:
    line = goodput_advice.short_chunks(CHUNKS, 120, 60)
    assert line == ("time limit: each start stopped at its 00:02:00 limit trained ~12 s (median of 6): start-up took "
                    "~45 s and the profile's warning 60 s before the end. HINT: --time 00:09:00 leaves ~80% of each "
                    "start to training"), line
    assert "seconds_before: 30 in the profile (a stop here committed within 2.5 s)" in \
        str(goodput_advice.short_chunks(CHUNKS, 150, 90))
    long_enough = [chunk(n, 400.0 * n, 45.0, 300.0, 31 * n) for n in range(3)]
    assert goodput_advice.short_chunks(long_enough, 420, 60) is None
    assert goodput_advice.short_chunks(CHUNKS, None, 60) is None  # no time limit: nothing to say
    preempted = [chunk(n, 70.0 * n, 45.0, 12.0, 31 * n) for n in range(3)]  # stopped long before a 1-hour limit
    assert goodput_advice.short_chunks(preempted, 3600, 60) is None
    g = compute(JobTimes("x", 1, 0.0, tuple(CHUNKS)), [c.start_step for c in CHUNKS[1:]] + [None], 0.0)
    advice = goodput_advice.advice(g, CHUNKS, 0.3, 60, 120)
    assert [a.split(":")[0] for a in advice] == ["time limit"], advice


def test_goodput_cli_json_and_a_bad_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = killed_and_resumed(tmp_path / "run")
    assert main(["goodput", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # no job record here: each job's wall time begins with its allocation (the submit time is the store's)
    assert out["total"]["wall_s"] == 69.0 and [j["job_id"] for j in out["jobs"]] == ["A", "B"]
    assert main(["goodput", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is no such folder: neither a run folder nor a job id" in err and "HINT" in err
    (tmp_path / "file").write_text("")
    for bad, said in ((str(tmp_path / "file"), "is a file"), ("", "is no such folder")):
        assert main(["goodput", bad]) == 2 and said in capsys.readouterr().err


def test_allocation_start_is_the_first_starts_begin() -> None:
    start = Start(0, begin=15.0, marks={"launched": 15.0, "first_step": 20.0}, start_step=0, end=30.0,
                  ended="finished")
    from hpcjobs.goodput.records import job_times

    job = job_times([("x", start)], "x", 1, 0.0, [AllocationTimes(10.0, 31.0)], running=False)
    g = compute(job, [None], now=0.0)
    assert g.buckets["queue"] == 10.0 and g.startup_parts["launch"] == 5.0 and g.buckets["other"] == 1.0


@pytest.mark.train
def test_a_local_run_killed_stopped_and_resumed_adds_up_to_its_wall_time(tmp_path: Path) -> None:
    """The real thing: 2 local ranks; one rank SIGKILLed after step 50 (the job fails), a second job resumes from
    the step-40 checkpoint and is stopped with Ctrl-C, a third finishes. Each job's buckets add up to the wall
    time the test measured around its `hpcjobs submit` within 1 s, and the killed job's steps past 40 are rework."""
    import os
    import signal
    import subprocess
    import time

    from conftest import BIN

    run = tmp_path / "run"
    args = [str(BIN / "hpcjobs"), "submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run),
            "--max-recoveries", "0",  # the killed job ends failed: the next job resumes it
            "trainers.tasks.lm", "--size", "tiny", "--steps", "300", "--log-every", "5", "--ckpt-every", "20"]

    def heartbeat_at(step: int, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.time() + 240
        while True:
            try:
                if json.loads((run / "heartbeat.json").read_text())["step"] >= step:
                    return
            except (OSError, ValueError, KeyError):
                pass
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)

    measured = []
    for job in range(3):
        t0 = time.time()
        proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=os.environ.copy())
        if job == 0:
            heartbeat_at(50, proc)
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            # a rank, not the launcher's warm spare (hpcjobs.protocol.rejoin: it waits, imported, for a lost rank)
            ranks = [c for c in children if b"HPCJOBS_SPARE=" not in Path(f"/proc/{c}/environ").read_bytes()]
            os.kill(int(ranks[-1]), signal.SIGKILL)
        elif job == 1:
            heartbeat_at(120, proc)
            proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=300)  # killed: a failure; Ctrl-C: 130, as an interrupted command; then done
        assert code != 0 if job == 0 else code == (130 if job == 1 else 0)
        measured.append(time.time() - t0)
        (run / "heartbeat.json").unlink(missing_ok=True)  # the next job's heartbeat, not this one's, is waited for
    rep = report(str(run))
    assert len(rep.parts) == 3 and rep.total.starts == 3 and rep.total.interruptions == 2
    for g, wall in zip(rep.parts, measured, strict=True):
        assert abs(sum(g.buckets.values()) - g.wall_s) < 1e-6 and abs(g.wall_s - wall) < 1.0, (g.as_dict(), wall)
        assert g.buckets["productive"] > 0 and g.startup_parts["imports"] > 0 and 0 < (g.ettr or 0) < 1
    killed, stopped, finished = rep.parts
    assert killed.buckets["rework"] > 0 and stopped.buckets["rework"] == finished.buckets["rework"] == 0
    assert stopped.buckets["checkpoint"] > 0
    print(text(rep), "\nmeasured around each submit:", [round(w, 2) for w in measured])


def test_torn_or_foreign_records_are_skipped(tmp_path: Path) -> None:
    """A killed writer's torn last line, a hand-edited value of the wrong type: the report still adds up."""
    run = killed_and_resumed(tmp_path / "run")
    for name in ("restarts.jsonl", "startup.jsonl", "saves.jsonl", "failures.jsonl", "allocations.jsonl"):
        lines(run / name, [{"job_id": "A", "restart": "0", "time": "x", "step": None, "blocking_s": -5,
                            "start": [], "end": {}, "first_step": "soon"}])
        with (run / name).open("a") as f:
            f.write('{"torn": ')
    (run / "final.json").write_text(json.dumps({"state": "finished", "step": "80", "time": 2075.0, "job_id": "B"}))
    (run / "heartbeat.json").write_text("[1, 2]")
    rep = report(str(run), state_of=lambda _: None)
    assert rep.total.wall_s == 69.0 == sum(rep.total.buckets.values()) and rep.total.buckets["rework"] == 9.5


def test_status_has_a_goodput_line_and_compare_an_ettr_column(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from hpcjobs.goodput import compare

    run = killed_and_resumed(tmp_path / "run")
    (run / "spec.json").write_text("{}")
    assert compare.rows_for([str(run)])[0].ettr == 31.0 / 69.0  # every job of the folder
    JobStore().add(JobRecord("B", "lm", "local", "local", 1, 2, str(run), {}, {}, 2050.0))
    assert main(["status", "B"]) == 0
    out = capsys.readouterr().out
    assert "goodput:     ETTR 52.5%: 15.5 s productive of 29.5 s allocated (wall 30.0 s); hpcjobs goodput B" in out
    assert main(["status", "B", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["goodput"]["buckets_s"]["productive"] == 15.5


def test_compare_plot_draws_each_runs_buckets_below_the_loss(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from hpcjobs.goodput import compare, plot

    run = killed_and_resumed(tmp_path / "run")
    (run / "spec.json").write_text("{}")
    lines(run / "metrics.jsonl", [{"step": 10, "loss": 2.0}])
    rows = compare.rows_for([str(run)])
    assert rows[0].goodput_s["rework"] == 9.5 and "goodput_s" not in rows[0].as_dict()
    ax = Figure().add_subplot()
    assert plot.goodput_bars(ax, rows) == 1
    widths = [p.get_width() for p in ax.patches]
    assert len(widths) == len(BUCKETS) and abs(sum(widths) - 1) < 1e-9  # shares of one bar add up to its wall
    assert plot.plot(rows, tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_a_start_recovered_in_its_allocation_counts_its_lost_steps_as_rework_and_the_gap_as_recovery(
        tmp_path: Path) -> None:
    """Rank 1 killed at step ~300 after the checkpoint of step 200; the recovery (its `stopped: fault` line, not a
    stop at a checkpoint) starts the ranks again in the same allocation from step 200."""
    run = tmp_path / "run"
    run.mkdir()
    lines(run / "restarts.jsonl", [
        {"time": 1000.0, "restart": 0, "job_id": J, "world_size": 2},
        {"time": 1062.0, "restart": 0, "job_id": J, "stopped": "fault", "step": 200, "recovery": 1,
         "cause": "rank 1 on n2: Killed", "how": "allocation", "exclude": []},
        {"time": 1065.0, "restart": 1, "job_id": J, "world_size": 2}])
    lines(run / "startup.jsonl", marks(J, 0, 0, (1000, 1005, 1006, 1008, 1010))
          + marks(J, 1, 200, (1065, 1070, 1071, 1073, 1075)))
    lines(run / "saves.jsonl", [save(J, 0, 200, 1040, 0.0), save(J, 1, 400, 1095, 0.0)])
    lines(run / "failures.jsonl", [{"time": 1060.0, "job_id": J, "restart": 0, "rank": 0, "host": "n1",
                                    "error": "RuntimeError: [Gloo] Connection closed by peer"}])
    (run / "final.json").write_text(json.dumps({"state": "finished", "step": 400, "time": 1100.0, "job_id": J}))
    (run / "allocations.jsonl").write_text(json.dumps({"job_id": J, "start": 1000.0, "end": 1100.0}) + "\n")
    JobStore().add(JobRecord(J, "lm", "local", "local", 1, 2, str(run), {}, {}, 1000.0))
    [g] = report(str(run), state_of=lambda _: JobState.COMPLETED).parts
    assert g.buckets["rework"] == 20.0  # step 200's save (1040) to the start's last record (1060): done again
    assert g.buckets["recovery"] == 5.0  # its last record (1060) to the next start's launch (1065)
    assert g.wall_s == 100.0 == sum(g.buckets.values())


def test_goodput_plot_draws_each_start_on_the_wall_clock(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 37: `goodput --plot` draws a job's timeline, one bar per start: the killed start's bar ends in a cross
    and its training after the save the next start resumed is hatched; a bad file name is one line, nothing read."""
    pytest.importorskip("matplotlib")
    from hpcjobs.goodput import report as goodput_report

    run = killed_and_resumed(tmp_path / "run")
    starts = goodput_report.timeline_starts(str(run))
    assert [(job, s.ended, resumed) for job, s, resumed in starts] == [("A", "failed", 40), ("B", "finished", None)]
    drawn: list[tuple[str, tuple[float, ...]]] = []
    from matplotlib.axes import Axes

    def spy(self: Any, xranges: Any, yrange: Any, **kw: Any) -> Any:
        drawn.extend((kw.get("hatch") or kw.get("color") or "", tuple(x)) for x in xranges)
        return original(self, xranges, yrange, **kw)

    original = Axes.broken_barh
    monkeypatch.setattr(Axes, "broken_barh", spy)
    assert main(["goodput", str(run), "--plot", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in capsys.readouterr().out
    assert ("///", (2025.5 - 2001.0, 2035.0 - 2025.5)) in drawn  # A's steps after its step-40 save: done again
    assert main(["goodput", str(run), "--plot", str(tmp_path / "t.txt")]) == 2
    assert "cannot tell the format" in capsys.readouterr().err


def test_a_script_that_reports_no_steps_gets_unknown_rows_not_0_s_productive(tmp_path: Path) -> None:
    """Issue 37: a plain script's job (no start-up marks) showed "productive training 0.00" and "0.0 s productive"
    in status; its training is not told apart from its start-up, and the rows say so."""
    from hpcjobs.goodput.report import status_line, text

    run = killed_and_resumed(tmp_path / "run")
    (run / "startup.jsonl").unlink()  # what a plain script's run folder holds: no marks
    JobStore().add(JobRecord("A", "plain", "local", "local", 1, 2, str(run), {}, {}, 2000.0))
    rep = report("A", state_of=lambda _: JobState.COMPLETED)
    g = rep.total
    assert g.ettr is None and g.as_dict()["training_known"] is False
    said = text(rep)
    assert "productive training                 unknown" in said and "start-up and training" in said, said
    assert "not told apart from its start-up" in said
    assert "productive time unknown of" in status_line(g) and "0.0 s productive" not in status_line(g)


def test_each_fault_gets_a_line_with_its_detection_resume_and_redone_training(tmp_path: Path) -> None:
    """Issue 40 item 5: per fault, the time to notice it, the step and tier the next start resumed from, the time
    from the fault to the first step trained again, and the training done in vain."""
    run = killed_and_resumed(tmp_path / "run")
    startup = [json.loads(x) for x in (run / "startup.jsonl").read_text().splitlines()]
    lines(run / "startup.jsonl", [dict(r, resumed_tier="local tier") if r["job_id"] == "B" else r for r in startup])
    for job, submitted in (("A", 2000.0), ("B", 2050.0)):
        JobStore().add(JobRecord(job, "lm", "local", "local", 1, 2, str(run), {}, {}, submitted))
    rep = report(str(run), state_of=lambda _: JobState.COMPLETED)
    (fault,) = rep.faults
    assert (fault.job_id, fault.hang, fault.noticed_s, fault.resumed_step, fault.tier) == \
        ("A", False, 0.0, 40, "local tier")
    assert fault.to_first_step_s == 2059.0 - 2035.0 and fault.redone_s == 2035.0 - 2025.5
    said = text(rep)
    assert "fault: A start 0: fault after step 40, noticed at once; resumed from step 40 (local tier), training " \
           "again 24.0 s after the fault, 9.5 s of training done again" in said, said
    assert rep.as_dict()["faults"][0]["tier"] == "local tier"
    lines(run / "failures.jsonl", [{"time": 2035.0, "job_id": "A", "restart": 0, "rank": 1, "idle_s": 8.0}])
    (hang,) = report("A", state_of=lambda _: JobState.COMPLETED).faults  # one job asked: its fault, B's resume
    assert (hang.hang, hang.noticed_s, hang.redone_s, hang.resumed_step) == (True, 8.0, 1.5, 40)
