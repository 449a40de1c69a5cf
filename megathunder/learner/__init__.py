"""The Megatron-core learner: TP x PP x DP GPTModel with the gradient ledger on its gradient buffers."""
