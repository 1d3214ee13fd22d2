"""Text prompts, as `vllm bench serve` sends them: the tokenizer that turns drawn token ids into text (and counts
a text's tokens), and ShareGPT conversations read from a local JSON file."""
from __future__ import annotations

import json
import os
import random
import stat
from typing import Any

from kvlab.common.errors import ConfigError, KvlabError
from kvlab.common.tokenizer import ByteTokenizer
from kvlab.common.validate import shown, user_path

MAX_SHAREGPT_BYTES = 2 << 30

BYTE_VOCAB = 259                   # the byte tokenizer kvlab's tiny preset uses: 256 bytes after pad/bos/eos
PRINTABLE = range(ByteTokenizer.OFFSET + 0x20, ByteTokenizer.OFFSET + 0x7F)   # ASCII text: one token per byte
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048     # vLLM's ShareGPT filter


def load_tokenizer(name: str | None, explicit: bool) -> Any:
    """The tokenizer of a preset or a local model. A --model that names neither (another server's model id)
    falls back to the byte tokenizer; a --tokenizer that cannot be loaded is an error."""
    if name is None:
        return ByteTokenizer(BYTE_VOCAB, add_bos=False)
    from kvlab.common.loader import load_model
    from kvlab.common.presets import PRESETS
    if name in PRESETS or user_path(name).exists():
        try:
            tokenizer = load_model(name)[1]
        except KvlabError as e:
            raise ConfigError(f"--tokenizer {shown(name)}: {e}") from None
        if tokenizer is not None:
            return tokenizer
    if explicit:
        raise ConfigError(f"--tokenizer {shown(name)}: not a kvlab preset or a local model with a tokenizer")
    return ByteTokenizer(BYTE_VOCAB, add_bos=False)


def id_range(tokenizer: Any) -> range:
    """Token ids whose decoded text re-encodes to as many tokens: printable ASCII for a byte tokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        return PRINTABLE
    return range(3, tokenizer.vocab_size)


def count_tokens(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text)
    return len(ids) - (1 if ids[:1] == [tokenizer.bos_token_id] and getattr(tokenizer, "add_bos", False) else 0)


def sharegpt(path: str, n: int, seed: int, tokenizer: Any) -> list[tuple[str, int, int]]:
    """(prompt, prompt tokens, output tokens) for up to n conversations: the first human turn and the length of
    the reply, shuffled with `seed` and filtered as vLLM filters them (both >= 4 tokens, prompt <= 1024, total
    <= 2048)."""
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in read_sharegpt(path)]
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        plen, olen = count_tokens(tokenizer, prompt), count_tokens(tokenizer, reply)
        if min(plen, olen) >= SHAREGPT_MIN_LEN and plen <= SHAREGPT_MAX_PROMPT and plen + olen <= SHAREGPT_MAX_TOTAL:
            out.append((prompt, plen, olen))
        if len(out) == n:
            break
    if not out:
        raise ConfigError(f"--dataset-path {shown(path)}: no conversation passes the ShareGPT length filter")
    return out


def bounded_read(path: str) -> bytes:
    """A regular file's bytes, at most MAX_SHAREGPT_BYTES (ShareGPT V3 is 0.7 GB): a device such as /dev/zero,
    or a larger file, is one line instead of a read until memory runs out."""
    with open(path, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ConfigError(f"--dataset-path {shown(path)}: not a regular file (a device, pipe or directory)")
        data = f.read(MAX_SHAREGPT_BYTES + 1)
    if len(data) > MAX_SHAREGPT_BYTES:
        raise ConfigError(f"--dataset-path {shown(path)}: larger than {MAX_SHAREGPT_BYTES >> 30} GiB "
                          "(MAX_SHAREGPT_BYTES); is this a ShareGPT JSON file?")
    return data


def read_sharegpt(path: str) -> list[dict]:
    """The file's conversations with two string turns at least; anything else is a one-line error."""
    try:
        data = json.loads(bounded_read(path).decode("utf-8"))
    except ConfigError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) else f"not JSON: {type(e).__name__}"
        raise ConfigError(f"--dataset-path {shown(path)}: cannot read ShareGPT JSON ({why})") from None
    if not isinstance(data, list):
        raise ConfigError(f"--dataset-path {shown(path)}: ShareGPT JSON is a list of {{\"conversations\": [...]}}")
    return [c for c in data if is_conversation(c)]


def is_conversation(entry: Any) -> bool:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    return isinstance(turns, list) and len(turns) >= 2 and all(
        isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2])
