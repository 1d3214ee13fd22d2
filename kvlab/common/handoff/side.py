"""An engine's part in prefill/decode disaggregation (`EngineConfig.kv_role`), kept out of the engine loop:

- prefill: requests with `{"do_remote_decode": true}` sample one token and finish; their sequence is kept
  (the scheduler holds its KV) until a decode engine pulls it through this engine's server, or it expires;
- decode: requests bringing the prefill engine's `kv_transfer_params` start with their first token appended and
  their KV imported at admission, like a prefix hit covering the whole prompt; the pull's network part runs on a
  worker (common/handoff/puller.py), and admission passes the request over until its answer is there;
- colocated: nothing.
Every method runs on the engine's thread under its lock; the server thread only claims, exports and posts outcomes.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvlab.common.errors import ConfigError, HandoffError, RequestError
from kvlab.common.handoff.book import HandoffStats, KeptBook
from kvlab.common.handoff.params import check_decode, check_sampling, first_logprob, prefill_params, prompt_hash
from kvlab.common.handoff.puller import Puller
from kvlab.common.handoff.seam import HandoffReport, load_handoff
from kvlab.common.handoff.server import HandoffServer
from kvlab.common.handoff.wire import PREFIX
from kvlab.common.request import PULL_QUEUED, PULLING
from kvlab.common.validate import shown

if TYPE_CHECKING:
    import threading

    from kvlab.common.handoff.puller import Ticket
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.outputs import RequestOutput
    from kvlab.common.request import Request
    from kvlab.common.sampling_params import SamplingParams
    from kvlab.common.sched.scheduler import Scheduler
    from kvlab.common.sequence import Sequence

IO_TIMEOUT_S = 10.0            # any one socket operation of the prefill side's server
PULL_DEADLINE_S = 5.0          # a pull's whole exchange up to the KV header: what a silent peer costs a worker
# An answer is imported within this share of the prefill side's ack wait, or not at all: once that side stops
# waiting it releases what it exported (vmm: pages it may reuse), so a later import could take pages it gave to
# another sequence. Half leaves room for the import itself and for the answer's time in transit.
FRESH_SHARE = 0.5


@dataclass(slots=True)
class PendingImport:
    """A decode request's pending import: its first token (and that token's logprob and top candidates, as the
    prefill engine computed them), and the pull admission calls (`Request.kv_import`)."""
    first_token: int
    kv: dict[str, Any]
    role: HandoffRole
    first_logprob: float = 0.0
    first_top: tuple = ()
    ticket: Ticket | None = None          # the pull on its way (a worker's)

    def __call__(self, req: Request, seq: Sequence, reserve_units: int) -> int | None:
        return self.role.pull(req, seq, self, reserve_units)


class HandoffRole:
    def __init__(self, config: Any, cache: KVCache, scheduler: Scheduler, lock: threading.RLock,
                 vocab_size: int | None) -> None:
        self.role, self.config, self.cache, self.scheduler = config.kv_role, config, cache, scheduler
        self.vocab_size, self.lock, self.closed = vocab_size, lock, False
        self.stats = HandoffStats()             # stats.to_dict(): the totals since the engine started
        self.backend = self.book = self.server = self.puller = None
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
            self.server = HandoffServer(self.book, self.backend, lock, self.timeout_s, config.handoff_name)
        else:
            self.puller = Puller(self.pull_deadline_s, self.pull_deadline_s)

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
        self._check_peer(kv["address"])
        check_sampling(params, "decode")
        logprob, top = first_logprob(kv, params, self.vocab_size)
        return params, False, PendingImport(kv["first_token_ids"][0], dict(kv), self, logprob, top)

    def release_unpulled(self, req: Request | None) -> None:
        """A decode request that ended before its import (its first token stopped it, it could never fit, it was
        aborted) needs no KV: a pull on its way is cut short (the prefill side sees the connection close), else
        the prefill engine is told to free it now rather than at its timeout."""
        if req is None or not req.finished or req.kv_import is None:
            return
        if req.kv_import.ticket is not None:
            self._forget(req.kv_import)
        else:
            self.puller.decline(req.kv_import.kv)

    def decline_refused(self, kv: Any) -> None:
        """A decode request refused before it was queued (a field that does not match, a prompt this engine
        cannot take) never pulls: its prefill engine frees the KV now rather than at its timeout. Only a
        well-formed kvlab handoff address is contacted."""
        if self.role == "decode" and isinstance(kv, dict) and isinstance(kv.get("handoff_id"), str) \
                and isinstance(kv.get("address"), str) and kv["address"].startswith(PREFIX) \
                and self._is_peer(kv["address"]):
            self.puller.decline(kv)

    def _is_peer(self, address: str) -> bool:
        """Whether this decode engine may contact `address`: any (of this user's engines: the pull checks the
        answering uid) unless handoff_peers lists the prefill engines it pulls from."""
        peers = self.config.handoff_peers
        return not peers or address in {PREFIX + name for name in peers}

    def _check_peer(self, address: str) -> None:
        if not self._is_peer(address):
            raise RequestError(f"kv_transfer_params name {shown(address)}, not a prefill engine this decode "
                               f"engine pulls from (handoff_peers: {', '.join(self.config.handoff_peers)}): "
                               "refused, nothing contacted")

    # -- decode: the pull, from admission --------------------------------------------------------------------
    def pull(self, req: Request, seq: Sequence, pending: PendingImport, reserve_units: int) -> int | None:
        """The prompt's tokens once its KV is imported into seq's first allocation; PULLING while the prefill
        engine's answer is on its way (PULL_QUEUED: waiting for a worker); None while there is no room (a pull
        starts only when there is). Raises HandoffError: the request fails alone."""
        if pending.ticket is None:
            return self._start(seq, pending, reserve_units)
        try:
            fetched = pending.ticket.result()
            if fetched is None:
                return PULLING
            room = self._room(seq, pending.kv["num_tokens"], reserve_units)
            if fetched.fresh(FRESH_SHARE):
                if not room:
                    return None
            elif not room or self.backend.import_within_ack:
                raise HandoffError("the KV arrived but could not be imported while the prefill engine still "
                                   "waited for the ack (no room for it in time): nothing taken")
            report = fetched.take(self.backend, seq)
        except HandoffError:
            self.stats.failed += 1
            self._forget(pending)
            raise
        self._forget(pending)
        req.handoff = report.to_dict()
        self.stats.add(report)
        return pending.kv["num_tokens"]

    def _start(self, seq: Sequence, pending: PendingImport, reserve_units: int) -> int | None:
        """Start the pull on a worker when there is room for the KV and a free worker."""
        kv = pending.kv
        if not self._room(seq, kv["num_tokens"], reserve_units):
            return None
        if not self.puller.can_start():
            return PULL_QUEUED
        digest = prompt_hash(seq.token_ids[:kv["num_tokens"]])
        if kv.get("prompt_hash", digest) != digest:
            self.stats.failed += 1
            raise HandoffError("kv_transfer_params belong to another prompt (prompt_hash differs): send the prompt "
                               "the prefill engine computed")
        pending.ticket = self.puller.start(kv, self.backend.describe(), digest, self.timeout_s)
        return PULLING

    def _room(self, seq: Sequence, tokens: int, reserve_units: int) -> bool:
        allocator = self.cache.allocator
        return allocator.units_needed(seq, tokens + 1) + reserve_units <= allocator.num_free_units()

    def _forget(self, pending: PendingImport) -> None:
        self.puller.forget(pending.ticket)
        pending.ticket = None

    def pulling(self) -> bool:
        """Whether a pull is on its way (started, its answer not yet imported or dropped)."""
        return self.puller is not None and bool(self.puller.live)

    def wait_for_pull(self, timeout_s: float) -> None:
        """For a step that found nothing to run but pulls on their way: wait (without the engine's lock) until one
        ends, at most `timeout_s`."""
        if self.pulling():
            self.puller.wait(timeout_s)

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
        if self.puller is not None:
            self.puller.close()
        if self.server is not None:
            self.server.close()
            for kept in self.book.drain():
                self.scheduler.release_kept(kept.seq)


def _first_logprob(seq: Sequence) -> list:
    """[logprob, [[token id, logprob], ...]] of the one token a prefill request sampled: the decode engine
    reports them as this token's (the top list is empty unless the request asked logprobs)."""
    top = seq.logprobs[0][1] if seq.logprobs else ()
    return [seq.cumulative_logprob, [[tid, lp] for tid, lp in top]]
