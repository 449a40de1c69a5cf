"""launch/slurm/grpo_128gpu.sh, the real script, on the local two-node cluster with CPU settings.

The job splits its two nodes into a rollout node (node1: one vLLM server, `megathunder serve`) and
a learner node (node2: the Megatron learner, DP=2 as two srun tasks, controller on rank 0), checks
both before training, trains, and on SIGUSR1 checkpoints and requeues itself; the requeued job
resumes. A component that does not come up ends the job quickly, naming it.
"""

from __future__ import annotations

import pytest

import ast
import json
import os
import re
import subprocess
import time

from tests.cluster import slurm_local
from tests.cluster.conftest import REPO
from tests.cluster.launch_jobs import HEALTH_TIMEOUT_S, mt_env, submit, wait_for

SCRIPT = "launch/slurm/grpo_128gpu.sh"
NUM_STEPS = 8


def test_dry_run_prints_the_128_gpu_plan_and_refuses_a_bad_split(tmp_path):
    env = dict(os.environ, MT_DRY_RUN="1", MT_NODELIST="gpu[01-16]", MT_LOG_DIR=str(tmp_path),
               MT_CONFIG="launch/slurm/grpo_128gpu.yaml", SLURM_CPUS_PER_TASK="12", SLURM_CPUS_ON_NODE="96")
    env.pop("SLURM_JOB_NODELIST", None)
    out = subprocess.run(["bash", SCRIPT], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # every step names its CPUs (Slurm 22.05-23.02 steps do not inherit the job's --cpus-per-task):
    # a rank its 12, a rollout node's servers the node's 96
    steps = [line for line in lines if " srun " in f" {line} "]
    assert steps and all("--cpus-per-task=" in line for line in steps), steps
    assert all("--cpus-per-task=96" in line for line in steps if "rollout_node.sh" in line)
    assert all("--cpus-per-task=12" in line for line in steps if "megathunder.cli train" in line)
    assert "rollout: 4 nodes (gpu01 gpu02 gpu03 gpu04), 1 vLLM servers per node, TP 8 each" in out.stdout
    assert "learner: 12 nodes (gpu05" in out.stdout and "8 ranks per node, world 96" in out.stdout
    assert sum("launch/slurm/rollout_node.sh" in line for line in lines) == 4
    train = [line for line in lines if "megathunder.cli train" in line]
    assert len(train) == 1 and "--ntasks=96" in train[0] and "--nodelist=gpu05,gpu06" in train[0]
    assert 'rollout.engine.server_urls=["http://gpu01:8100","http://gpu02:8100","http://gpu03:8100",' \
           '"http://gpu04:8100"]' in train[0]
    # weights stream over NCCL into the servers, meeting at the first learner node (not 127.0.0.1)
    assert ("rollout.engine.weight_transfer.kind=collective rollout.engine.weight_transfer.backend=nccl "
            "rollout.engine.weight_transfer.host=gpu05 rollout.engine.weight_transfer.port=29600") in train[0]

    bad = subprocess.run(["bash", SCRIPT], env=dict(env, MT_LEARNER_NODES="13"), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "FAILED: launch: the job has 16 nodes (gpu[01-16]) but MT_ROLLOUT_NODES + MT_LEARNER_NODES = 4 + 13" \
        in bad.stderr, bad.stderr
    bad = subprocess.run(["bash", SCRIPT], env=dict(env, MT_OVERRIDES="learner.parallel.tensor_parallel=0"),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "would run" not in bad.stdout
    assert "FAILED: config: megathunder: invalid configuration:\n  learner.parallel.tensor_parallel:" in bad.stderr


def test_swe_dry_run_places_sandbox_servers_beside_vllm_or_on_their_own_nodes(tmp_path):
    """launch/slurm/swe_128gpu.sh: a sandbox server (a job step named ``sandbox``, overlapping the
    rollout node's vLLM step) on each rollout node, their URLs and secret's name passed to the
    trainer, the plan counting their CPUs and memory per node; ``MT_SANDBOX_NODES`` moves them to the
    job's last nodes; a node that cannot hold them is refused before anything starts."""
    models = REPO / "tests" / "fixtures" / "models"
    env = dict(os.environ, MT_DRY_RUN="1", MT_NODELIST="gpu[01-16]", MT_LOG_DIR=str(tmp_path), MT_HOST_MEMORY_GB="2048",
               SLURM_CPUS_PER_TASK="12", SLURM_CPUS_ON_NODE="96",
               MT_OVERRIDES=f"learner.model.hf_checkpoint={models / 'Qwen2.5-32B-Instruct'}")
    env.pop("SLURM_JOB_NODELIST", None)

    def dry_run(**extra):
        return subprocess.run(["bash", "launch/slurm/swe_128gpu.sh"], env={**env, **extra}, cwd=REPO,
                              capture_output=True, text=True, timeout=300)

    out = dry_run()
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert ("sandboxes: 4 sandbox servers, one per node beside vLLM on the rollout nodes (gpu01 gpu02 gpu03 gpu04), "
            "port 8300") in out.stdout
    assert re.search(r"plan: [\d.]+ GiB per rank; fits", out.stdout), out.stdout
    assert "plan: sandbox servers: CPUs 64.0 of 80 free; memory 512.0 GiB of 1792.0 GiB free" in out.stdout, out.stdout
    serve = [line for line in lines if "megathunder.cli sandbox serve" in line]
    assert [re.search(r"--nodelist=(\S+)", line).group(1) for line in serve] == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert all("--overlap" in line and "--job-name=sandbox" in line and "--gpus" not in line for line in serve)
    assert all(f"--host gpu0{k + 1} --port 8300" in line for k, line in enumerate(serve))
    (train,) = [line for line in lines if "megathunder.cli train" in line]
    assert 'sandbox.server_urls=["http://gpu01:8300","http://gpu02:8300","http://gpu03:8300","http://gpu04:8300"]' in train
    assert "sandbox.api_key_env=MT_SANDBOX_API_KEY" in train and "--nodelist=gpu05," in train

    dedicated = dry_run(MT_NODELIST="gpu[01-18]", MT_SANDBOX_NODES="2")
    assert dedicated.returncode == 0, dedicated.stderr
    assert "2 sandbox servers, one per node on dedicated CPU nodes (gpu17 gpu18)" in dedicated.stdout
    (train,) = [line for line in dedicated.stdout.splitlines() if "megathunder.cli train" in line]
    assert 'sandbox.server_urls=["http://gpu17:8300","http://gpu18:8300"]' in train and "gpu17" not in \
        train.partition("--nodelist=")[2].split()[0]

    crowded = dry_run(MT_OVERRIDES=env["MT_OVERRIDES"] + " sandbox.max_sandboxes_per_server=128")
    assert crowded.returncode == 1 and "would run" not in crowded.stdout
    assert "FAILED: plan: megathunder plan: INFEASIBLE: sandbox.max_sandboxes_per_server: 128 sandboxes" in crowded.stderr


def test_grpo_job_trains_on_two_nodes_checkpoints_on_sigusr1_requeues_and_resumes(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    env = mt_env(slurm_cluster, tmp_path, MT_OVERRIDES=f"run.output_dir={run_dir} run.num_steps={NUM_STEPS}")
    job = submit(slurm_cluster, SCRIPT, env, tmp_path / "job.out")
    t0 = time.monotonic()
    metrics = run_dir / "metrics.jsonl"
    # training has begun (a step is done): the time limit is "near". Bounded by the servers' start
    # (at most HEALTH_TIMEOUT_S) plus the learner's and one step: ~60-90 s quiet, over 240 s loaded
    wait_for(slurm_cluster, job, HEALTH_TIMEOUT_S + 300, until=lambda info: metrics.is_file() and metrics.read_text().strip()
             or info.get("JobState") not in ("PENDING", "RUNNING"))
    assert job.state == "RUNNING", job.describe()
    slurm_cluster.run_client("scancel", "--signal=USR1", "--batch", str(job.job_id))
    wait_for(slurm_cluster, job, 120, until=lambda info: info.get("Restarts") == "1")
    first = job.logs(0)
    # Slurm holds a requeued job back (BeginTime, cred_expire = 120 s); start it in 3 s instead. Not
    # at once: a restart within the second of the requeue carries a credential the nodes still
    # count as revoked ("Killing non-startable batch job: Job credential revoked", seen in CI).
    slurm_cluster.run_client("scontrol", "update", f"JobId={job.job_id}", "StartTime=now+3", check=False)
    wait_for(slurm_cluster, job, 2 * HEALTH_TIMEOUT_S + 600, t0=t0)  # both attempts: ~150 s quiet, over 300 s busy
    print(job.describe())
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.describe()

    out = job.output()
    # both components came up, on their own nodes, and were checked before training
    assert "rollout: 1 nodes (node1)" in out and "learner: 1 nodes (node2), 2 ranks per node, world 2" in out
    assert "learner healthy: megathunder preflight: learner world 2 = tp 1 x pp 1 x dp 2 on node2 x2" in out
    assert re.search(r"rollout healthy: 1 vLLM servers answer /health \(http://127\.0\.0\.1:\d+\)", out), out
    assert out.count("training: srun") == 2  # the first attempt and the requeued one
    assert "rollout node node1: server 0 on 127.0.0.1:" in first["rollout-node1.out"]
    learner_log = next(text for name, text in first.items() if name.startswith("learner-"))
    assert "megathunder: rank 0/2 (local 0) on node2" in learner_log
    assert "megathunder: rank 1/2 (local 1) on node2" in learner_log
    # checkpoint-and-requeue: stopped after step k, resumed at k, every step trained once
    stop = re.search(r"megathunder: stopped after step (\d+) of 8; checkpoint (\S+);", learner_log)
    assert stop, learner_log
    k = int(stop.group(1))
    assert 1 <= k < NUM_STEPS
    assert "requeueing job" in out
    second = next(text for name, text in job.logs(1).items() if name.startswith("learner-"))
    assert f"resumed from {stop.group(2)} (step {k})" in second, second
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(NUM_STEPS)), steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == NUM_STEPS and summary["max_policy_lag"] == 0
    assert summary["max_probe_gap"] < 1e-3  # vLLM on node1 samples from the weights trained on node2
    print(f"job {job.job_id}: {job.seconds:.0f} s for both attempts; stopped after step {k}")


def test_a_rollout_server_that_cannot_start_fails_the_job_naming_it(slurm_cluster, tmp_path):
    env = mt_env(slurm_cluster, tmp_path, MT_ROLLOUT_MODEL=str(tmp_path / "no-such-model"),
                 MT_OVERRIDES=f"run.output_dir={tmp_path / 'run'}")
    job = submit(slurm_cluster, SCRIPT, env, tmp_path / "job.out")
    wait_for(slurm_cluster, job, HEALTH_TIMEOUT_S)
    print(job.describe())
    assert job.state == "FAILED" and job.exit_code == "1:0", job.describe()
    out = job.output()
    assert "megathunder launch: FAILED: rollout server on node1: exited with status 2 before it was healthy" in out
    assert f"rollout server: model {tmp_path / 'no-such-model'} has no config.json" in out
    assert "training: srun" not in out
    assert job.seconds < HEALTH_TIMEOUT_S, job.seconds  # its exit was seen: the health timeout not waited out


def test_a_layout_that_does_not_divide_the_learner_world_fails_the_job_naming_it(slurm_cluster, tmp_path):
    """``megathunder plan`` on a learner node refuses it before any server starts (the preflight,
    which forms the ranks' world, would refuse it next)."""
    env = mt_env(slurm_cluster, tmp_path,
                 MT_OVERRIDES=f"run.output_dir={tmp_path / 'run'} learner.parallel.data_parallel=3")
    job = submit(slurm_cluster, SCRIPT, env, tmp_path / "job.out")
    wait_for(slurm_cluster, job, HEALTH_TIMEOUT_S)
    print(job.describe())
    assert job.state == "FAILED" and job.exit_code == "1:0", job.describe()
    out = job.output()
    assert "megathunder launch: FAILED: plan: " in out
    assert "learner.parallel.data_parallel: 3, but world size 2" in out
    assert "healthy" not in out  # no server was waited for
    assert "training: srun" not in out
    assert job.seconds < HEALTH_TIMEOUT_S, job.seconds


def test_opd_dry_run_trains_opd_with_the_teacher_on_the_learner_ranks(tmp_path):
    env = dict(os.environ, MT_DRY_RUN="1", MT_NODELIST="gpu[01-16]", MT_LOG_DIR=str(tmp_path),
               MT_TEACHER_MODEL="/models/teacher")
    env.pop("SLURM_JOB_NODELIST", None)

    def dry_run(**extra):
        out = subprocess.run(["bash", "launch/slurm/opd_128gpu.sh"], env={**env, **extra}, cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        train = [line for line in out.stdout.splitlines() if "megathunder.cli train" in line]
        return out, train[0] if train else ""

    out, train = dry_run()
    assert out.returncode == 0, out.stderr
    assert "learner: 12 nodes (gpu05" in out.stdout and "world 96" in out.stdout
    assert "--job-name=teacher" not in out.stdout
    assert "train launch/slurm/opd_128gpu.yaml" in train and "objective.teacher.hf_checkpoint=/models/teacher" in train
    # no teacher server pool: the trainer has no client for one, so asking for it is refused, not ignored
    pool, _ = dry_run(MT_TEACHER_NODES="2")
    assert pool.returncode != 0 and "MT_TEACHER_NODES=2: the teacher runs on the learner ranks" in pool.stdout + pool.stderr
    missing, _ = dry_run(MT_TEACHER_MODEL="")
    assert missing.returncode != 0 and "MT_TEACHER_MODEL" in missing.stderr


def test_dry_run_plans_the_layout_and_refuses_one_that_does_not_divide_before_any_server(tmp_path):
    """The launch runs ``megathunder plan`` after the config check, before any server starts: with
    the model's config.json at hand (the Qwen2.5 shape fixtures), the shipped OPD layout fits, and
    Qwen2.5-7B at TP 8 is refused naming its heads."""
    models = REPO / "tests" / "fixtures" / "models"
    env = dict(os.environ, MT_DRY_RUN="1", MT_NODELIST="gpu[01-16]", MT_LOG_DIR=str(tmp_path),
               MT_TEACHER_MODEL=str(models / "Qwen2.5-32B-Instruct"), MT_HOST_MEMORY_GB="2048")
    env.pop("SLURM_JOB_NODELIST", None)
    student = f"learner.model.hf_checkpoint={models / 'Qwen2.5-7B-Instruct'}"

    def dry_run(overrides: str):
        return subprocess.run(["bash", "launch/slurm/opd_128gpu.sh"], env=dict(env, MT_OVERRIDES=overrides), cwd=REPO,
                              capture_output=True, text=True, timeout=300)

    ok = dry_run(student)
    assert ok.returncode == 0, ok.stderr
    assert re.search(r"plan: [\d.]+ GiB per rank; fits", ok.stdout), ok.stdout
    bad = dry_run(f"{student} learner.parallel.tensor_parallel=8")
    assert bad.returncode == 1
    assert ("FAILED: plan: megathunder plan: INFEASIBLE: learner.parallel.tensor_parallel: 8 does not divide "
            "learner.model.num_attention_heads=28") in bad.stderr, bad.stderr
    assert "would run" not in bad.stdout  # no server, no rank


@pytest.mark.slow  # the endpoint and its signal: tests/unit/test_server_fault_endpoint.py; the trainer's side: test_chaos.py's hang_server
def test_a_fault_reaches_a_server_the_run_did_not_launch_through_its_dev_endpoint(slurm_cluster, tmp_path):
    """``chaos.faults`` hang_server on the launch's own vLLM server on node1, which the trainer on
    node2 only attached to (``server_urls``): the fault goes through the server's authenticated dev
    endpoint (its worker stops the server's processes), the trainer finds the server hung by
    progress (``rollout.engine.stall_timeout_s``), and with no live server left the run stops in one
    line (exit 1; the same command resumes from the last checkpoint)."""
    run_dir = tmp_path / "run"
    env = mt_env(slurm_cluster, tmp_path, MT_OVERRIDES=(
        f"run.output_dir={run_dir} run.num_steps=3 rollout.engine.stall_timeout_s=20 "
        # MT_OVERRIDES splits at whitespace: a flow mapping with quoted keys needs no spaces
        'chaos.faults=[{"kind":"hang_server","step":1,"after_trajectories":2,"server":0}]'))
    job = submit(slurm_cluster, SCRIPT, env, tmp_path / "job.out")
    wait_for(slurm_cluster, job, 2 * HEALTH_TIMEOUT_S + 300)
    print(job.describe())
    assert job.state == "FAILED", job.describe()
    learner_log = next(text for name, text in job.logs(0).items() if name.startswith("learner-"))
    assert re.search(r"chaos: hang_server server 0 \(http://127\.0\.0\.1:\d+, through its dev endpoint\) at step 1",
                     learner_log), learner_log[-3000:]
    assert "no live rollout server left" in learner_log and "hung" in learner_log, learner_log[-3000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0]


def test_swe_job_runs_every_episode_in_the_sandbox_server_it_starts_beside_vllm(slurm_cluster, tmp_path):
    """launch/slurm/swe_128gpu.sh, the real script, on the two local nodes: a sandbox server
    (``megathunder sandbox serve``, local sandboxes: the cluster has no images) starts beside vLLM on
    the rollout node (node1), the trainer on node2 attaches to it, and a two-step GRPO run on the
    shipped SWE-style set creates every episode's sandbox there: the controller's count per server
    (summary.json) equals what the server says it created and destroyed when it stopped, and the
    controller has no other sandbox backend (``sandbox.backend: remote``)."""
    run_dir = tmp_path / "run"
    port = slurm_local._free_ports(1)[0]
    # node1 lends 1 CPU and 8 GiB to its vLLM server (the shipped 16 / 256 are a GPU node's)
    env = mt_env(slurm_cluster, tmp_path, MT_CONFIG=str(REPO / "tests/cluster/swe_cpu.yaml"),
                 MT_SANDBOX_PORT=str(port), MT_SANDBOX_RESERVED_CPUS="1", MT_SANDBOX_RESERVED_MEMORY_GB="8",
                 MT_OVERRIDES=f"run.output_dir={run_dir}")
    job = submit(slurm_cluster, "launch/slurm/swe_128gpu.sh", env, tmp_path / "job.out")
    wait_for(slurm_cluster, job, HEALTH_TIMEOUT_S + 600)  # ~3 min quiet
    print(job.describe())
    assert (job.state, job.exit_code) == ("COMPLETED", "0:0"), job.describe()

    out = job.output()
    assert "sandboxes: 1 sandbox servers, one per node beside vLLM on the rollout nodes (node1)" in out
    assert "learner: 1 nodes (node2)" in out
    logs = job.logs(0)
    # the server stopped cleanly at the job's end (SIGTERM to its task, not srun's SIGKILL)
    stopped = re.search(r"megathunder sandbox serve: stopped; (\d+) episodes, destroyed (\{.*\}), (\d+) refused",
                        logs["sandbox-node1.out"])
    assert stopped, logs["sandbox-node1.out"][-3000:]
    created, refused = int(stopped.group(1)), int(stopped.group(3))
    destroyed = sum(ast.literal_eval(stopped.group(2)).values())
    summary = json.loads((run_dir / "summary.json").read_text())
    episodes = 2 * 2 * 4  # steps x prompts x samples
    assert summary["sandbox_servers"] == {f"http://127.0.0.1:{port}": {"episodes": created, "lost": False}}, summary
    # (a create refused at the bound, while the server still destroys a closed sandbox, is retried)
    assert created == destroyed == episodes and summary["sandbox_failovers"] == 0, (created, destroyed, refused)
    assert summary["steps"] == 2 and summary["max_policy_lag"] == 0
