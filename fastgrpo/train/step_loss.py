"""The update's loss on one micro-batch, chosen once at setup.

`LossSettings` holds the loss's settings, resolved from the config once into a small frozen
object. `choose_loss` picks one of three paths by what they need, once per run:
- `reference_loss`: (B, Tc) log-probs with autograd, then `algo.policy_loss` (the CPU path, and
  the spec the other two are tested against);
- `fused_token_loss`: the hidden states of the completion tokens (packed) straight to loss and
  gradients in one fused LM-head pass, for losses whose terms are per token;
- `fused_sequence_loss`: two passes, for a sequence-level ratio (GSPO), which couples the tokens
  of a sequence.
Each returns (loss, metrics): the metrics come from `policy_loss` on detached log-probs, so every
path reports alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cached_property, partial

import torch

from fastgrpo.algo import policy_loss
from fastgrpo.kernels.train.lm_head_grpo_loss import (
    lm_head_grpo_loss,
    lm_head_policy_loss,
    token_weights,
)
from fastgrpo.kernels.train.token_loss import TOKEN_LEVEL_LOSSES
from fastgrpo.train.batching import MicroBatch
from fastgrpo.train.logprobs import (
    completion_logprobs,
    kept_hidden,
    kept_index,
    lm_head_weight,
    unpack,
)

# the settings the fused kernel takes per token (the others shape the whole batch's loss)
PER_TOKEN_SETTINGS = (
    "loss_type",
    "beta",
    "kl_estimator",
    "epsilon_low",
    "epsilon_high",
    "delta",
    "entropy_coef",
    "importance_sampling_cap",
)


@dataclass(frozen=True)
class LossSettings:
    """The keyword settings of `algo.policy_loss`, plus the sampling temperature the log-probs
    are taken at."""

    loss_type: str
    beta: float
    kl_estimator: str
    epsilon_low: float
    epsilon_high: float | None
    delta: float | None
    importance_sampling_level: str
    max_completion_length: int
    entropy_coef: float
    importance_sampling_cap: float
    temperature: float

    @classmethod
    def from_config(cls, config) -> LossSettings:
        a = config.algo
        return cls(
            loss_type=a.loss_type,
            beta=a.beta,
            kl_estimator=a.kl_estimator,
            epsilon_low=a.epsilon_low,
            epsilon_high=a.epsilon_high,
            delta=a.delta,
            importance_sampling_level=a.importance_sampling_level,
            max_completion_length=config.rollout.max_new_tokens,
            entropy_coef=a.entropy_coef,
            importance_sampling_cap=a.importance_sampling_cap,
            temperature=config.rollout.temperature,
        )

    @property
    def zero_gradient_rows_possible(self) -> bool:
        """Whether a row with zero advantage has zero gradient (no KL, no entropy bonus)."""
        return self.beta == 0 and self.entropy_coef == 0

    @cached_property
    def policy_options(self) -> dict:
        """`policy_loss`'s keywords (resolved once: the loss runs per micro-batch)."""
        return {k: v for k, v in asdict(self).items() if k != "temperature"}

    @cached_property
    def per_token_options(self) -> dict:
        """The fused per-token kernel's keywords."""
        return {k: v for k, v in self.policy_options.items() if k in PER_TOKEN_SETTINGS}


# loss(model, micro-batch, sequences and tokens of its mini-batch) -> (loss, metrics)
MicroBatchLoss = Callable[[object, MicroBatch, int, torch.Tensor], tuple[torch.Tensor, dict]]


def choose_loss(settings: LossSettings, fused: bool, hidden_of=kept_hidden) -> MicroBatchLoss:
    """The micro-batch loss for these settings; `fused`: the LM-head kernels (CUDA, Triton);
    `hidden_of(model, rollout)`: the fused paths' hidden states of the kept tokens
    (`logprobs.kept_hidden`, or `captured_layers.CapturedLayers.kept_hidden`)."""
    if not fused:
        return partial(reference_loss, settings=settings)
    per_token = settings.importance_sampling_level == "token"
    if settings.loss_type in TOKEN_LEVEL_LOSSES and per_token:
        return partial(fused_token_loss, settings=settings, hidden_of=hidden_of)
    return partial(fused_sequence_loss, settings=settings, hidden_of=hidden_of)


def _policy_loss_on(mb: MicroBatch, logp, entropy, num_sequences, num_tokens, settings):
    """`policy_loss` on a micro-batch's (b, Tc) log-probs and entropies."""
    return policy_loss(
        logp,
        mb.old_logp,
        mb.ref_logp,
        mb.advantages,
        mb.rollout.completion_mask,
        entropy=entropy,
        sampling_logp=mb.rollout.sampling_logp,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        **settings.policy_options,
    )


def reference_loss(model, mb: MicroBatch, num_sequences, num_tokens, *, settings: LossSettings):
    logp, entropy = completion_logprobs(
        model, mb.rollout, temperature=settings.temperature, with_entropy=True
    )  # (b, Tc) each
    entropy = entropy if settings.entropy_coef else entropy.detach()
    return _policy_loss_on(mb, logp, entropy, num_sequences, num_tokens, settings)


def fused_token_loss(
    model,
    mb: MicroBatch,
    num_sequences,
    num_tokens,
    *,
    settings: LossSettings,
    hidden_of=kept_hidden,
):
    mask = mb.rollout.completion_mask
    keep = mask.bool()  # (b, Tc)
    weights = token_weights(
        mask,
        settings.loss_type,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        max_completion_length=settings.max_completion_length,
    )  # (b, Tc)
    rows = mb.advantages[:, None].expand_as(mask)  # (b, Tc)
    index = kept_index(mb.rollout)  # (n,): x[keep] with no host read
    pick = lambda x: None if x is None else x.reshape(-1)[index]  # noqa: E731
    loss, logp, entropy = lm_head_grpo_loss(
        hidden_of(model, mb.rollout),  # (n, H)
        lm_head_weight(model),  # (V, H)
        pick(mb.rollout.completion_ids),
        pick(weights),
        pick(rows),
        old_logp=pick(mb.old_logp),
        ref_logp=pick(mb.ref_logp),
        sampling_logp=pick(mb.rollout.sampling_logp),
        temperature=settings.temperature,
        fused=True,
        **settings.per_token_options,
    )
    return loss, _metrics(mb, keep, logp, entropy, num_sequences, num_tokens, settings)


def fused_sequence_loss(
    model,
    mb: MicroBatch,
    num_sequences,
    num_tokens,
    *,
    settings: LossSettings,
    hidden_of=kept_hidden,
):
    keep = mb.rollout.completion_mask.bool()  # (b, Tc)

    def whole_loss(packed_logp, packed_entropy):
        full_logp, full_entropy = unpack(keep, packed_logp), unpack(keep, packed_entropy)
        return _policy_loss_on(mb, full_logp, full_entropy, num_sequences, num_tokens, settings)[0]

    loss, logp, entropy = lm_head_policy_loss(
        hidden_of(model, mb.rollout),
        lm_head_weight(model),
        mb.rollout.completion_ids.reshape(-1)[kept_index(mb.rollout)],
        whole_loss,
        temperature=settings.temperature,
        fused=True,
    )
    return loss, _metrics(mb, keep, logp, entropy, num_sequences, num_tokens, settings)


@torch.no_grad()
def _metrics(mb, keep, logp, entropy, num_sequences, num_tokens, settings) -> dict:
    full_logp, full_entropy = unpack(keep, logp), unpack(keep, entropy)
    return _policy_loss_on(mb, full_logp, full_entropy, num_sequences, num_tokens, settings)[1]
