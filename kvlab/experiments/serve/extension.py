"""The `kvlab` field of a kvlab server's response (and of the simulator's records): what KV memory cost one
request. docs/serving.md, "Per-request memory attribution", defines each field."""
from __future__ import annotations

from typing import Any


def kvlab_extension(m: Any, handoff: dict[str, Any] | None = None) -> dict[str, Any]:
    """`m`: the request's RequestMetrics (engine clock, seconds); `handoff`: its KV handoff between a prefill and
    a decode engine ({"seconds", "bytes_copied", "units_moved", "unit"}; None when it had none)."""
    return {"num_preemptions": m.num_preemptions, "engine_ttft_s": m.ttft, "kv_wait_s": m.kv_wait_s,
            "recomputed_tokens": m.recomputed_tokens, "map_unmap_s": m.map_unmap_s, "handoff": handoff}
