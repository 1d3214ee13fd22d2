"""Issue 37's measure: a plain request's latency on a decode engine while a forged pull to a silent peer is pending
(median of `runs`). Run: PYTHONPATH=.:tests python tests/helpers/pull_latency.py [runs]"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kvlab.common.config import make_config
from kvlab.common.engine import Engine
from kvlab.common.sampling_params import SamplingParams

FAKE = Path(__file__).resolve().parent / "fake_prefill.py"
PROMPT = [1 + 3 * j % 200 for j in range(21)]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def silent_peer(folder: str) -> tuple[subprocess.Popen, str]:
    address = f"kvlab-handoff-measure-{uuid.uuid4().hex[:16]}"
    answer = Path(folder) / "answer"
    answer.write_bytes(b"{}")
    proc = subprocess.Popen([sys.executable, str(FAKE), address, "silent", str(answer), "0", "1", "1"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc, address


def once(engine: Engine, address: str | None) -> float:
    """Seconds until the plain request finished (with a forged pull to `address` pending, unless None)."""
    kv = {"do_remote_prefill": True, "handoff_id": uuid.uuid4().hex[:8], "address": address,
          "num_tokens": len(PROMPT), "first_token_ids": [5], "backend": "paged"}
    start = time.monotonic()
    if address is not None:
        engine.add_request(PROMPT, GREEDY, request_id="forged", kv_transfer_params=kv)
    engine.add_request(PROMPT, GREEDY, request_id="plain")
    plain = None
    while plain is None:
        for out in engine.step().finished:
            if out.request_id == "plain":
                plain = time.monotonic() - start
    engine.abort("forged")
    while engine.has_unfinished():
        engine.step()
    return plain


def main(runs: int) -> None:
    engine = Engine.from_config(make_config(model="tiny", backend="paged", max_model_len=256, kv_cache_bytes=8 << 20,
                                            max_num_seqs=4, kv_role="decode"))
    with tempfile.TemporaryDirectory() as folder:
        proc, address = silent_peer(folder)
        try:
            once(engine, None)                                 # warm up
            alone = [once(engine, None) for _ in range(runs)]
            times = [once(engine, address) for _ in range(runs)]
        finally:
            proc.kill()
            engine.close()
    for label, values in (("alone", alone), ("with a forged pull to a silent peer pending", times)):
        print(f"plain request latency, {label}: median {statistics.median(values):.3f} s over {runs} runs "
              f"({', '.join(f'{t:.3f}' for t in values)})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
