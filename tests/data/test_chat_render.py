"""Tests for rendering prompts through a tokenizer's chat template, or as plain text."""

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast

from fastgrpo.data.chat import build_messages, render_prompt

TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|system|>default\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer(chat_template=None):
    vocab = {"[UNK]": 0, "what": 1, "is": 2, "2": 3, "+": 4}
    backend = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture
def chat_tokenizer():
    return tiny_tokenizer(TEMPLATE)


def test_template_renders_user_turn_and_generation_prompt(chat_tokenizer):
    text = render_prompt(chat_tokenizer, "what is 2 + 2")
    assert text == "<|system|>default\n<|user|>what is 2 + 2\n<|assistant|>"


def test_template_renders_the_given_system_prompt(chat_tokenizer):
    text = render_prompt(chat_tokenizer, "what is 2 + 2", system_prompt="Be brief.")
    assert text == "<|system|>Be brief.\n<|user|>what is 2 + 2\n<|assistant|>"


def test_empty_system_prompt_adds_no_system_message(chat_tokenizer):
    assert render_prompt(chat_tokenizer, "hi", system_prompt="") == render_prompt(
        chat_tokenizer, "hi"
    )
    assert build_messages("hi", "") == [{"role": "user", "content": "hi"}]


def test_tokenizer_without_template_falls_back_to_plain_text():
    tokenizer = tiny_tokenizer(chat_template=None)
    assert render_prompt(tokenizer, "what is 2 + 2") == "what is 2 + 2\n"
    assert render_prompt(tokenizer, "what is 2 + 2", "Be brief.") == (
        "Be brief.\n\nwhat is 2 + 2\n"
    )
