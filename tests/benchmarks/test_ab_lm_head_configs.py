"""benchmarks/lab/ab_lm_head_configs.py: its variants set exactly the kernel configurations they name
and put the defaults back (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest

from benchmarks.lab import ab_lm_head_configs as ab
from fastgrpo.kernels.train import lm_head_backward, lm_head_stats, lm_head_stats_gluon


def test_a_variant_sets_the_configurations_it_names_and_apply_restores_the_defaults():
    name, settings = ab.parse_variant("new:dh=256,128,64,8,4,7;dw=256,128,64,8,4,0,1;gluon=0")
    assert name == "new"
    assert settings == {
        "dh": (256, 128, 64, 8, 4, 7),
        "dw": (256, 128, 64, 8, 4, 0, 1),
        "gluon": (0,),
    }
    try:
        ab.apply(settings)
        assert lm_head_backward._dh_blocks(896) == (256, 128, 64, 8, 4)
        assert lm_head_backward._dh_splits(896) == 7
        assert lm_head_backward._dw_blocks(896) == (256, 128, 64, 8, 4, 0, 1)
        assert lm_head_stats._blocks is ab.DEFAULTS["stats_blocks"]  # not named: untouched
        assert lm_head_stats_gluon.ENABLED is False
    finally:
        ab.apply({})
    assert lm_head_backward._dh_blocks is ab.DEFAULTS["dh_blocks"]
    assert lm_head_backward._dw_blocks is ab.DEFAULTS["dw_blocks"]
    assert lm_head_stats_gluon.ENABLED == ab.DEFAULTS["gluon"]


def test_a_variant_with_an_unknown_setting_says_which_ones_exist():
    with pytest.raises(SystemExit, match="use dh, dw, stats or gluon"):
        ab.parse_variant("x:blocks=1,2")
    assert ab.parse_variant("defaults:") == ("defaults", {})
