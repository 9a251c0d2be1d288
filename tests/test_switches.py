"""The FASTGRPO_* switches: each one read where the README's table says, and each family of
kernels it turns off giving a correct rollout both ways."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# switch -> the module attributes it sets (a module copies its switch at import)
FAMILIES = {
    "FASTGRPO_FUSED_OPS": [
        ("fastgrpo.models.transformer", "FUSED_OPS"),
        ("fastgrpo.kernels.layers.token_inputs", "ENABLED"),
    ],
    "FASTGRPO_DECODE_KERNELS": [
        ("fastgrpo.kernels.decode.decode_attention_triton", "USE_TRITON"),
        ("fastgrpo.kernels.decode.decode_linear", "ENABLED"),
        ("fastgrpo.kernels.decode.lm_head_sample", "ENABLED"),
        ("fastgrpo.kernels.decode.decode_record", "ENABLED"),
        ("fastgrpo.rollout.sampling", "FUSED_SAMPLER"),
    ],
    "FASTGRPO_GLUON": [
        ("fastgrpo.kernels.decode.decode_attention_gluon", "ENABLED"),
        ("fastgrpo.kernels.decode.decode_linear_gluon", "ENABLED"),
        ("fastgrpo.kernels.train.lm_head_stats_gluon", "ENABLED"),
    ],
    "FASTGRPO_PDL": [("fastgrpo.kernels.decode.pdl", "ENABLED")],
}
READ_WHEN_USED = {
    "FASTGRPO_CACHE", "FASTGRPO_DEBUG", "FASTGRPO_NO_VARLEN", "FASTGRPO_STARTED_BY_LAUNCHER"
}  # fmt: skip

PROBE = """
import importlib, json, sys
from fastgrpo.models import attention
families = json.loads(sys.argv[1])
seen = {name: [getattr(importlib.import_module(m), a) for m, a in attrs]
        for name, attrs in families.items()}
seen["FASTGRPO_NO_VARLEN"] = [attention.VARLEN is None]
print(json.dumps(seen))
"""


def attributes_under(env: dict) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FASTGRPO_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(FAMILIES)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(out.stdout)


def test_each_switch_sets_every_attribute_of_its_family_and_only_those():
    defaults = attributes_under({})
    assert all(all(values) for name, values in defaults.items() if name in FAMILIES)
    for name in FAMILIES:
        seen = attributes_under({name: "0"})
        assert not any(seen[name]), name
        assert all(all(v) for other, v in seen.items() if other not in (name, *READ_WHEN_USED))
    assert attributes_under({"FASTGRPO_NO_VARLEN": "1"})["FASTGRPO_NO_VARLEN"] == [True]


def test_the_readme_documents_exactly_the_switches_the_package_reads():
    read = set()
    for path in (ROOT / "fastgrpo").rglob("*.py"):
        read |= set(re.findall(r"FASTGRPO_[A-Z_]+[A-Z]", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Environment switches") :]
    documented = set(re.findall(r"^\| `(FASTGRPO_[A-Z_]+)`", table, flags=re.M))
    assert read == documented == set(FAMILIES) | READ_WHEN_USED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_rollout_with_a_kernel_family_off_is_as_close_to_the_trainer_as_with_it_on():
    """Each family off (what its switch set to 0 does) against all on: the engine's log-probs of
    what it sampled, against the fp32 trainer's, are as close either way."""
    from fastgrpo.rollout.engine import RolloutEngine
    from fastgrpo.rollout.sampling import SamplingParams
    from tests.rollout.test_engine import NEVER, VOCAB, trainer_and_engine_models, trainer_logp

    exact, ours = trainer_and_engine_models(seed=13)
    prompts = [[(5 * p + i) % (VOCAB - 1) for i in range(4 + p)] for p in range(16)]
    errors = {}
    for family in ("all on", *FAMILIES):
        with pytest.MonkeyPatch.context() as patch:
            for module, attribute in FAMILIES.get(family, []):
                patch.setattr(importlib.import_module(module), attribute, False)
            engine = RolloutEngine(ours, stop_ids=[NEVER], pad_id=0)
            out = engine.generate(
                prompts, num_samples=4, max_new_tokens=16, params=SamplingParams(1.0), seed=3
            )
        out = type(out)(*(t.cpu() for t in (out.tokens, out.logp, out.lengths, out.finished)))
        errors[family] = (
            (out.logp.double() - trainer_logp(exact, prompts, out, 4, 1.0)).abs().mean()
        )
    for family in FAMILIES:
        assert errors[family] <= 1.5 * errors["all on"] + 1e-3, errors
        assert errors["all on"] <= 1.5 * errors[family] + 1e-3, errors
