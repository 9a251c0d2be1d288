"""Kernels of the rollout's decode step: attention over the KV cache, the small linears, the KV
write, the LM head + sampler, the step's bookkeeping and programmatic dependent launch, each
beside its PyTorch reference."""
