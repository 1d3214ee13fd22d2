"""Benchmark (not a test): the CPU the serving engine loop adds to the engine's own steps. The same requests, all
admitted at once, run through EngineLoop (each turn's EventBatch pickled and sent over a socket pair, as in the
engine process; a reader thread drains the other end) and through a bare `while has_unfinished(): step()` on the
same engine, alternating; each side's CPU is its thread's time, so the reader's unpickling is not counted.

    python -m kvlab.experiments.bench.engine_loop_overhead [--backend vmm] [--repeats 6] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from kvlab.common.config import make_config
from kvlab.common.sampling_params import SamplingParams
from kvlab.experiments.bench.serving_overhead import workload
from kvlab.experiments.serve.engine_loop import EngineLoop
from kvlab.experiments.serve.events import AddCommand, EventBatch, FinishedEvent
from kvlab.experiments.serve.handles import build_engine


class KeptEngineLoop(EngineLoop):
    """Ends once `count` requests have finished, and leaves the engine open for the next repeat."""

    def __init__(self, engine: Any, metrics: Any, conn: Connection, count: int) -> None:
        super().__init__(engine, metrics, self._send)
        self.conn, self.left, self.cpu_s = conn, count, 0.0

    def _send(self, batch: EventBatch) -> None:
        self.conn.send(batch)
        self.left -= sum(type(e) is FinishedEvent for e in batch.events)
        if self.left == 0:
            self.stopping.set()

    def _shutdown(self) -> None:
        pass


def drain(conn: Connection) -> None:
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass


def measure(backend: str = "vmm", repeats: int = 6, threads: int = 1, reqs: list | None = None) -> dict[str, Any]:
    """`reqs`: LoadRequests with token-id prompts (default serving_overhead's 64 x 64 workload)."""
    engine, metrics = build_engine(make_config(model="tiny", backend=backend, threads=threads))
    reqs = workload() if reqs is None else reqs
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in reqs]
    ours, theirs = socket.socketpair()
    send, recv = Connection(ours.detach()), Connection(theirs.detach())
    reader = threading.Thread(target=drain, args=(recv,), daemon=True)
    reader.start()

    def bare(tag: str) -> float:
        t0 = time.thread_time()
        for i, (r, p) in enumerate(zip(reqs, params)):
            engine.add_request(r.prompt, p, request_id=f"{tag}-{i}")
        while engine.has_unfinished():
            engine.step()
        return time.thread_time() - t0

    def looped(tag: str) -> float:
        loop = KeptEngineLoop(engine, metrics, send, len(reqs))
        for i, (r, p) in enumerate(zip(reqs, params)):
            loop.inbox.put(AddCommand(f"{tag}-{i}", r.prompt, p))
        t0 = time.thread_time()
        loop.run()
        return time.thread_time() - t0

    try:
        bare("warm-b"), looped("warm-l")
        pairs = [(bare(f"b{k}"), looped(f"l{k}")) if k % 2 == 0 else tuple(reversed((looped(f"l{k}"), bare(f"b{k}"))))
                 for k in range(repeats)]
    finally:
        send.close()
        engine.close()
    extra = [loop_s / bare_s - 1 for bare_s, loop_s in pairs]
    return {"backend": backend, "repeats": repeats, "bare_cpu_s": [b for b, _ in pairs],
            "loop_cpu_s": [lp for _, lp in pairs], "loop_extra_cpu_share_per_repeat": extra,
            "loop_extra_cpu_share": statistics.median(extra)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="vmm")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    print(json.dumps(measure(a.backend, a.repeats, a.threads), indent=1))


if __name__ == "__main__":
    main()
