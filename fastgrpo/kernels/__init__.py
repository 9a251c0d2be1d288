"""Compute kernels: each op beside its pure-PyTorch reference (`*_ref`), which is the spec."""
