"""Tokenizers: a byte-level one for the tiny preset (no dependencies) and a BPE one built with the
`tokenizers` package, either from an HF `tokenizer.json` or from a GGUF file's `tokenizer.ggml.*` metadata.

Every tokenizer offers `encode(text) -> list[int]` (special tokens such as BOS included as the model
expects), `decode(ids) -> str`, `vocab_size`, `bos_token_id`, `eos_token_id`.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from kvlab.common.errors import ModelLoadError, RequestError

GGUF_CONTROL_TOKEN = 3    # llama.cpp token type of special tokens such as <|im_start|>


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes offset by 3 (0 pad, 1 BOS, 2 EOS). Ids past the byte range (a random model emits them)
    decode to U+FFFD so every generated token stays visible."""

    OFFSET = 3

    def __init__(self, vocab_size: int, add_bos: bool = True) -> None:
        if vocab_size < 256 + self.OFFSET:
            raise ModelLoadError(f"byte tokenizer needs vocab_size >= {256 + self.OFFSET}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.add_bos = add_bos

    def encode(self, text: str) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if self.add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if self.OFFSET <= i < 256 + self.OFFSET:
                pending.append(i - self.OFFSET)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            if i >= 256 + self.OFFSET:
                out.append("\ufffd")
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


def require_tokenizers(purpose: str) -> Any:
    """The `tokenizers` package, or a ModelLoadError saying how to get it."""
    try:
        import tokenizers
    except ImportError:
        raise ModelLoadError(f"{purpose} needs the 'tokenizers' package: pip install tokenizers") from None
    return tokenizers


class BPETokenizer:
    """A `tokenizers.Tokenizer` behind the kvlab tokenizer interface."""

    def __init__(self, backend: Any, bos_token_id: int | None, eos_token_id: int | None,
                 add_bos: bool = False) -> None:
        self.backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.add_bos = add_bos

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text).ids
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)

    @classmethod
    def from_file(cls, path: Path, bos_token_id: int | None, eos_token_id: int | None) -> BPETokenizer:
        """An HF tokenizer.json (its post-processor adds BOS where the model wants it)."""
        tk = require_tokenizers(f"the tokenizer {path}")
        try:
            backend = tk.Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on malformed JSON)
            raise ModelLoadError(f"{path}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from None
        return cls(backend, bos_token_id, eos_token_id)

    @classmethod
    def from_gguf_vocab(cls, tokens: list[str], merges: list[str], token_types: list[int] | None,
                        bos_token_id: int | None, eos_token_id: int | None, add_bos: bool) -> BPETokenizer:
        """GPT-2 style byte-level BPE as llama.cpp's "smollm"/"gpt2" pre-tokenizers run it: digits split one
        by one, then the GPT-2 regex. Control tokens (type 3) match whole."""
        tk = require_tokenizers("the GGUF tokenizer (tokenizer.ggml.model 'gpt2')")
        vocab = {token: i for i, token in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        backend = tk.Tokenizer(tk.models.BPE(vocab, pairs, fuse_unk=False))
        backend.pre_tokenizer = tk.pre_tokenizers.Sequence([
            tk.pre_tokenizers.Digits(individual_digits=True),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        backend.decoder = tk.decoders.ByteLevel()
        special = [t for t, kind in zip(tokens, token_types or ()) if kind == GGUF_CONTROL_TOKEN]
        backend.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in special])
        return cls(backend, bos_token_id, eos_token_id, add_bos=add_bos)


def prompt_tokens(prompt: Any, tokenizer: Tokenizer | None, vocab_size: int | None) -> tuple[str | None, list[int]]:
    """A prompt's text (None when given as ids) and token ids; RequestError (one line) if it is not a string or
    a list of token ids inside the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this model has no tokenizer: pass prompts as lists of token ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(f"the prompt is not valid Unicode text ({exc.reason} at character "
                               f"{exc.start}): remove lone surrogates") from None
        return prompt, list(tokenizer.encode(prompt))
    if not isinstance(prompt, (list, tuple)) or not _all_token_ids(prompt):
        raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if vocab_size is not None and prompt and not (0 <= min(prompt) and max(prompt) < vocab_size):
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        raise RequestError(f"token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return None, list(prompt)


def _all_token_ids(prompt: list | tuple) -> bool:
    """Every element an int and none a bool; the type-set test runs in C (simulated prompts are long)."""
    return set(map(type, prompt)) <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
