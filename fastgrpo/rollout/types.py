"""What a rollout hands to the trainer, whichever engine produced it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # (B, Tp) left-padded with the pad id
    prompt_mask: torch.Tensor  # (B, Tp) 1 on real prompt tokens
    completion_ids: torch.Tensor  # (B, Tc) right-padded after the stop token
    completion_mask: torch.Tensor  # (B, Tc) 1 up to and including the first stop token
    finished: torch.Tensor  # (B,) bool: ended with a stop token (False: cut at the length limit)
    sampling_logp: torch.Tensor | None = None  # (B, Tc) fp32 log-probs the sampler drew from

    @property
    def lengths(self) -> torch.Tensor:  # (B,)
        return self.completion_mask.sum(-1)

    def rows(self, index: torch.Tensor | list[int]) -> Rollout:
        """The sub-rollout of the given rows (same padding widths)."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.prompt_ids.device)
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return Rollout(
            pick(self.prompt_ids),
            pick(self.prompt_mask),
            pick(self.completion_ids),
            pick(self.completion_mask),
            pick(self.finished),
            pick(self.sampling_logp),
        )


def completion_mask(
    completion_ids: torch.Tensor, stop_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask (B, Tc) that keeps tokens through the first stop token, and whether each row stopped.

    A row with no stop token was cut at the length limit: all of its tokens count.
    """
    stops = torch.isin(
        completion_ids, torch.tensor(stop_ids, device=completion_ids.device)
    )  # (B, Tc)
    finished = stops.any(-1)  # (B,)
    # position of the first stop, or Tc when none
    first = torch.where(
        finished,
        stops.float().argmax(-1),
        torch.full_like(finished, completion_ids.shape[1], dtype=torch.long),
    )
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    mask = (positions.unsqueeze(0) <= first.unsqueeze(1)).to(torch.float32)
    return mask, finished
