"""The Slurm backend's `doctor`: the request as Slurm sees it (`sbatch --test-only` of the rendered script), the
partition, its nodes' GPUs and CPUs, accounts and QOS, requeue and the preemption signal.

Pure parsers and checks over the text of `scontrol show partition|node|config` and `sacctmgr show assoc` (recorded
on the test cluster for the unit tests), and one function, `doctor`, that runs those read-only commands.
"""

from __future__ import annotations

import os
import re
import tempfile
from subprocess import CompletedProcess

import hostlist

from hpcjobs.backends.common import CONTROLLER_HINT, Runner, last_words
from hpcjobs.profiles.slurmtime import format_time, parse_time
from hpcjobs.protocol.timeouts import COLLECTIVE_TIMEOUT
from hpcjobs.request.checks import Check, Result
from hpcjobs.request.spec import JobSpec

UNLIMITED = ("UNLIMITED", "INFINITE", "NONE")
DOWN = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING", "MAINT", "FUTURE",
                  "INVAL"})
"""Node state words (`IDLE+DRAIN`, `DOWN*`) that keep a job off a node; a powered-down cloud node is not one."""
MIN_GRACE_S = 10
"""A SIGTERM preemption leaves GraceTime to save: under this, no checkpoint of size can be committed in time."""


def key_values(line: str) -> dict[str, str]:
    """`scontrol -o` output: Key=Value pairs, values running to the next ` Key=` (some hold spaces, e.g. OS=)."""
    return dict(re.findall(r"(\w+)=(.*?)(?=\s+\w+=|\s*$)", line.strip()))


def records(text: str, key: str) -> dict[str, dict[str, str]]:
    """One `scontrol show ... -o` record per line, by its `key` (PartitionName, NodeName)."""
    out = {}
    for line in text.splitlines():
        kv = key_values(line)
        if key in kv:
            out[kv[key]] = kv
    return out


def config(text: str) -> dict[str, str]:
    """`scontrol show config`: `Key = Value` lines."""
    return {k.strip(): v.strip() for k, _, v in (line.partition("=") for line in text.splitlines()) if _}


def gres_gpus(gres: str) -> int:
    """GPUs in a node's Gres (`gpu:8`, `gpu:h100:8(S:0-1)`, `gpu:a100:4,shard:8`); 0 without any."""
    total = 0
    for item in re.sub(r"\(.*?\)", "", gres).split(","):  # sockets first: `(S:0,2)` holds a comma
        parts = item.split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def check_test_only(proc: CompletedProcess[str]) -> Check:
    said = " ".join(line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip())
    m = re.search(r"to start at (\S+) using (\d+) processors on nodes (\S+)", said)
    if proc.returncode == 0 and m:
        return Check("request", Result.PASS, f"sbatch --test-only: would start at {m.group(1)} on {m.group(3)}")
    return Check("request", Result.FAIL, f"sbatch --test-only refused it: {said or f'exit {proc.returncode}'}",
                 "see the rows below; `hpcjobs render ...` shows the script that was tested")


def pick_partition(spec: JobSpec, parts: dict[str, dict[str, str]]) -> tuple[str | None, dict[str, str] | None]:
    name = spec.partition or next((n for n, p in parts.items() if p.get("Default") == "YES"), None)
    return name, parts.get(name) if name else None


def check_partition(spec: JobSpec, parts: dict[str, dict[str, str]]) -> Check:
    name, part = pick_partition(spec, parts)
    valid = ", ".join(sorted(parts)) or "none"
    if part is None:
        given = f"partition {name!r} does not exist" if name else "no partition given and the cluster has no default"
        return Check("partition", Result.FAIL, f"{given}; valid: {valid}",
                     "set partition: in the profile, or --partition NAME")
    if part.get("State") != "UP":
        return Check("partition", Result.FAIL, f"{name} is {part.get('State')}", f"another partition ({valid})")
    max_time = part.get("MaxTime", "UNLIMITED")
    if max_time not in UNLIMITED and spec.time_seconds > parse_time(max_time):
        return Check("partition", Result.FAIL, f"{name}: --time {spec.time} is over its MaxTime {max_time}",
                     f"--time {format_time(parse_time(max_time))} or less (the job requeues itself to go on)")
    return Check("partition", Result.PASS, f"{name} is UP, MaxTime {max_time}, nodes {part.get('Nodes')}")


def check_nodes(spec: JobSpec, parts: dict[str, dict[str, str]], nodes: dict[str, dict[str, str]]) -> Check:
    name, part = pick_partition(spec, parts)
    if part is None:
        return Check("nodes", Result.SKIP, "no partition to look at")
    members = [nodes[n] for n in hostlist.expand_hostlist(part.get("Nodes", "")) if n in nodes]
    gpus = spec.gpus_per_node if spec.profile.gpu_request != "none" else 0
    cpus = spec.gpus_per_node * spec.profile.cpus_per_gpu
    fit = [n for n in members if gres_gpus(n.get("Gres", "")) >= gpus and int(n.get("CPUTot", "0")) >= cpus
           and not DOWN & set(n.get("State", "").rstrip("*~#!%$@^-").split("+"))]
    want = f"{gpus} GPUs and {cpus} CPUs" if gpus else f"{cpus} CPUs"
    kinds = sorted({f"{n.get('Gres', '(null)')} {n.get('CPUTot')} CPUs" for n in members})
    found = f"{len(fit)} of {len(members)} nodes in {name} have {want} and are up (they have: {'; '.join(kinds)})"
    if len(fit) >= spec.nodes:
        return Check("nodes", Result.PASS, found)
    return Check("nodes", Result.FAIL, f"{found}; the job needs {spec.nodes}",
                 "fewer --gpus or --nodes, or cpus_per_gpu/gpus_per_node in the profile as the nodes have them")


def check_account(spec: JobSpec, conf: dict[str, str], assoc: CompletedProcess[str] | None) -> Check:
    storage = conf.get("AccountingStorageType", "accounting_storage/none")
    if storage.endswith("/none") or assoc is None:
        return Check("account", Result.SKIP, f"not checked: no accounting here ({storage})")
    if assoc.returncode != 0:
        return Check("account", Result.SKIP, f"not checked: sacctmgr failed ({assoc.stderr.strip()[:120]})")
    rows = [line.split("|") for line in assoc.stdout.splitlines() if line.strip()]
    accounts = sorted({r[0].lower() for r in rows if r and r[0]})  # Slurm keeps them in lower case
    qos = sorted({q.lower() for r in rows if len(r) > 2 for q in r[2].split(",") if q})
    enforced = conf.get("AccountingStorageEnforce", "").lower()
    problems = []
    if spec.account and spec.account.lower() not in accounts:
        problems.append(f"account {spec.account!r} is not one of yours ({', '.join(accounts) or 'none'})")
    if spec.qos and spec.qos.lower() not in qos:
        problems.append(f"qos {spec.qos!r} is not one of yours ({', '.join(qos) or 'none'})")
    found = f"account {spec.account or '(your default)'}, qos {spec.qos or '(default)'}"
    if not problems:
        return Check("account", Result.PASS, f"{found}: among your associations")
    if "associations" in enforced or "qos" in enforced or "limits" in enforced:
        return Check("account", Result.FAIL, "; ".join(problems), "set account:/qos: in the profile to one of yours")
    return Check("account", Result.SKIP, "; ".join(problems) + " (not enforced here: Slurm would accept it)")


def by_qos(conf: dict[str, str]) -> Check | None:
    """Under preempt/qos the QOS's PreemptMode and GraceTime apply, which `scontrol` does not show: not guessed."""
    if conf.get("PreemptType", "").endswith("/qos"):
        return Check("preemption", Result.SKIP, "not checked: PreemptType=preempt/qos (the QOS's PreemptMode and "
                     "GraceTime apply; `sacctmgr show qos` lists them)")
    return None


def check_requeue(conf: dict[str, str], part: dict[str, str] | None) -> Check:
    if conf.get("JobRequeue", "1") == "0":
        return Check("requeue", Result.PASS, "JobRequeue=0, but the job asks for --requeue itself")
    mode = (part or {}).get("PreemptMode") or conf.get("PreemptMode", "OFF")
    if "CANCEL" in mode.upper():
        return Check("requeue", Result.FAIL, f"a preemption cancels jobs here (PreemptMode={mode}): it would not "
                     "come back", "a partition whose PreemptMode is REQUEUE, or one that is not preemptible")
    if mode.upper().startswith("OFF"):
        return Check("requeue", Result.PASS, f"not preemptible (PreemptMode={mode}); the time limit still requeues")
    return Check("requeue", Result.PASS, f"a preemption requeues the job (PreemptMode={mode})")


def check_signal(spec: JobSpec, conf: dict[str, str], part: dict[str, str] | None) -> Check:
    p = spec.profile.preemption
    user_signal = "preempt_send_user_signal" in conf.get("SlurmctldParameters", "")
    grace = int((part or {}).get("GraceTime", "0") or 0)
    limit = f"the time limit sends SIG{p.signal} {p.seconds_before} s before it"
    sent = f"SIG{p.signal} (preempt_send_user_signal)" if user_signal else "SIGTERM"
    found = f"a preemption sends {sent}, then SIGKILL after GraceTime={grace} s; {limit}"
    if grace < MIN_GRACE_S and not (part or {}).get("PreemptMode", "").upper().startswith("OFF"):
        return Check("signal", Result.FAIL, found + ": too little time to save",
                     f"ask the admins for GraceTime ≥ {p.seconds_before} on this partition")
    return Check("signal", Result.PASS, found + ("" if user_signal else " (the trainer saves and requeues on it)"))


CRED_EXPIRE_DEFAULT_S = 120
"""Slurm's own default for AuthInfo's cred_expire; a requeued job is held that long plus 1 s before it may run."""


def seconds(value: str) -> int | None:
    """`60 sec`, `300`: a config line's seconds; None when it holds none."""
    m = re.match(r"\s*(\d+)", value)
    return int(m.group(1)) if m else None


def check_requeue_delay(conf: dict[str, str]) -> Check:
    """How long a requeued job (every preemption, every time limit) waits before it may run again."""
    m = re.search(r"cred_expire=(\d+)", conf.get("AuthInfo", ""))
    expire = int(m.group(1)) if m else CRED_EXPIRE_DEFAULT_S
    found = (f"a requeued job waits {expire + 1} s before it may run again (AuthInfo cred_expire="
             f"{expire if m else f'{expire}, the default'} + 1 s)")
    return Check("requeue delay", Result.PASS, found)


def check_node_failure(spec: JobSpec, conf: dict[str, str]) -> Check:
    """Whether a dead node gets the job requeued (Slurm notices after SlurmdTimeout) or failed (the other ranks'
    collective timeout ends it first, and a failed job is not requeued)."""
    name, default = COLLECTIVE_TIMEOUT
    try:
        collective = float(spec.env.get(name, default))
    except ValueError:
        collective = default
    slurmd = seconds(conf.get("SlurmdTimeout", ""))
    if not slurmd:
        return Check("node failure", Result.SKIP, "not checked: SlurmdTimeout not shown (0: Slurm never marks a "
                     "silent node down)")
    found = f"SlurmdTimeout={slurmd} s, training collectives time out after {collective:g} s ({name})"
    if slurmd < collective:
        return Check("node failure", Result.PASS, f"{found}: a dead node is noticed first, the job is requeued")
    return Check("node failure", Result.FAIL, f"{found}: when a node dies the other ranks time out first and the "
                 "job ends FAILED instead of being requeued",
                 f"env: {{{name}: {slurmd + 60}}} in the profile (a hung rank is then also found that late)")


def doctor(spec: JobSpec, script: str, run: Runner) -> list[Check]:
    """Every check, running only read-only Slurm commands (and `sbatch --test-only`, which queues nothing)."""
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", delete=False) as f:
        f.write(script)
    try:
        checks = [check_test_only(run(["sbatch", "--test-only", f.name]))]
    finally:
        os.unlink(f.name)
    shown = run(["scontrol", "show", "config"])
    if shown.returncode != 0:  # every row below would be judged on nothing: Slurm's defaults would pass
        return [*checks, Check("cluster", Result.FAIL, f"scontrol show config could not answer: {last_words(shown)}; "
                               "nothing else was checked", f"{CONTROLLER_HINT}, and this machine's slurm.conf")]
    conf = config(shown.stdout)
    parts = records(run(["scontrol", "show", "partition", "-o"]).stdout, "PartitionName")
    nodes = records(run(["scontrol", "show", "node", "-o"]).stdout, "NodeName")
    _, part = pick_partition(spec, parts)
    accounting = not conf.get("AccountingStorageType", "accounting_storage/none").endswith("/none")
    assoc = run(["sacctmgr", "-n", "-P", "show", "assoc", "where", f"user={_user()}",
                 "format=Account,Partition,QOS"]) if accounting else None
    preemption = by_qos(conf)
    return [*checks, check_partition(spec, parts), check_nodes(spec, parts, nodes), check_account(spec, conf, assoc),
            *([preemption] if preemption else [check_requeue(conf, part), check_signal(spec, conf, part)]),
            check_requeue_delay(conf), check_node_failure(spec, conf)]


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
