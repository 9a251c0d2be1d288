"""The token sampler's specification in PyTorch: the reference every fused sampler is tested
against (`kernels/decode/sample_tokens.py`, `kernels/decode/lm_head_sample.py`), and the path for any settings.

Sampling is Gumbel-max, `argmax(logits / T + g)`, with the Gumbel noise `g` drawn from a
counter-based hash rather than a `torch.Generator`: the noise of row b at vocabulary index v is a
pure function of `(seeds[b], step[b], v)`. Why:

- a row's tokens do not depend on which other rows share its batch or where it sits in it, so a
  sample is reproducible from its seed alone (resume, debugging, re-running one prompt);
- there is no generator state to advance, so a decode step can be captured in a CUDA graph with
  `step` living in a device tensor, and nothing here ever waits on the host.

The hash: each row's state for a step is splitmix64 (Steele, Lea, Flood 2014) of its seed and
step, 64 bits computed once per row; each vocabulary entry's 32 bits are two rounds of the
`lowbias32` integer hash (C. Wellons' hash-prospector) keyed by the two halves of that state. Only
the per-entry part runs B x V times, and 32-bit multiplies are what a GPU does cheaply. 32 bits give
the uniform full relative precision down to 2^-32, where the Gumbel tail that lets unlikely tokens
win comes from. torch has no uint32 arithmetic: the hash runs in int64 and masks to 32 bits.
Noise is reproducible on one device; CPU and GPU logs differ in the last bits (the fused kernel
uses the GPU's fast log2), so near-ties can sample differently across devices and paths.

top-k and top-p filter the temperature-scaled distribution before sampling, as HF and vLLM do:
top-k first, then top-p keeps the smallest set of most likely tokens whose probability reaches
top_p (the most likely token is always kept). Both cut at a logit value, so tokens tied with the
last kept one are kept too. With top_k = 0 and top_p = 1 (the usual GRPO setting) nothing is
sorted; top-k alone uses `torch.topk`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# splitmix64 constants, as signed int64 (torch has no uint64 arithmetic on every device)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)
# lowbias32 (hash-prospector) multipliers; products of two values below 2^32 fit int64 unsigned,
# and torch's wraparound keeps their low 32 bits exact
_LOWBIAS_MUL1 = 0x7FEB352D
_LOWBIAS_MUL2 = 0x846CA68B
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not self.top_k >= 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_tokens_torch(
    logits: torch.Tensor,  # (B, V) any float dtype
    params: SamplingParams,
    seeds: torch.Tensor,  # (B,) int64
    step: torch.Tensor,  # (B,) or () int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` with torch ops: any device, any settings; the fused kernel's reference."""
    _check_inputs(logits, seeds, step)
    z = logits.float()  # (B, V)
    if params.greedy:
        tokens = z.argmax(-1)  # (B,)
    else:
        z = z / params.temperature
        scores = _filter(z, params) + _gumbel(seeds, step, z.shape[1])  # (B, V)
        tokens = scores.argmax(-1)  # (B,)
    logp = z.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, -1)  # (B,)
    return tokens, logp


def _check_inputs(logits: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float (B, V) tensor, got {logits.dtype} {logits.shape}")
    if not isinstance(step, torch.Tensor):
        raise TypeError("step must be an int64 tensor (it lives on the device in a CUDA graph)")
    for name, t, shapes in (
        ("seeds", seeds, [(logits.shape[0],)]),
        ("step", step, [(), (logits.shape[0],)]),
    ):
        if t.dtype != torch.int64 or tuple(t.shape) not in shapes or t.device != logits.device:
            raise ValueError(
                f"{name} must be an int64 tensor of shape {' or '.join(map(str, shapes))} on "
                f"{logits.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def _filter(z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """z with every token outside the top-k / top-p set at -inf (z itself is left alone)."""
    if params.top_k == 0 and params.top_p == 1:
        return z
    if params.top_k > 0:
        top = z.topk(min(params.top_k, z.shape[1]), dim=-1).values  # (B, k) descending
    else:
        top = z.sort(dim=-1, descending=True).values  # (B, V)
    if params.top_p < 1:
        cut = _top_p_cut(top, params.top_p)  # (B, 1)
    else:
        cut = top[:, -1:]  # (B, 1)
    return z.masked_fill(z < cut, -math.inf)


def _top_p_cut(top: torch.Tensor, top_p: float) -> torch.Tensor:  # (B, 1)
    """Smallest logit kept by top-p, given the candidates sorted in descending order."""
    probs = torch.softmax(top, -1)  # (B, K)
    mass_before = torch.nn.functional.pad(probs.cumsum(-1)[:, :-1], (1, 0))  # (B, K), starts at 0
    kept = torch.where(mass_before < top_p, top, math.inf)  # (B, K)
    return kept.amin(-1, keepdim=True)


def _gumbel(seeds: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:  # (B, V)
    """Gumbel(0, 1) noise that depends only on (seed, step, vocabulary index) of each entry."""
    bits = column_bits(row_state(seeds, step), vocab)  # (B, V) in [0, 2^32)
    # r in (0, 1) with full relative precision near 0 (the Gumbel tail); the clamp keeps the noise
    # finite (|g| < 23).
    r = bits.to(torch.float32).mul_(2.0**-32).clamp_(2.0**-33, 1 - 2.0**-24)  # (B, V)
    return r.neg_().log1p_().neg_().log_().neg_()  # -log(Exp(1)), Exp(1) = -log(1 - r)


def row_state(seeds: torch.Tensor, step: torch.Tensor) -> torch.Tensor:  # (B,) int64
    """Each row's splitmix64 state for this step."""
    return _mix64(_mix64(seeds + _GOLDEN) + step * _GOLDEN)


def column_bits(state: torch.Tensor, vocab: int) -> torch.Tensor:  # (B, V) int64 in [0, 2^32)
    """32 random bits per (row, vocabulary index): lowbias32(lowbias32(v ^ lo) ^ hi), where lo
    and hi are the low and high halves of the row's state."""
    lo = (state & _MASK32).unsqueeze(1)  # (B, 1)
    hi = _shr(state, 32).unsqueeze(1)  # (B, 1)
    index = torch.arange(vocab, device=state.device, dtype=torch.int64)  # (V,)
    return _lowbias32(_lowbias32(index ^ lo) ^ hi)


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of x in [0, 2^32) (int64), in [0, 2^32). Updates x in place: pass a fresh tensor."""
    x ^= x >> 16
    x *= _LOWBIAS_MUL1
    x &= _MASK32
    x ^= x >> 15
    x *= _LOWBIAS_MUL2
    x &= _MASK32
    x ^= x >> 16
    return x


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 output function; int64 in, int64 out. Updates x in place: pass a fresh tensor."""
    x ^= _shr(x, 30)
    x *= _MUL1
    x ^= _shr(x, 27)
    x *= _MUL2
    x ^= _shr(x, 31)
    return x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: mask off the copied sign bits)."""
    return (x >> s).bitwise_and_((1 << (64 - s)) - 1)
