"""Chat messages to a prompt: the tokenizer's own chat template, or a simple default.

The default template (for tokenizers without one, such as the presets' byte tokenizer) writes
each message as ``<|role|>``, a newline, its text and a newline, then ``<|assistant|>`` and a
newline for the reply::

    <|system|>
    You are terse.
    <|user|>
    Hi!
    <|assistant|>
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgraph.entrypoints.serve.errors import APIError
from kvgraph.entrypoints.serve.protocol import ChatMessage

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat_prompt(tokenizer: object | None, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                add_special_tokens: bool = False) -> list[int]:
    """The token ids of ``messages`` rendered by the chat template, ready for the reply (with
    ``add_generation_prompt``); the template writes any special tokens itself, so none are added
    unless ``add_special_tokens``."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot chat; use /v1/completions with token ids")
    template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.text} for m in messages],
        chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
    )
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
