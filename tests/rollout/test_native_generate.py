"""The per-model engine of `native_rollout`: made once, remade when the stop ids change, and freed
with its model."""

from __future__ import annotations

import gc
import weakref

from fastgrpo.rollout.native_generate import engine_for, release_engine
from tests.rollout.test_engine import GREEDY, NEVER, tiny_pair


def test_the_engine_is_kept_per_model_and_remade_when_the_stop_ids_change():
    _, model = tiny_pair()
    engine = engine_for(model, [NEVER], pad_id=0)
    assert engine_for(model, [NEVER, NEVER], pad_id=0) is engine  # the same stop set
    remade = engine_for(model, [NEVER, 3], pad_id=0)
    assert remade is not engine
    release_engine(model)
    assert engine_for(model, [NEVER, 3], pad_id=0) is not remade


def test_a_model_with_an_engine_is_freed_when_dropped():
    """A table keyed weakly by the model kept every model alive, since its engine refers to it:
    a second run in one process held the first run's weights, cache and graphs."""
    _, model = tiny_pair()
    engine = engine_for(model, [NEVER], pad_id=0)
    engine.generate([[5, 6, 7]], num_samples=2, max_new_tokens=3, params=GREEDY)
    model_ref, engine_ref = weakref.ref(model), weakref.ref(engine)
    del model, engine
    gc.collect()
    assert model_ref() is None and engine_ref() is None
