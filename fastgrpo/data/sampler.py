"""Deterministic, resumable order in which training prompts are visited.

Why: a resumed run must see exactly the prompts an uninterrupted run would have seen, or
checkpoints are not reproducible. The sampler is a pure function of (seed, epoch, position),
which is all `state_dict()` stores.

Epoch policy: every epoch is a fresh permutation of all examples drawn with
`random.Random(seed + epoch)`. Batches never straddle epochs: when fewer than `batch_size`
indices remain in an epoch, that remainder is dropped and the next epoch starts. Because
each epoch reshuffles, every example is still visited across epochs.
"""

from __future__ import annotations

import random


class PromptSampler:
    """Yields batches of example indices in a seeded order that can be saved and resumed."""

    def __init__(self, num_examples: int, batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > num_examples:
            raise ValueError(
                f"batch_size ({batch_size}) is larger than the number of training examples "
                f"({num_examples}); lower the batch size or add examples"
            )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._permutation: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices; starts a new epoch when this one cannot fill a batch."""
        if self.position + self.batch_size > self.num_examples:
            self.epoch += 1
            self.position = 0
            self._permutation = None
        order = self._epoch_permutation()
        batch = order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a saved position; the next batches equal those of the saved sampler."""
        missing = {"epoch", "position", "seed"} - set(state)
        if missing:
            raise ValueError(f"sampler state is missing keys {sorted(missing)}")
        if not 0 <= state["position"] <= self.num_examples:
            raise ValueError(
                f"sampler position {state['position']} is outside 0..{self.num_examples}; "
                "was the state saved for a different dataset?"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state["seed"])
        self._permutation = None

    def _epoch_permutation(self) -> list[int]:
        if self._permutation is None:
            order = list(range(self.num_examples))
            random.Random(self.seed + self.epoch).shuffle(order)
            self._permutation = order
        return self._permutation
