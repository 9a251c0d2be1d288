"""The update phase of a GRPO step: K inner epochs x mini-batches x token-budget micro-batches.

Reference and old log-probs are computed once per rollout, on the same micro-batches the update
uses, so the first inner step sees a ratio of exactly 1. Rows whose gradient is exactly zero (zero
advantage, no KL, no entropy bonus) are not run through the model at all; they still count in the
loss normalisers, so the update is the one the whole batch would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastgrpo.algo import policy_loss
from fastgrpo.config import Config
from fastgrpo.kernels.lm_head_grpo_loss import (
    TOKEN_LEVEL_LOSSES,
    lm_head_grpo_loss,
    lm_head_policy_loss,
    token_weights,
)
from fastgrpo.kernels.support import _interpreting, kernel_dtype, triton
from fastgrpo.models.transformer import Transformer
from fastgrpo.rollout import Rollout
from fastgrpo.train.batching import plan_micro_batches
from fastgrpo.train.logprobs import (
    completion_logprobs,
    concat_rollouts,
    kept_hidden,
    lm_head_weight,
    prompt_groups,
    trim_padding,
    unpack,
)
from fastgrpo.train.profiling import PhaseTimer

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


@dataclass
class MicroBatch:
    rollout: Rollout  # trimmed rows
    advantages: torch.Tensor  # (b,)
    ref_logp: torch.Tensor | None = None  # (b, Tc)
    old_logp: torch.Tensor | None = None  # (b, Tc)


def loss_settings(config: Config) -> dict:
    """The keyword settings of `policy_loss` that come straight from the config."""
    a = config.algo
    return dict(
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
    )


def use_fused_lm_head(config: Config, model) -> bool:
    """Whether the update runs the fused LM-head + loss kernels."""
    mode = config.train.fused_lm_head
    on_gpu = model.device.type == "cuda"
    if mode == "on" and triton is None:
        raise ValueError(
            "train.fused_lm_head=on needs Triton: `pip install triton`, or set it to auto"
        )
    if mode == "on" and not (on_gpu or _interpreting()):
        raise ValueError(
            f"train.fused_lm_head=on runs Triton kernels, which need the model on a CUDA GPU "
            f"(model.device is {model.device.type}); set train.fused_lm_head=auto or off, or "
            "TRITON_INTERPRET=1 to run the kernels in Triton's (slow) interpreter on the CPU"
        )
    # auto leaves an fp32 LM head to PyTorch: the kernels' fp32 dots run on CUDA cores, ~11x
    # slower than cuBLAS (H100, 4,096 x 576 x 49,152 fwd+bwd: 367 ms against 32)
    return mode == "on" or (
        mode == "auto"
        and triton is not None
        and on_gpu
        and kernel_dtype("the fused LM-head loss", lm_head_weight(model).dtype)
    )


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
        **settings,
    )


def micro_batch_loss(config: Config, model, mb: MicroBatch, num_sequences, num_tokens, settings):
    """Reference path: (B, Tc) log-probs with autograd, then `policy_loss`."""
    logp, entropy = completion_logprobs(
        model, mb.rollout, temperature=config.rollout.temperature, with_entropy=True
    )
    entropy = entropy if config.algo.entropy_coef else entropy.detach()
    return _policy_loss_on(mb, logp, entropy, num_sequences, num_tokens, settings)


def fused_micro_batch_loss(
    config: Config, model, mb: MicroBatch, num_sequences, num_tokens, settings
):
    """Fused path: hidden states of the completion tokens (packed) straight to loss and gradients.

    The metrics come from `policy_loss` on the detached log-probs, so both paths report alike.
    """
    mask = mb.rollout.completion_mask
    keep = mask.bool()  # (b, Tc)
    hidden = kept_hidden(model, mb.rollout)  # (n, H)
    weight = lm_head_weight(model)  # (V, H)
    a = config.algo
    if a.loss_type in TOKEN_LEVEL_LOSSES and a.importance_sampling_level == "token":  # one pass
        weights = token_weights(
            mask,
            config.algo.loss_type,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            max_completion_length=config.rollout.max_new_tokens,
        )  # (b, Tc)
        rows = mb.advantages[:, None].expand_as(mask)  # (b, Tc)
        pick = lambda x: None if x is None else x[keep]  # noqa: E731
        token_settings = {k: v for k, v in settings.items() if k in PER_TOKEN_SETTINGS}
        loss, logp, entropy = lm_head_grpo_loss(
            hidden,
            weight,
            mb.rollout.completion_ids[keep],
            weights[keep],
            rows[keep],
            old_logp=pick(mb.old_logp),
            ref_logp=pick(mb.ref_logp),
            sampling_logp=pick(mb.rollout.sampling_logp),
            temperature=config.rollout.temperature,
            fused=True,
            **token_settings,
        )
    else:  # a sequence-level ratio couples the rows of a sequence: two passes

        def whole_loss(packed_logp, packed_entropy):
            full_logp, full_entropy = unpack(keep, packed_logp), unpack(keep, packed_entropy)
            return _policy_loss_on(
                mb, full_logp, full_entropy, num_sequences, num_tokens, settings
            )[0]

        loss, logp, entropy = lm_head_policy_loss(
            hidden,
            weight,
            mb.rollout.completion_ids[keep],
            whole_loss,
            temperature=config.rollout.temperature,
            fused=True,
        )
    with torch.no_grad():
        full_logp, full_entropy = unpack(keep, logp), unpack(keep, entropy)
        _, parts = _policy_loss_on(mb, full_logp, full_entropy, num_sequences, num_tokens, settings)
    return loss, parts


def update_policy(config: Config, trainer, rollout: Rollout, advantages, timer: PhaseTimer) -> dict:
    """K inner epochs of mini-batch AdamW steps over one rollout batch; returns averaged metrics.

    `timer` gets the phases reference, old_logprobs, update (forward and backward passes) and
    optimizer (gradient clipping, AdamW, the bf16 refresh from fp32 masters and schedule steps,
    summed over the optimizer steps).
    """
    a, t = config.algo, config.train
    model, ref_model, optimizer, scheduler = (
        trainer.model,
        trainer.ref_model,
        trainer.optimizer,
        trainer.scheduler,
    )
    rows = advantages.shape[0]
    per_mini = rows // t.mini_batches
    settings = loss_settings(config)
    fused = use_fused_lm_head(config, model)
    zero_grad_possible = a.beta == 0 and a.entropy_coef == 0
    needs_old = t.num_iterations > 1 or t.mini_batches > 1
    minis = []
    with timer("reference"):  # the micro-batch plan is timed here too
        for m in range(t.mini_batches):
            index = torch.arange(m * per_mini, (m + 1) * per_mini, device=advantages.device)
            sub = rollout.rows(index)
            num_tokens = sub.completion_mask.sum().clamp(min=1)
            active = (advantages[index] != 0) | (not zero_grad_possible)  # rows that move weights
            micro = _micro_batches(
                sub, advantages[index], active, t.micro_batch_tokens, isinstance(model, Transformer)
            )
            minis.append((micro, per_mini, num_tokens))
        if ref_model is not None:
            for micro, _, _ in minis:
                for mb, logp in zip(micro, _score(ref_model, micro, config, fused)):
                    mb.ref_logp = logp
    with timer("old_logprobs"), torch.no_grad():
        if needs_old:  # on the training micro-batches themselves: bitwise the first inner step's
            for micro, _, _ in minis:
                for mb in micro:
                    mb.old_logp, _ = completion_logprobs(
                        model, mb.rollout, temperature=config.rollout.temperature, fused=fused
                    )

    # On the device until the end, so the host never waits for a micro-batch to finish:
    totals: dict[str, torch.Tensor] = {}  # token-weighted sums of the loss's metrics
    weight_sum = torch.zeros((), device=advantages.device)
    loss_sum = torch.zeros((), device=advantages.device)  # = sum of the optimizer steps' losses
    grad_norms = []
    model.train()
    with timer("update"):
        for _ in range(t.num_iterations):
            for micro, num_sequences, num_tokens in minis:
                optimizer.zero_grad()
                for mb in micro:
                    step_loss = fused_micro_batch_loss if fused else micro_batch_loss
                    loss, parts = step_loss(config, model, mb, num_sequences, num_tokens, settings)
                    if loss.requires_grad:  # False when every token is masked (all truncated)
                        loss.backward()
                    loss_sum += loss.detach().float()
                    tokens = mb.rollout.completion_mask.sum().float()
                    weight_sum += tokens
                    for name, value in parts.items():  # detached 0-d tensors
                        totals[name] = totals.get(name, 0.0) + value.float() * tokens
                with timer("optimizer"):
                    norm = optimizer.step(t.max_grad_norm)
                    scheduler.step()
                if norm is not None:
                    grad_norms.append(norm)
    names = list(totals)
    norms = [n.float() for n in grad_norms]  # on the device, as the sums
    values = torch.stack([totals[n] for n in names] + [weight_sum, loss_sum] + norms).tolist()
    k = len(names)  # one sync above for every metric
    sums, (weight_sum, loss_sum), norms = values[:k], values[k : k + 2], values[k + 2 :]
    out = {name: value / weight_sum for name, value in zip(names, sums)} if weight_sum else {}
    out["loss"] = loss_sum / (t.num_iterations * t.mini_batches)  # mean over optimizer steps
    if norms:
        out["grad_norm"] = sum(norms) / len(norms)
    out["active_rows_frac"] = (
        sum(mb.advantages.numel() for micro, _, _ in minis for mb in micro) / rows
    )
    return out


# The reference model's scoring keeps no activations, so it runs over this many training
# micro-batch budgets at once: fewer forwards, less host time (the trainer is host-bound at small
# batches). The old log-probs stay on the training micro-batches: a GEMM over more rows may round
# differently, and they must equal the first inner step's log-probs to the bit.
SCORING_BUDGET_FACTOR = 4


@torch.no_grad()
def _score(model, micro: list[MicroBatch], config: Config, fused: bool) -> list[torch.Tensor]:
    """(b, Tc) completion log-probs of each micro-batch's rows, from forwards over groups of
    consecutive micro-batches of up to SCORING_BUDGET_FACTOR token budgets each."""
    budget = SCORING_BUDGET_FACTOR * config.train.micro_batch_tokens
    groups: list[list[MicroBatch]] = []
    size = budget  # padded tokens in the current group; start a new group at once
    for mb in micro:
        rollout = mb.rollout
        tokens = rollout.prompt_ids.shape[0] * (
            rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1]
        )  # padded, as the plan counts them
        if size + tokens > budget:
            groups.append([])
            size = 0
        groups[-1].append(mb)
        size += tokens
    out = []
    for group in groups:
        merged = concat_rollouts([mb.rollout for mb in group])
        logp, _ = completion_logprobs(
            model, merged, temperature=config.rollout.temperature, fused=fused
        )  # (rows, Tc)
        for mb, part in zip(group, logp.split([mb.advantages.shape[0] for mb in group])):
            out.append(part[:, : mb.rollout.completion_ids.shape[1]])
    return out


def _micro_batches(
    sub: Rollout, advantages, active, token_budget: int, packed: bool
) -> list[MicroBatch]:
    """The rows that move the weights, in micro-batches of the token budget; `packed`: the native
    model's forward, which packs rows without padding and each shared prompt once."""
    index = active.nonzero().squeeze(-1)
    if index.numel() == 0:
        return []
    chosen = sub.rows(index)
    groups = prompt_groups(chosen.prompt_ids, chosen.prompt_mask) if packed else None
    plan = plan_micro_batches(
        chosen.prompt_mask.sum(-1), chosen.completion_mask.sum(-1), token_budget, groups
    )
    return [MicroBatch(trim_padding(chosen.rows(rows)), advantages[index][rows]) for rows in plan]
