"""Every FASTGRPO_* environment variable, in one place.

The switches turn a fast path off, to compare against it or to bisect a problem; each default is
the path measured fastest (the README's table; benchmarks/HISTORY.md has the measurements). They
are read once, at import: a module copies the value it needs into an attribute of its own, which
tests flip with monkeypatch. FASTGRPO_CACHE and FASTGRPO_DEBUG are read when used.
"""

from __future__ import annotations

import os
from pathlib import Path


def _on(name: str) -> bool:
    """A switch that is on unless set to 0."""
    return os.environ.get(name, "1") != "0"


# the model's forwards and the trainer
FUSED_OPS = _on("FASTGRPO_FUSED_OPS")  # fused norm / RoPE / SwiGLU kernels in forwards
SHARE_PROMPTS = _on("FASTGRPO_SHARE_PROMPTS")  # each prompt packed once for its samples
FLASH_AUTOGRAD = _on("FASTGRPO_FLASH_AUTOGRAD")  # training attention by the flash kernels
NO_VARLEN = os.environ.get("FASTGRPO_NO_VARLEN") == "1"  # no varlen attention at all
PINNED_COPIES = _on("FASTGRPO_PINNED_COPIES")  # host-to-device copies through pinned memory
GLUON_LM_HEAD_STATS = _on("FASTGRPO_GLUON")  # the training pass's statistics kernel in Gluon

# the rollout engine
COMPACT = _on("FASTGRPO_COMPACT")  # finished groups compacted out of a wave
PREFILL_GRAPHS = _on("FASTGRPO_PREFILL_GRAPHS")  # prefills replayed as CUDA graphs
FOLD_POSITIONS = _on("FASTGRPO_FOLD_POSITIONS")  # decode positions formed in the first kernel
FUSED_RECORD = _on("FASTGRPO_FUSED_RECORD")  # a decode step's bookkeeping in one kernel
FUSED_SAMPLER = _on("FASTGRPO_FUSED_SAMPLER")  # the sampler in one pass over the logits
LM_HEAD_SAMPLER = _on("FASTGRPO_LM_HEAD_SAMPLER")  # LM head + sampler, no logits in memory
TOKEN_INPUTS = _on("FASTGRPO_TOKEN_INPUTS")  # embedding and RoPE rows in one kernel
PDL = _on("FASTGRPO_PDL")  # programmatic dependent launch between decode kernels
DECODE_ATTENTION_TRITON = os.environ.get("FASTGRPO_DECODE_ATTENTION", "triton") != "ref"
ROPE_IN_ATTENTION = _on("FASTGRPO_ROPE_ATTENTION")  # the step's RoPE + KV write in the attention
GLUON_ATTENTION = _on("FASTGRPO_GLUON_ATTENTION")  # the decode attention in Gluon (Hopper)
DECODE_LINEAR = _on("FASTGRPO_DECODE_LINEAR")  # the decode step's small linears in Triton
SPLIT_SUMS = _on("FASTGRPO_SPLIT_SUMS")  # down_proj / o_proj as split-K parts the norm adds
GLUON_GATE_UP = _on("FASTGRPO_GLUON_GATE_UP")  # the decode gate/up in Gluon (Hopper)
GLUON_GATE_UP_EXACT = os.environ.get("FASTGRPO_GLUON_GATE_UP_EXACT", "0") == "1"
# the decode attention's key splits per (row, kv head), and (BLOCK_N, num_warps, num_stages);
# 0 and () choose by shape
ATTENTION_SPLITS = int(os.environ.get("FASTGRPO_ATTENTION_SPLITS", "0"))
ATTENTION_BLOCKS = tuple(
    int(v) for v in os.environ.get("FASTGRPO_ATTENTION_BLOCKS", "").split(",") if v
)


def cache_root() -> Path:
    """Where converted models are cached (FASTGRPO_CACHE, else ~/.cache/fastgrpo)."""
    return Path(os.environ.get("FASTGRPO_CACHE") or Path.home() / ".cache" / "fastgrpo")


def debug() -> bool:
    """FASTGRPO_DEBUG set: configuration errors raise with their traceback."""
    return bool(os.environ.get("FASTGRPO_DEBUG"))
