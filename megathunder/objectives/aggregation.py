"""Loss aggregation: how token terms are weighted and what the batch normaliser Z is.

Every mode is ``L = (1/Z) * sum_i nu_i * sum_t m_it * loss_it``:

    token_mean               nu_i = 1        Z = sum of kept loss tokens in the batch
    seq_mean_token_sum       nu_i = 1        Z = number of kept sequences
    seq_mean_token_mean      nu_i = 1 / n_i  Z = number of kept sequences
    seq_mean_token_sum_norm  nu_i = 1        Z = number of kept sequences * constant token count

``nu_i`` is known when trajectory i finishes; Z only when the batch closes, so the streaming path
accumulates unnormalised sums and divides once (never a mean of per-micro-batch means).
A trajectory with no loss tokens (n_i = 0) contributes nothing but still counts as a sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from megathunder.config import RLObjective


def sequence_weight(num_loss_tokens: int, cfg: RLObjective) -> float:
    """nu_i."""
    if cfg.loss_agg == "seq_mean_token_mean":
        return 1.0 / max(num_loss_tokens, 1)
    return 1.0


def normaliser(num_loss_tokens: Sequence[int], cfg: RLObjective) -> float:
    """Z over the kept trajectories (their loss-token counts, any order: the sum is of integers)."""
    if cfg.loss_agg == "token_mean":
        z = sum(num_loss_tokens)
    elif cfg.loss_agg == "seq_mean_token_sum_norm":
        assert cfg.loss_agg_norm_tokens is not None
        z = len(num_loss_tokens) * cfg.loss_agg_norm_tokens
    else:
        z = len(num_loss_tokens)
    return float(max(z, 1))
