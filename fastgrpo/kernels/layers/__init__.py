"""Kernels of layers both the training pass and the decode step use: residual add + RMSNorm, RoPE,
SiLU * up, the first layer's token inputs, each beside its PyTorch reference."""
