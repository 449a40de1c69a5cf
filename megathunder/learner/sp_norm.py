"""RMSNorm for Megatron's local layer spec under sequence parallelism.

Without Transformer Engine or Apex, Megatron's local spec builds its norms with
``WrappedTorchNorm``, which refuses sequence parallelism: under SP each tensor-parallel rank
normalises only its slice of the sequence, so a norm weight's gradient on one rank is the sum over
that rank's tokens alone, and the ranks' partial sums must be added. Megatron adds them in
``finalize_model_grads`` for every parameter marked ``sequence_parallel`` (its fused and TE norms
mark their weights); ``RMSNorm`` here is torch's ``RMSNorm`` with that mark, the same per-token
function and the same parameter names, so the gradient is the one without SP
(``tests/distributed/test_learner.py``). ``with_sequence_parallel_norms`` puts it into a layer
spec's norms and the block's final norm; the specs without SP stay Megatron's own.
"""

from __future__ import annotations

import copy

import torch


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with the signature of a Megatron norm module; its weight is marked
    ``sequence_parallel`` when the config is, so its gradient is summed over the TP ranks."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm") -> None:
        if normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("megathunder RMSNorm: only plain RMSNorm is supported")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def with_sequence_parallel_norms(layer_spec, num_layers: int):
    """A transformer-block spec of ``num_layers`` copies of ``layer_spec`` (a local GPT layer spec)
    whose every norm -- input, pre-MLP, q/k, and the block's final norm -- is ``RMSNorm``."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules

    spec = copy.deepcopy(layer_spec)
    layer = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(layer, name, None) is WrappedTorchNorm:
            setattr(layer, name, RMSNorm)
    attention = layer.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name, None) is WrappedTorchNorm:
            setattr(attention, name, RMSNorm)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=RMSNorm))
