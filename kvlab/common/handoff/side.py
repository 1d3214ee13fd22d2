"""An engine's part in prefill/decode disaggregation (`EngineConfig.kv_role`), kept out of the engine loop:

- prefill: requests with `{"do_remote_decode": true}` sample one token and finish; their sequence is kept
  (the scheduler holds its KV) until a decode engine pulls it through this engine's server, or it expires;
- decode: requests bringing the prefill engine's `kv_transfer_params` start with their first token appended and
  their KV imported at admission, like a prefix hit covering the whole prompt;
- colocated: nothing.
Every method runs on the engine's thread under its lock; the server thread only claims, exports and posts outcomes.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import ConfigError, HandoffError, RequestError
from kvlab.common.handoff import client
from kvlab.common.handoff.book import HandoffStats, KeptBook
from kvlab.common.handoff.params import check_decode, check_sampling, first_logprob, prefill_params, prompt_hash
from kvlab.common.handoff.seam import HandoffReport, load_handoff
from kvlab.common.handoff.server import HandoffServer
from kvlab.common.handoff.wire import PREFIX

if TYPE_CHECKING:
    import threading

    from kvlab.common.kv.seam import KVCache
    from kvlab.common.outputs import RequestOutput
    from kvlab.common.request import Request
    from kvlab.common.sampling_params import SamplingParams
    from kvlab.common.sched.scheduler import Scheduler
    from kvlab.common.sequence import Sequence

IO_TIMEOUT_S = 10.0            # any one socket operation of the prefill side's server
PULL_DEADLINE_S = 5.0          # a pull's whole exchange up to the KV header: what a silent peer costs the engine


@dataclass(slots=True)
class PendingImport:
    """A decode request's pending import: its first token (and that token's logprob and top candidates, as the
    prefill engine computed them), and the pull admission calls (`Request.kv_import`)."""
    first_token: int
    kv: dict[str, Any]
    role: HandoffRole
    first_logprob: float = 0.0
    first_top: tuple = ()

    def __call__(self, req: Request, seq: Sequence, reserve_units: int) -> int | None:
        return self.role.pull(req, seq, self.kv, reserve_units)


class HandoffRole:
    def __init__(self, config: Any, cache: KVCache, scheduler: Scheduler, lock: threading.RLock,
                 vocab_size: int | None) -> None:
        self.role, self.config, self.cache, self.scheduler = config.kv_role, config, cache, scheduler
        self.vocab_size, self.lock, self.closed = vocab_size, lock, False
        self.stats = HandoffStats()             # stats.to_dict(): the totals since the engine started
        self.backend = self.book = self.server = None
        if self.role == "colocated":
            return
        if cache.accounting_only or config.tensor_parallel_size > 1:
            raise ConfigError(f"kv_role {self.role} needs one process holding real KV memory "
                              "(no tensor parallelism, no accounting-only cache)")
        self.backend = load_handoff(cache, config)
        self.timeout_s = min(IO_TIMEOUT_S, config.handoff_timeout_s)
        self.pull_deadline_s = min(PULL_DEADLINE_S, config.handoff_timeout_s)
        if self.role == "prefill":
            self.book = KeptBook(config.handoff_timeout_s)
            self.server = HandoffServer(self.book, self.backend, lock, self.timeout_s)

    @property
    def address(self) -> str | None:
        """Where this prefill engine serves pulls (None on other roles)."""
        return self.server.address if self.server is not None else None

    # -- a request arrives ----------------------------------------------------------------------------------
    def intake(self, params: SamplingParams, kv: Any, prompt_len: int
               ) -> tuple[SamplingParams, bool, PendingImport | None]:
        """The request's sampling params (a prefill request samples one token), whether its KV is kept when it
        finishes (prefill), and its import (decode). Raises RequestError for kv_transfer_params this engine
        cannot use."""
        if kv is None:
            return params, False, None
        if self.role == "colocated":
            raise RequestError("kv_transfer_params needs an engine with kv_role prefill or decode; this one is "
                               "colocated")
        if self.role == "prefill":
            return prefill_params(params, kv), True, None
        check_decode(kv, prompt_len, self.config, self.vocab_size, self.backend)
        check_sampling(params, "decode")
        logprob, top = first_logprob(kv, params, self.vocab_size)
        return params, False, PendingImport(kv["first_token_ids"][0], dict(kv), self, logprob, top)

    def release_unpulled(self, req: Request | None) -> None:
        """A decode request that ended before its import (its first token stopped it, it could never fit, it was
        aborted) needs no KV: the prefill engine frees it now rather than at its timeout."""
        if req is not None and req.finished and req.kv_import is not None:
            client.decline(req.kv_import.kv, self.timeout_s)

    def decline_refused(self, kv: Any) -> None:
        """A decode request refused before it was queued (a field that does not match, a prompt this engine
        cannot take) never pulls: its prefill engine frees the KV now rather than at its timeout. Only a
        well-formed kvlab handoff address is contacted."""
        if self.role == "decode" and isinstance(kv, dict) and isinstance(kv.get("handoff_id"), str) \
                and isinstance(kv.get("address"), str) and kv["address"].startswith(PREFIX):
            client.decline(kv, self.timeout_s)

    # -- decode: the pull, from admission --------------------------------------------------------------------
    def pull(self, req: Request, seq: Sequence, kv: dict[str, Any], reserve_units: int) -> int | None:
        """Import the KV into seq's first allocation; None (nothing asked of the prefill side) if there is no
        room yet. Raises HandoffError: the request fails alone."""
        allocator, tokens = self.cache.allocator, kv["num_tokens"]
        if allocator.units_needed(seq, tokens + 1) + reserve_units > allocator.num_free_units():
            return None
        try:
            report = client.pull(kv, self.backend, seq, self.pull_deadline_s)
        except Exception as exc:      # noqa: BLE001 - client.pull raises HandoffError; the backend may raise more
            self.stats.failed += 1
            if isinstance(exc, HandoffError):
                raise
            raise HandoffError(str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__) from None
        req.handoff = report.to_dict()
        self.stats.add(report)
        return tokens

    # -- prefill: keep, then release --------------------------------------------------------------------------
    def finished(self, req: Request, output: RequestOutput) -> None:
        """Fill the output's kv_transfer_params (prefill, KV kept) and handoff fields."""
        output.handoff = req.handoff
        seq = req.seqs[0] if req.keep_kv else None
        if seq is None or not self.scheduler.is_kept(seq):
            return
        handoff_id = uuid.uuid4().hex
        self.book.add(handoff_id, seq, seq.prompt_len)
        output.handoff = HandoffReport(0.0, 0, 0, self.backend.unit).to_dict()   # moved at the pull, not here
        output.kv_transfer_params = {
            "do_remote_prefill": True, "handoff_id": handoff_id, "address": self.address,
            "num_tokens": seq.prompt_len, "prompt_hash": prompt_hash(seq.token_ids[:seq.prompt_len]),
            "first_token_ids": seq.output_token_ids[:1], "first_token_logprob": _first_logprob(seq),
            "backend": self.config.backend, **self.backend.params(), "model": self.config.model}

    def poll(self) -> None:
        """Release the KV whose pull ended (taken, refused, or the peer gone) and the KV nobody pulled in time."""
        if self.book is None:
            return
        for kept, outcome in self.book.settled():
            seconds = self._release(kept.seq, outcome.taken)
            if outcome.taken:
                outcome.report.seconds += seconds          # this side's part: the export, then the release
                self.stats.add(outcome.report)
            else:
                self.stats.failed += 1
        for kept in self.book.expired():
            self._release(kept.seq, False)
            self.stats.expired += 1

    def _release(self, seq: Sequence, taken: bool | None) -> float:
        """Free a kept sequence through the backend; the seconds it took."""
        start = time.perf_counter()
        try:
            self.backend.release(seq, taken)
        finally:
            self.scheduler.release_kept(seq)
        return time.perf_counter() - start

    def poll_idle(self) -> None:
        """`poll` for a serving loop with nothing to step (a prefill engine's kept KV is no unfinished work): it
        takes the engine's lock, and does nothing once the engine is closed. step() polls by itself."""
        with self.lock:
            if not self.closed:
                self.poll()

    def close(self) -> None:
        """Stop serving; what is still kept goes with the cache."""
        self.closed = True
        if self.server is not None:
            self.server.close()
            for kept in self.book.drain():
                self.scheduler.release_kept(kept.seq)


def _first_logprob(seq: Sequence) -> list:
    """[logprob, [[token id, logprob], ...]] of the one token a prefill request sampled: the decode engine
    reports them as this token's (the top list is empty unless the request asked logprobs)."""
    top = seq.logprobs[0][1] if seq.logprobs else ()
    return [seq.cumulative_logprob, [[tid, lp] for tid, lp in top]]
