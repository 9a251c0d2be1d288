"""Tests for the seeded, resumable prompt sampler."""

import pytest

from fastgrpo.data.sampler import PromptSampler


def take(sampler, count):
    return [sampler.next_batch() for _ in range(count)]


def test_each_epoch_is_a_permutation_with_the_remainder_dropped():
    sampler = PromptSampler(num_examples=10, batch_size=3, seed=0)
    epoch = take(sampler, 3)
    flat = [index for batch in epoch for index in batch]
    assert all(len(batch) == 3 for batch in epoch)
    assert len(set(flat)) == 9 and set(flat) <= set(range(10))
    assert sampler.state_dict() == {"epoch": 0, "position": 9, "seed": 0}
    sampler.next_batch()
    assert sampler.state_dict() == {"epoch": 1, "position": 3, "seed": 0}


def test_epochs_are_reshuffled_and_same_seed_repeats_the_order():
    first = take(PromptSampler(20, 5, seed=4), 8)
    again = take(PromptSampler(20, 5, seed=4), 8)
    other = take(PromptSampler(20, 5, seed=5), 8)
    assert first == again
    assert first != other
    assert first[:4] != first[4:]
    assert sorted(i for batch in first[4:] for i in batch) == list(range(20))


def test_epoch_e_uses_seed_plus_e():
    later_epoch = take(PromptSampler(12, 4, seed=3), 6)[3:]
    shifted_seed = take(PromptSampler(12, 4, seed=4), 3)
    assert later_epoch == shifted_seed


@pytest.mark.parametrize("stop_after", [0, 1, 4, 7, 13])
def test_resumed_sampler_yields_the_same_batches_as_an_uninterrupted_one(stop_after):
    uninterrupted = take(PromptSampler(17, 4, seed=11), 25)
    interrupted = PromptSampler(17, 4, seed=11)
    before = take(interrupted, stop_after)
    resumed = PromptSampler(17, 4, seed=0)
    resumed.load_state_dict(dict(interrupted.state_dict()))
    assert before + take(resumed, 25 - stop_after) == uninterrupted


def test_batch_larger_than_dataset_is_rejected():
    with pytest.raises(ValueError, match=r"batch_size \(8\) is larger than .* \(5\)"):
        PromptSampler(num_examples=5, batch_size=8, seed=0)


def test_state_from_a_different_dataset_is_rejected():
    sampler = PromptSampler(5, 2, seed=0)
    with pytest.raises(ValueError, match="outside 0..5"):
        sampler.load_state_dict({"epoch": 0, "position": 9, "seed": 0})
    with pytest.raises(ValueError, match=r"missing keys \['seed'\]"):
        sampler.load_state_dict({"epoch": 0, "position": 0})
