"""Chat messages -> prompt text.

The tokenizer's own template is used when it has one (`apply_chat_template`, as a Hugging Face tokenizer). The
fallback is ChatML, which SmolLM2 was trained on: for each message `<|im_start|>{role}\\n{content}<|im_end|>\\n`,
then `<|im_start|>assistant\\n` to open the reply.
"""
from __future__ import annotations

from typing import Any


def chatml(messages: list[dict[str, str]]) -> str:
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def renderer(tokenizer: Any):
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None or not getattr(tokenizer, "chat_template", None):
        return chatml
    return lambda messages: apply(messages, tokenize=False, add_generation_prompt=True)
