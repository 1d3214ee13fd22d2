"""Per-token log-probabilities in OpenAI's response shapes, written as the tokens are sent.

The engine hands each new token's (logprob, top candidates) with the token (TokensEvent.logprobs). Completions:
`{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, the top dict holding the sampled token
too, as vLLM writes it. Chat: `{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`.
"""
from __future__ import annotations

from typing import Any


class LogprobWriter:
    def __init__(self, tokenizer: Any, n: int, chat: bool, text_offset: int) -> None:
        self.decode = tokenizer.decode if tokenizer is not None else None
        self.chat = chat
        self.pending: list[list] = [[] for _ in range(n)]      # received, not yet sent, per sample
        self.offsets = [text_offset] * n

    def receive(self, logprobs: list[list]) -> None:
        for i, entries in enumerate(logprobs):
            self.pending[i] += entries

    def take(self, i: int, ids: list[int]) -> dict[str, list]:
        """The logprobs of sample i's tokens `ids`, the next it sends."""
        entries, self.pending[i] = self.pending[i][:len(ids)], self.pending[i][len(ids):]
        if self.chat:
            return {"content": [self._chat_entry(tok, lp, top) for tok, (lp, top) in zip(ids, entries)]}
        return self._completion(i, ids, entries)

    def empty(self) -> dict[str, list]:
        return {"content": []} if self.chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                  "text_offset": []}

    def token(self, token_id: int) -> str:
        return self.decode([token_id]) if self.decode is not None else f"token_id:{token_id}"

    def _chat_entry(self, token_id: int, logprob: float, top: tuple) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self.token(tid)), "logprob": lp, "bytes": list(t.encode())}
                                 for tid, lp in top]}

    def _completion(self, i: int, ids: list[int], entries: list) -> dict[str, list]:
        tokens = [self.token(t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(self.offsets[i])
            self.offsets[i] += len(text)
        tops = [{self.token(tid): lp for tid, lp in top} | {text: lp}
                for text, (lp, top) in zip(tokens, entries)]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in entries], "top_logprobs": tops,
                "text_offset": offsets}


def merge(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    return {k: a[k] + b[k] for k in a}
