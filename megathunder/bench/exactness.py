"""The exactness run: on-policy GRPO where every update is streamed *and* checked.

Each step samples a batch on-policy from a small in-process decoder (prompt: random tokens;
reward: the fraction of completion tokens from the lowest quarter of the vocabulary, EOS excluded;
token 0 is EOS and ends a completion), gives every trajectory a simulated generation and verifier latency, and feeds the
finish/reward events in time order to the gradient ledger (thunder). The batch-synchronous
gradient of the same batch is computed too; the step fails loudly if they differ by more than the
dtype's tolerance, and otherwise applies the streamed gradient. It also counts the learner work
left when the batch's last reward arrives -- what streaming exists to shrink.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from megathunder.config import Config, ConfigError, RLObjective
from megathunder.models.torch_decoder import TorchDecoder, build_torch_decoder
from megathunder.objectives import token_logprobs_and_entropy
from megathunder.streaming import GradientLedger, TorchBackend
from megathunder.streaming.reference import reference_gradient
from megathunder.trajectory import Trajectory, batch_plan

EOS = 0
PROMPT_LEN = 4
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}


class ExactnessError(RuntimeError):
    pass


@torch.no_grad()
def sample_group(
    model: TorchDecoder, ref: TorchDecoder, prompt: torch.Tensor, cfg: Config, first_id: int, group_id: int
) -> tuple[list[Trajectory], list[float]]:
    size, max_new = cfg.batch.samples_per_prompt, cfg.agent.max_new_tokens_per_turn
    seqs = prompt.repeat(size, 1)
    logps = torch.zeros(size, 0, dtype=next(model.parameters()).dtype)
    done = torch.zeros(size, dtype=torch.bool)
    lengths = torch.full((size,), max_new)
    for step in range(max_new):
        logits = model(seqs)[:, -1] / cfg.rollout.temperature
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, 1).squeeze(-1)
        logps = torch.cat([logps, probs.log().gather(-1, nxt[:, None])], dim=1)
        seqs = torch.cat([seqs, nxt[:, None]], dim=1)
        newly = ~done & (nxt == EOS)
        lengths[newly] = step + 1
        done |= newly
        if done.all():
            break
    trajs, rewards = [], []
    for k in range(size):
        n = int(lengths[k])
        tokens = seqs[k, : PROMPT_LEN + n].clone()
        mask = torch.zeros(tokens.numel() - 1, dtype=torch.bool)
        mask[PROMPT_LEN - 1 :] = True
        ref_logp, _ = token_logprobs_and_entropy(ref(tokens[None])[0, :-1], tokens[1:], False)
        rollout = torch.cat([torch.zeros(PROMPT_LEN - 1, dtype=logps.dtype), logps[k, :n]])
        trajs.append(
            Trajectory(
                traj_id=first_id + k, group_id=group_id, tokens=tokens, loss_mask=mask,
                rollout_logprobs=rollout, ref_logprobs=ref_logp, truncated=bool(not done[k]),
            )
        )
        rewards.append(task_reward(tokens[PROMPT_LEN:], cfg.exactness.model.vocab_size))
    return trajs, rewards


def task_reward(completion: torch.Tensor, vocab_size: int) -> float:
    completion = completion[completion != EOS]
    if completion.numel() == 0:
        return 0.0
    return float((completion < vocab_size // 4).double().mean())


def event_times(rng: random.Random, batch: list[Trajectory]) -> list[tuple[float, str, int]]:
    """Generation time grows with length (plus a long tail); the verifier adds its own latency."""
    events: list[tuple[float, str, int]] = []
    for t in batch:
        finish = 0.05 * t.num_targets * rng.lognormvariate(0.0, 0.5)
        events.append((finish, "finished", t.traj_id))
        events.append((finish + rng.expovariate(1.0 / 2.0), "reward", t.traj_id))
    return sorted(events)


def run(cfg: Config) -> int:
    objective = cfg.objective
    if not isinstance(objective, RLObjective):
        raise ConfigError(f"objective.kind={objective.kind}: the exactness run streams a reward objective (grpo)")
    torch.manual_seed(cfg.run.seed)
    rng = random.Random(cfg.run.seed)
    model = build_torch_decoder(cfg.exactness.model, seed=cfg.run.seed)
    ref = copy.deepcopy(model).requires_grad_(False)
    backend = TorchBackend(model, objective)
    ledger = GradientLedger(backend, objective, cfg.ledger)
    opt_cfg = cfg.exactness.optimizer
    if opt_cfg.name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=opt_cfg.betas,
                                      eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tolerance = TOLERANCE[cfg.exactness.model.dtype]
    rows = []
    with open(out / "metrics.jsonl", "w") as metrics:
        bar = tqdm(range(cfg.run.num_steps), desc="grpo/thunder", unit="step", mininterval=1.0)
        for step in bar:
            batch: list[Trajectory] = []
            rewards: list[float] = []
            for g in range(cfg.batch.num_prompts_per_batch):
                prompt = torch.randint(1, cfg.exactness.model.vocab_size, (1, PROMPT_LEN))
                trajs, rs = sample_group(model, ref, prompt, cfg, len(batch), g)
                batch += trajs
                rewards += rs
            reference = reference_gradient(model, batch, rewards, objective)
            t0 = time.perf_counter()
            ledger.begin_batch(batch_plan(batch))
            backward_before_last_reward = 0
            for _, kind, tid in event_times(rng, batch):
                if kind == "finished":
                    ledger.on_finished(batch[tid])
                else:
                    backward_before_last_reward = backend.num_backward
                    ledger.on_reward(tid, rewards[tid])
            result = ledger.close_batch()
            ledger_s = time.perf_counter() - t0
            streamed = backend.live.flat()
            err = ((streamed - reference).norm() / reference.norm().clamp_min(1e-30)).item()
            if err > tolerance:
                raise ExactnessError(f"step {step}: streamed vs batch gradient rel. error {err:.3e} > {tolerance}")
            total_backward = backend.num_backward
            left_after_last_reward = total_backward - backward_before_last_reward
            backend.num_backward = 0
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.max_grad_norm or float("inf")))
            optimizer.step()
            row = {
                "step": step,
                "reward_mean": sum(rewards) / len(rewards),
                "rel_err_vs_sync": err,
                "grad_norm": grad_norm,
                "kept_groups": result.num_kept_groups,
                "dropped_groups": result.num_dropped_groups,
                "peak_buffers": result.peak_buffers,
                "backward_passes": total_backward,
                "backward_after_last_reward": left_after_last_reward,
                "sync_backward_after_last_reward": result.num_kept_trajectories,
                "ledger_s": ledger_s,
            }
            rows.append(row)
            metrics.write(json.dumps(row) + "\n")
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", rel_err=f"{err:.1e}")
    _summary(rows, out)
    return 0


def _summary(rows: list[dict], out: Path) -> None:
    k = max(1, len(rows) // 5)
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    summary = {
        "steps": len(rows),
        "reward_first_steps": round(first, 4),
        "reward_last_steps": round(last, 4),
        "max_rel_err_vs_sync": max(r["rel_err_vs_sync"] for r in rows),
        "mean_backward_after_last_reward_thunder": sum(r["backward_after_last_reward"] for r in rows) / len(rows),
        "mean_backward_after_last_reward_sync": sum(r["sync_backward_after_last_reward"] for r in rows) / len(rows),
        "max_peak_buffers": max(r["peak_buffers"] for r in rows),
    }
    print(f"\n{'metric':<42} value")
    for key, value in summary.items():
        print(f"{key:<42} {value:.4g}" if isinstance(value, float) else f"{key:<42} {value}")
    print(f"metrics: {out / 'metrics.jsonl'}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
