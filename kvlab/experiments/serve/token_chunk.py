"""A streamed token's SSE chunk without a json.dumps of the whole body: the chunk of a request that asked for no
logprobs and no continuous usage differs from token to token only in the sample index, the text and the ids, so
the rest is formatted once per request. The bytes are exactly json.dumps' (its default separators and ASCII
escaping); tests/test_serve_token_chunk.py holds the two side by side.
"""
from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as quoted  # what json.dumps writes for a str


class TokenChunks:
    def __init__(self, rid: str, created: int, model: str, chat: bool) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": []})
        self.head = "data: " + head[:-len("]}")] + '{"index": '                 # up to the choice's index
        self.text_key = ', "delta": {"role": "assistant", "content": ' if chat else ', "text": '
        self.tail = '}, "logprobs": null' if chat else ', "logprobs": null'
        self.tail += ', "finish_reason": null, "token_ids": ['

    def chunk(self, i: int, text: str, ids: list[int]) -> str:
        """`data: {...}\\n\\n` for sample i's new text and ids, as CompletionReply.chunk would write it."""
        return f"{self.head}{i}{self.text_key}{quoted(text)}{self.tail}{', '.join(map(str, ids))}]}}]}}\n\n"
