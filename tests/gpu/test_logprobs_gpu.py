"""The learner's bf16 token logprobs on CUDA against transformers' forward of the same checkpoint
(``tools/gpu_check.sh``); skipped on CPU. (fp32 on CPU, to ~1e-6: ``tests/distributed/test_learner.py``.)

Both are compared with transformers in fp32 on the GPU: the learner in bf16 (Megatron's local spec,
SDPA) must be as near to it as transformers' own bf16 forward is, up to a small factor -- they
round the same operations to the same 8-bit significand (u = 2^-8), in different kernels and
orders -- and within an absolute bound: each of the forward's ~15 bf16-rounded steps per layer moves
a logit by about u x |logit| (|logit| < 4 on this tiny random model), so two layers and the head
give at most ~40 u |logit| ~ 0.6 in the worst case, ~0.05 in practice (errors of random sign add in
quadrature); the bound is that practical size. The figures go into the check's summary."""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu_helpers import record

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16_LOGP_ATOL = 5e-2
BF16_RATIO = 4.0  # the learner's bf16 error at most this times transformers' own (+ one bf16 ulp of |logp| ~ 4)


def _transformers_logprobs(hf_dir, batch, dtype: torch.dtype) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).cuda().eval()
    out = []
    with torch.no_grad():
        for traj in batch:
            tokens = traj.tokens.cuda()
            logits = model(tokens[None]).logits[0, :-1].float()  # log-softmax in fp32, as the learner's
            out.append(torch.log_softmax(logits, -1).gather(-1, tokens[1:, None])[:, 0].cpu())
    return out


@pytest.mark.gpu
def test_learner_bf16_logprobs_match_transformers_on_cuda(tmp_path):
    pytest.importorskip("transformers", reason="transformers not installed")
    from megathunder.config import GRPOObjective, LearnerConfig, LedgerConfig
    from megathunder.learner.learner import MegatronLearner
    from megathunder.learner.parallel import destroy_distributed, init_distributed
    from tests.distributed.conftest import make_hf_checkpoint
    from tests.distributed.learner_worker import make_batch

    hf = make_hf_checkpoint(tmp_path / "qwen2", "qwen2", tie=True)
    os.environ.setdefault("MASTER_PORT", "29556")
    cfg = LearnerConfig.model_validate({"model": {"hf_checkpoint": str(hf)}, "precision": {"params_dtype": "bfloat16"}})
    pgs = init_distributed(cfg)
    try:
        learner = MegatronLearner.build(cfg, GRPOObjective(), pgs, LedgerConfig(max_group_slots=1))
        batch, _, _ = make_batch(3, learner.model_cfg.vocab_size)
        ours = [lp.float().cpu() for lp in learner.token_logprobs(batch)]
    finally:
        destroy_distributed()
    reference = torch.cat(_transformers_logprobs(hf, batch, torch.float32))
    theirs_bf16 = torch.cat(_transformers_logprobs(hf, batch, torch.bfloat16))
    ours_err = (torch.cat(ours) - reference).abs().max().item()
    theirs_err = (theirs_bf16 - reference).abs().max().item()
    record("logprobs_bf16_vs_transformers", learner_max_abs_err=ours_err, transformers_bf16_max_abs_err=theirs_err,
           bound=BF16_LOGP_ATOL, num_tokens=int(reference.numel()))
    assert ours_err <= BF16_LOGP_ATOL, (ours_err, theirs_err)
    assert ours_err <= BF16_RATIO * theirs_err + 2**-6, (ours_err, theirs_err)
