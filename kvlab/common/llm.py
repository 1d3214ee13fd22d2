"""The vLLM-shaped entry point: `LLM(model="tiny", backend="vmm", **overrides).generate(prompts, params)`.

Errors: unknown config keys or bad values raise ConfigError at construction; invalid requests (bad
SamplingParams, empty prompt list, empty prompt, prompt + max_tokens > max_model_len, a string prompt
without a tokenizer, token ids outside the vocabulary) raise RequestError before anything runs; a request
the KV cache can never hold comes back alone with finish_reason "error" and `RequestOutput.error` set,
while the others complete.

Threads: one generate() runs at a time; a concurrent call raises RequestError at once (the engine is never
driven by two threads). close() from another thread during a run stops that run at its next step (it
raises KvlabError, its requests aborted) and returns once the cache is released; generate() after close()
raises KvlabError. An LLM dropped without close() is closed when it is collected (or at exit): its KV memory,
pool membership and threads go with it.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence as Seq
from typing import Any

import torch

from kvlab.common.capacity import warn_capacity
from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.errors import KvlabError, RequestError
from kvlab.common.kv.types import CacheStats
from kvlab.common.metrics import RunMetrics
from kvlab.common.outputs import RequestOutput
from kvlab.common.sampling_params import SamplingParams
from kvlab.common.validate import shown


class LLM:
    def __init__(self, model: str | None = None, backend: str | None = None, config_file: str | None = None,
                 **config_overrides: Any) -> None:
        """None keeps the TOML file's value (config_file), else EngineConfig's default (tiny, paged). Backend
        options are given flat (`page_size=...`, `kv_pool=...`: each goes to the backend that declares it)."""
        self.config = make_config(config_file, model=model, backend=backend, **config_overrides)
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.engine = Engine.from_config(self.config)
        self._release = weakref.finalize(self, self.engine.close)   # the engine, never self: collection can run it
        warn_capacity(self.config, self.engine.cache)
        self._metrics: RunMetrics | None = None
        self._busy = threading.Lock()          # held by the one running generate()
        self._closing = False

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        if not self._busy.acquire(blocking=False):
            raise RequestError("generate() was called while another generate() is running on this LLM")
        try:
            self._check_open()
            if self.engine.has_unfinished():
                raise RequestError("this LLM's engine holds requests added through llm.engine: step them to the "
                                   "end or abort them before generate()")
            return self._run(prompts, params, use_tqdm)
        finally:
            self._busy.release()

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        engine.reset_metrics()
        index = self._add_all(prompts, params)
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = _progress(len(prompts), use_tqdm)
        try:
            while engine.has_unfinished():
                self._check_open()
                for output in engine.step().finished:
                    results[index[output.request_id]] = output
                    if bar is not None:
                        bar.update(1)
        except BaseException:                  # interrupted: leave the engine empty and reusable
            if not engine.closed:
                engine.abort_all(index)
            raise
        finally:
            if bar is not None:
                bar.close()
        self._metrics = engine.metrics()
        return results

    def _check_open(self) -> None:
        if self._closing:
            raise KvlabError("this LLM is closed (close() was called): build a new LLM to generate again")

    def _add_all(self, prompts: list, params: list[SamplingParams]) -> dict[str, int]:
        """Add every request, or none: on any error the added ones are aborted and the engine is left empty; a
        RequestError names the prompt."""
        index: dict[str, int] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                index[self.engine.add_request(prompt, p)] = i
        except BaseException as exc:
            self.engine.abort_all(index)
            if isinstance(exc, RequestError):
                raise RequestError(f"prompt {len(index)}: {exc}") from None
            raise
        return index

    def cache_stats(self) -> CacheStats:
        return self.engine.cache_stats()

    def metrics(self) -> RunMetrics:
        """Metrics of the last generate() call."""
        if self._metrics is None:
            raise RequestError("no metrics yet: call generate() first")
        return self._metrics

    def close(self) -> None:
        """Release the KV cache. A generate() running in another thread stops at its next step (it raises
        KvlabError); close() waits for that, then releases. Closing twice is harmless."""
        self._closing = True
        with self._busy:
            self._release()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_prompt_list(prompts: Any) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]            # one prompt given as token ids
    if not isinstance(prompts, (list, tuple)):
        raise RequestError(f"prompts must be a string, a list of token ids or a list of those, "
                           f"got {type(prompts).__name__}")
    if not prompts:
        raise RequestError("the prompt list is empty: give at least one prompt")
    return list(prompts)


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise RequestError(f"sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
                           f"got {shown(params)}")
    params = list(params)
    if len(params) != n:
        raise RequestError(f"got {len(params)} SamplingParams for {n} prompts: give one, or one per prompt")
    return params


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc="generate", unit="req")
