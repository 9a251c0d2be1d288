"""Turn a completion, in whatever shape the trainer hands it over, into plain text.

Reward functions receive completions either as strings (standard datasets) or in
chat form, a list of message dicts such as ``[{"role": "assistant", "content": "..."}]``
(conversational datasets, as TRL passes them). Every built-in reward reads its
completions through :func:`completion_text` so both shapes score the same way.
"""

from collections.abc import Mapping, Sequence
from typing import Any


def completion_text(completion: Any) -> str:
    """Return the text of one completion: a string as is, chat form as its last message."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _message_text(completion)
    if isinstance(completion, Sequence):
        if not completion:
            return ""
        return completion_text(completion[-1])
    raise TypeError(
        f"A completion must be a string or a list of chat messages, got {type(completion).__name__}."
    )


def _message_text(message: Mapping) -> str:
    """The text of one chat message; multimodal content parts are joined by their text."""
    content = message.get("content", "")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(_part_text(part) for part in content)
    return str(content)


def _part_text(part: Any) -> str:
    """The text of one content part: a string, or a ``{"type": "text", "text": ...}`` dict."""
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping):
        return str(part.get("text") or "")
    return ""
