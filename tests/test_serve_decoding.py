"""Streaming detokenization: fed in any chunking, the incremental text is the text of one decode of all ids;
stop strings are cut out even when they straddle tokens."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.common.tokenizer import BPETokenizer, ByteTokenizer
from kvlab.experiments.serve.decoding import Decoding


def streamed(tokenizer, ids: list[int], sizes: list[int], stop: list[str] = ()) -> tuple[str, Decoding]:
    dec = Decoding(tokenizer, 1, list(stop))
    text, at = [], 0
    for size in sizes:
        text.append(dec.add(0, ids[at:at + size])[1])
        at += size
    text.append(dec.add(0, ids[at:])[1])
    text.append(dec.add(0, [], final=True)[1])
    return "".join(text), dec


@pytest.fixture(scope="module")
def bpe():
    tk = pytest.importorskip("tokenizers")
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "naïve café — déjà vu", "数据 模型 推理", "🙂 🚀 ✓"] * 20
    backend.train_from_iterator(corpus, tk.trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                                initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
    return BPETokenizer(backend, None, None)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(3, 600), max_size=80), sizes=st.lists(st.integers(1, 6), max_size=30))
def test_byte_tokenizer_stream_equals_one_decode(ids, sizes):
    tok = ByteTokenizer(1024, add_bos=False)
    assert streamed(tok, ids, sizes)[0] == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_byte_level_bpe_stream_equals_one_decode(bpe, data):
    ids = data.draw(st.lists(st.integers(0, bpe.vocab_size - 1), max_size=60))
    sizes = data.draw(st.lists(st.integers(1, 6), max_size=30))
    assert streamed(bpe, ids, sizes)[0] == bpe.decode(ids)


def test_multibyte_characters_wait_for_their_last_byte():
    tok = ByteTokenizer(1024, add_bos=False)
    ids = tok.encode("é🙂")                               # 2 + 4 bytes
    dec = Decoding(tok, 1, [])
    deltas = [dec.add(0, [i])[1] for i in ids]
    assert deltas == ["", "é", "", "", "", "🙂"]


def test_stop_string_across_tokens_is_cut_and_never_sent(bpe):
    ids = bpe.encode("the quick brown fox jumps")
    text, dec = streamed(bpe, ids, [1] * len(ids), stop=["own f"])
    assert text == "the quick br" and dec.samples[0].finish_reason == "stop"
