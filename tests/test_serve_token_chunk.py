"""A plain streamed token's preformatted chunk (token_chunk.py) is byte for byte the chunk CompletionReply writes
with json.dumps, for any text, ids, sample index, request id and model name, completions and chat."""
from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.common.tokenizer import ByteTokenizer
from kvlab.experiments.serve import app as appmod
from kvlab.experiments.serve import protocol
from kvlab.experiments.serve.token_chunk import TokenChunks


class TokenizerOnly:
    tokenizer = ByteTokenizer(1024)


def reply(chat: bool, model: str) -> appmod.CompletionReply:
    server = appmod.Server(TokenizerOnly(), "served")
    body = {"model": model, "stream": True, "max_tokens": 4}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    return appmod.CompletionReply(server, protocol.parse(body, chat, server.render_chat), "cmpl-x", 2,
                                  asyncio.Queue())


def general(r: appmod.CompletionReply, i: int, text: str, ids: list[int]) -> str:
    """What stream() writes for a token without the preformatted path."""
    return r.chunk([r.choice(i, text, None, True, r.piece_logprobs(i, ids)) | {"token_ids": ids}],
                   r.running_usage())


@settings(max_examples=300, deadline=None)
@given(chat=st.booleans(), model=st.text(max_size=12), rid=st.text(max_size=12), i=st.integers(0, 12),
       text=st.text(max_size=20), ids=st.lists(st.integers(0, 200_000), max_size=5))
def test_the_preformatted_chunk_is_json_dumps_byte_for_byte(chat, model, rid, i, text, ids):
    r = reply(chat, model)
    r.rid = rid
    assert TokenChunks(rid, r.created, r.model(), chat).chunk(i, text, ids) == general(r, i, text, ids)


def test_edge_texts_match_too():
    for chat in (False, True):
        r = reply(chat, "")
        plain = TokenChunks(r.rid, r.created, r.model(), chat)
        for text in ("", '"', "\\", "\n\t\x00\x1f", "\ufffd", "déjà 🙂", "\u2028", "</script>"):
            assert plain.chunk(0, text, []) == general(r, 0, text, [])
            assert plain.chunk(3, text, [7, 1024]) == general(r, 3, text, [7, 1024])
