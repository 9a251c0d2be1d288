"""Turn a task's user prompt into the exact text the policy model is asked to continue.

Why: instruction-tuned models expect their own chat format (role markers, generation
prompt); base models without a chat template get plain text. Rendering in one place keeps
training and evaluation prompts identical.
"""

from __future__ import annotations

from typing import Any


def render_prompt(tokenizer: Any, prompt: str, system_prompt: str | None = None) -> str:
    """Render `prompt` (and an optional system message) ready for generation.

    Uses the tokenizer's chat template when it has one, with the assistant generation
    prompt appended. `system_prompt` None or "" adds no system message (the template may
    still insert its own default). Without a chat template, falls back to plain text:
    "{system_prompt}\\n\\n{prompt}\\n", or "{prompt}\\n" with no system prompt.
    """
    if getattr(tokenizer, "chat_template", None):
        return _apply_template(tokenizer, build_messages(prompt, system_prompt))
    if system_prompt:
        return f"{system_prompt}\n\n{prompt}\n"
    return f"{prompt}\n"


def build_messages(prompt: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat messages for one prompt: an optional system message, then the user turn."""
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": prompt})
    return messages


def _apply_template(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(rendered, str):
        raise TypeError(
            f"apply_chat_template(tokenize=False) returned {type(rendered).__name__}, expected str"
        )
    return rendered
