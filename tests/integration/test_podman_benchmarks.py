"""Benchmark tasks as published, under podman: SWE-bench records in images laid out as the official
ones are (the repository at /testbed, a ``testbed`` environment behind
``/opt/miniconda3/bin/activate``: a stand-in for conda, which cannot be fetched here), and
Terminal-Bench 1 / Harbor task directories with their harness settings; every record and task is
written here, and every image built ``FROM`` the Debian base image (once per session, removed after).

Shown: a Django-style and a pytest-style instance (classic records converted by the 4.x harness)
resolve with their gold patch and not with none; a task's network on and off, its CPU and memory
limits and its WORKDIR; a bash-only solution passing while the do-nothing agent fails; a test over
its memory limit killed and graded as failed; an agent timeout ending the episode; ``tasks check``
finding the planted false positive and broken oracle; a short GRPO run on the SWE instances.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megathunder.config import AgentLoopConfig, VerifierConfig
from megathunder.rollout.agent_loop import AgentLoop
from megathunder.rollout.sandbox import images
from megathunder.rollout.scripted import ScriptedPolicy
from megathunder.rollout.tasks.datasets import SweTask, load_swe_bench, read_records
from megathunder.rollout.tasks.swe_harness import HarnessError, convert_records, harness_python
from megathunder.rollout.tasks.task import tool_call_text
from megathunder.rollout.tasks.task_check import check_instances
from megathunder.rollout.tasks.terminal_bench import TerminalBenchTask
from megathunder.rollout.verifiers import VerifierPool
from tests.podman_helpers import podman_base, podman_cfg, remove_images
from tests.rollout_helpers import codec
from tests.benchmark_tasks import SWE_REPOS, swe_instance
from tests.task_sets import SOLVED, UPPER, checked_set, harbor_task

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def podman():
    return podman_base()


# --- SWE-bench instances in images laid out as the official ones (tests/benchmark_tasks.py) -------

@pytest.fixture(scope="module")
def swe_instances(podman, tmp_path_factory):
    """(path of the converted 5.x records, their task): a Django-style and a pytest-style instance,
    each image tagged with the harness's own instance image name."""
    try:
        python = harness_python()
    except HarnessError as err:
        if os.environ.get("MEGATHUNDER_REQUIRE_SWE_HARNESS") == "1":
            pytest.fail(str(err))
        pytest.skip(str(err))
    tag, runtime_args = podman
    root = tmp_path_factory.mktemp("swe")
    made = [swe_instance(root, repo, 90101 + k) for k, repo in enumerate(SWE_REPOS)]
    classic = root / "classic.jsonl"
    classic.write_text("".join(json.dumps(r) + "\n" for r, _ in made))
    converted = convert_records(read_records(classic), python)
    path = root / "swe_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in converted))
    built = []
    try:
        for rec, (_, ctx) in zip(converted, made, strict=True):
            dockerfile = ctx / "Dockerfile"
            dockerfile.write_text(dockerfile.read_text().replace("{base}", tag))
            images.build_from_directory(rec["image"], str(dockerfile), str(ctx), runtime_args=runtime_args)
            built.append(rec["image"])
        yield path, SweTask("swe_bench", load_swe_bench(path))
    finally:
        remove_images(built, runtime_args)


def test_django_and_pytest_style_instances_resolve_with_the_gold_patch_only(podman, swe_instances):
    """The eval script 4.x generates (activate the testbed env, cd /testbed, reset and apply the
    test patch, the repository's own runner) runs under bash in the instance's image; the gold
    patch resolves each instance, the empty patch does not; both are the harness's grading."""
    _, task = swe_instances
    insts = task.all_instances()
    assert [i.metadata["log_parser"] for i in insts] == ["parse_log_django", "parse_log_pytest"]
    checks = asyncio.run(check_instances(task, insts, podman_cfg(podman, memory_mb=512, max_processes=256),
                                         VerifierConfig(timeout_s=60), concurrency=2))
    for inst, c in zip(insts, checks, strict=True):
        assert c.ok, (inst.instance_id, c.problems, c.detail)
        assert c.oracle.reward == 1.0 and c.null.reward == 0.0 and not c.oracle.infra and not c.null.infra
    # what the unresolved run saw: the F2P test failing, the P2P one passing, from the repository's runner
    (ep,) = asyncio.run(_episodes(task, insts[:1], ["Nothing to do."], podman_cfg(podman, memory_mb=512)))
    assert ep.reward.tests == {insts[0].metadata["fail_to_pass"][0]: "FAILED", insts[0].metadata["pass_to_pass"][0]: "PASSED"}


async def _episodes(task, insts, turns, sandbox, agent=None):
    c = codec()
    loop = AgentLoop(ScriptedPolicy(c, {i.prompt: turns for i in insts}), c, task,
                     agent or AgentLoopConfig(max_total_tokens=8192, max_new_tokens_per_turn=1024),
                     sandbox, VerifierPool(VerifierConfig(timeout_s=60, on_infra_failure="drop_group")))
    return await loop.run_batch(insts, 1)


def test_a_short_grpo_run_on_swe_instances_through_podman(podman, swe_instances, tmp_path):
    """`megathunder train configs/swe_bench.yaml` for 2 thunder steps on the SWE-style instances in
    the 5.x schema, through podman: the check before training passes them, every episode is graded
    by the harness in its container (no infrastructure failure), and the run finishes."""
    path, _ = swe_instances
    tag, runtime_args = podman
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "megathunder.cli", "train", str(ROOT / "configs/swe_bench.yaml"),
           f"run.output_dir={out}", "run.num_steps=2", "run.wandb=disabled", "run.checkpoint_every=0",
           "run.progress=false", f"task.path={path}", "task.check_before_training=refuse", "task.check_concurrency=2",
           f"sandbox.runtime_args={json.dumps(runtime_args)}", "sandbox.memory_mb=512", "sandbox.cpus=1",
           "sandbox.max_processes=256", "sandbox.tmpfs_mb=64", "sandbox.wall_time_s=30", "sandbox.cpu_time_s=30",
           "task.test_run.wall_time_s=120", "batch.num_prompts_per_batch=2", "batch.samples_per_prompt=2",
           "agent.max_turns=2", "agent.max_concurrent_episodes=4", "agent.episode_wall_time_s=120",
           "verifier.max_concurrent=2", "ledger.max_group_slots=2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all(r["num_episodes"] == 4 for r in rows)
    checked = json.loads((out / "tasks_check.json").read_text())["tasks"]
    assert [r["ok"] for r in checked] == [True, True]
    journal = [json.loads(line)["rec"] for line in (out / "journal.jsonl").read_text().splitlines()]
    graded = [r for r in journal if r["type"] == "trajectory"]
    assert len(graded) == 8 and all(r["failure"] is None and r["reward"] in (0.0, 1.0) for r in graded), \
        [(r["failure"], r["verifier"]) for r in graded]
    assert all('"log_valid": true' in r["verifier"]["detail"] for r in graded)  # the harness graded a real test run


# --- Terminal-Bench 1 and Harbor task directories with their harness settings ---------------------

PROBE = ("pwd; cat /sys/fs/cgroup/cpu.max 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us; "
         "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes; "
         "python3 -c \"import socket, struct\n"
         "gw = [l.split() for l in open('/proc/net/route')][1:]\n"
         "gw = [socket.inet_ntoa(struct.pack('<L', int(f[2], 16))) for f in gw if f[1] == '00000000']\n"
         "s = socket.socket(); s.settimeout(3)\n"
         "try: s.connect((gw[0] if gw else '10.88.0.1', {port})); print('CONNECTED')\n"
         "except (OSError, IndexError) as e: print('NO NETWORK', e)\"")


@pytest.fixture(scope="module")
def terminal_tasks(podman, tmp_path_factory):
    """Task directories of both formats, each image built from its own Dockerfile on first use."""
    tag, runtime_args = podman
    root = tmp_path_factory.mktemp("tb")
    tasks = root / "tasks"
    expected = checked_set(tasks, base=tag)
    harbor_task(tasks, "harbor-limits", tag, check=SOLVED, solution=UPPER, allow_internet=False,
                toml_extra="cpus = 1.5\nmemory_mb = 160\nworkdir = \"/srv/work\"\n",
                dockerfile_extra="WORKDIR /srv/work\nCOPY input.txt /srv/work/\n")
    harbor_task(tasks, "harbor-online", tag, check=SOLVED, solution=UPPER, allow_internet=True)
    harbor_task(tasks, "harbor-oom-test", tag, solution=UPPER, toml_extra="memory_mb = 128\n",
                check=f"{SOLVED} && python3 -c 'x = bytearray(400 << 20); x[::4096] = bytes(len(x) // 4096)'")
    harbor_task(tasks, "harbor-slow-agent", tag, check=SOLVED, solution=UPPER,
                toml_extra="", dockerfile_extra="")
    slow = tasks / "harbor-slow-agent" / "task.toml"
    slow.write_text(slow.read_text().replace("[agent]\ntimeout_sec = 120.0", "[agent]\ntimeout_sec = 3.0"))
    task = TerminalBenchTask(str(tasks))
    try:
        yield task, expected
    finally:
        remove_images([i.image for i in task.all_instances()], runtime_args)


def _by_id(task):
    return {i.instance_id: i for i in task.all_instances()}


def test_network_limits_and_work_dir_are_the_task_s(podman, terminal_tasks):
    """allow_internet=false: only loopback; true: the runtime's network (a server on this host is
    reached through its gateway). cpus and memory_mb become the container's, the work dir is the
    task's own (not /workspace), and the bash tool runs bash."""
    task, _ = terminal_tasks
    server = socket.create_server(("0.0.0.0", 0))
    port = server.getsockname()[1]
    accepted: list = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    insts = [_by_id(task)[k] for k in ("harbor-limits", "harbor-online")]
    probe = [tool_call_text("bash", command=PROBE.format(port=port)),
             tool_call_text("bash", command="echo ${BASH_VERSION:+bash}; shopt -q extglob; echo $?"), "Done."]
    try:
        limited, online = asyncio.run(_episodes(task, insts, probe, podman_cfg(podman, memory_mb=512)))
    finally:
        server.close()
    seen = limited.turns[0].tool_runs[0].observation.splitlines()
    assert seen[:3] == ["/srv/work", "150000", str(160 << 20)] and seen[3].startswith("NO NETWORK"), seen
    assert online.turns[0].tool_runs[0].observation.splitlines()[-1] == "CONNECTED" and accepted
    assert limited.turns[1].tool_runs[0].observation.split() == ["bash", "1"]
    assert limited.reward.reward == 0.0 and online.reward.reward == 0.0  # nothing was solved


def test_the_oracle_passes_the_null_agent_fails_and_the_check_finds_the_planted_tasks(podman, terminal_tasks):
    """Under podman, with each task's image built from its Dockerfile: the bash-only solution and
    the others pass, the do-nothing agent fails; the planted false positive and broken oracle are
    found; a test over the task's memory limit is killed (the container's OOM killer) and graded as
    failed, not as an infrastructure error."""
    task, expected = terminal_tasks
    insts = [i for i in task.all_instances() if i.instance_id in expected or i.instance_id == "harbor-oom-test"]
    start = time.monotonic()
    checks = asyncio.run(check_instances(task, insts, podman_cfg(podman, memory_mb=512, drop_capabilities=False),
                                         VerifierConfig(timeout_s=60), concurrency=2))
    got = {c.instance_id: c.problems for c in checks}
    assert got == {**expected, "harbor-oom-test": ["broken_oracle"]}, [(c.instance_id, c.detail) for c in checks]
    oom = next(c for c in checks if c.instance_id == "harbor-oom-test")
    assert oom.oracle.reward == 0.0 and oom.oracle.status == "ok" and not oom.oracle.infra  # a failed test
    builds = [c.build_s for c in checks]
    assert all(b > 0 for b in builds), builds  # each task's image was built here, once
    print(f"tasks check under podman: {len(checks)} tasks in {time.monotonic() - start:.1f} s")


def test_a_test_killed_over_its_memory_limit_is_a_failed_test(podman, terminal_tasks):
    task, _ = terminal_tasks
    inst = _by_id(task)["harbor-oom-test"]
    # the runtime's default capabilities, as configs/terminal_bench.yaml has them: root writes /solution
    (ep,) = asyncio.run(_episodes(task, [inst], task.scripted_turns(inst),
                                  podman_cfg(podman, memory_mb=512, drop_capabilities=False)))
    assert ep.turns[1].tool_runs[0].ok, ep.turns[1].tool_runs[0]  # the solution ran: the test's allocation is what fails
    detail = json.loads(ep.reward.detail)
    assert ep.reward.status == "ok" and ep.reward.reward == 0.0 and not ep.reward.infra
    assert detail["oom_killed"] is True, detail  # the container's OOM killer ended the test's allocation


def test_an_agent_timeout_ends_the_episode(podman, terminal_tasks):
    """[agent] timeout_sec = 3: a tool call still running then is killed, the episode ends with
    stop_reason wall_time, and the verifier still scores what is there."""
    task, _ = terminal_tasks
    inst = _by_id(task)["harbor-slow-agent"]
    assert inst.agent_timeout_s == 3.0
    start = time.monotonic()
    (ep,) = asyncio.run(_episodes(task, [inst], [tool_call_text("bash", command="sleep 60"), "Done."],
                                  podman_cfg(podman, memory_mb=512, wall_time_s=100, cpu_time_s=100)))
    assert ep.stop_reason == "wall_time" and ep.finished_at - ep.started_at < 15
    assert ep.reward.status == "ok" and ep.reward.reward == 0.0 and time.monotonic() - start < 60
