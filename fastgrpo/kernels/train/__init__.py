"""Kernels of the training pass: the fused LM-head loss (statistics, per-chunk gradients, backward
GEMMs, the per-token loss) and log-prob scoring, each beside its PyTorch reference."""
