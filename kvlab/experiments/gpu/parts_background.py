"""The GPU check's background_map part: does mapping pages on a background thread (vAttention's step_async) slow
the decode step it overlaps? One decode step = every layer's attention call (kvlab's Triton kernel on the
contiguous layout, experiments/gpu/kernel_cases.py), launched eagerly as an engine without CUDA graphs does.
Steps are timed alone, then while a thread maps 2 MiB pages as fast as it can (cuMemMap + cuMemSetAccess per
page over a pool, then cuCtxSynchronize and cuMemUnmap of the pool, again), then alone again to bracket drift.
Per step: host wall time to completion and GPU time between events. The thread's call counts and per-call
latency under load are kept. The thread holds the GIL only between driver calls (cuda.bindings releases it in
them), as a Python engine's mapper would. CPU dry run: the fake driver, the interpreter, tiny steps."""
from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from kvlab.experiments.gpu.driver import Driver
from kvlab.experiments.gpu.kernel_cases import LLAMA3_8B_BF16, TINY_FP32, contiguous_call, make_inputs
from kvlab.experiments.gpu.timing import ns_call, one_call_seconds, timed_call

GPU = {"shape": LLAMA3_8B_BF16, "layers": 32, "batch": 32, "context": 4096, "steps": 40, "pool_pages": 256}
DRY = {"shape": TINY_FP32, "layers": 1, "batch": 2, "context": 32, "steps": 2, "pool_pages": 4}


class BackgroundMapper:
    """A thread that maps, grants access to and unmaps a pool of pages until stopped, counting its calls."""

    def __init__(self, d: Driver, pages: int) -> None:
        self.d, self.page = d, d.granularity("MINIMUM")
        self.handles = [d.call("cuMemCreate", self.page, d.prop, 0) for _ in range(pages)]
        self.base = d.reserve(pages * self.page)
        self.stop = threading.Event()
        self.map_s: list[float] = []
        self.unmap_s: list[float] = []
        self.error = ""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        d = self.d
        try:
            d.call("cuCtxSetCurrent", d.ctx)        # a fresh thread has no current context
            while not self.stop.is_set():
                for i, h in enumerate(self.handles):
                    ptr = self.base + i * self.page
                    self.map_s.append(ns_call(lambda p=ptr, h=h: d.map(p, self.page, h))[1])
                d.call("cuCtxSynchronize")
                for i in range(len(self.handles)):
                    self.unmap_s.append(ns_call(lambda i=i: d.call("cuMemUnmap", self.base + i * self.page,
                                                                   self.page))[1])
        except Exception as exc:  # noqa: BLE001 - reported in the result
            self.error = f"{type(exc).__name__}: {exc}"

    def __enter__(self) -> BackgroundMapper:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()

    def close(self) -> None:
        for h in self.handles:
            self.d.call("cuMemRelease", h)
        self.d.call("cuMemAddressFree", self.base, len(self.handles) * self.page)

    def stats(self, seconds: float) -> dict[str, Any]:
        out = {"pages_mapped": len(self.map_s), "pages_unmapped": len(self.unmap_s),
               "maps_per_s": len(self.map_s) / seconds if seconds else 0.0}
        if self.map_s:
            out["map_and_set_access_us_median"] = statistics.median(self.map_s) * 1e6
        if self.unmap_s:
            out["unmap_us_median"] = statistics.median(self.unmap_s) * 1e6
        return {**out, **({"thread_error": self.error} if self.error else {})}


def part_background_map(dry: bool) -> dict[str, Any]:
    from kvlab.experiments.gpu.parts_triton import check_interpreter_setting
    check_interpreter_setting(dry)
    cfg, device = (DRY, "cpu") if dry else (GPU, "cuda")
    x = make_inputs(cfg["shape"], cfg["batch"], cfg["context"], 1, device, cfg["context"])
    layer = contiguous_call(x, cfg["context"])
    step = lambda: [layer() for _ in range(cfg["layers"])]  # noqa: E731
    step()                                                  # compile
    d = Driver(dry)
    mapper = BackgroundMapper(d, cfg["pool_pages"])
    try:
        alone = steps(device, step, cfg["steps"])
        t0 = time.perf_counter()
        with mapper:
            busy = steps(device, step, cfg["steps"])
        window = time.perf_counter() - t0
        after = steps(device, step, cfg["steps"])
    finally:
        d.call("cuCtxSynchronize")
        mapper.close()
        d.close()
    out = {"device": device, "layers": cfg["layers"], "batch": cfg["batch"], "context": cfg["context"],
           "steps_each": cfg["steps"], "alone": alone, "while_mapping": busy, "alone_after": after,
           "mapper": mapper.stats(window),
           "wall_ratio_while_mapping": busy["wall_ms_median"] / statistics.mean(
               [alone["wall_ms_median"], after["wall_ms_median"]])}
    if dry:
        out["fake_leaks"] = {k: str(v) for k, v in d.drv.leaks().items()}
    if mapper.error:
        out["failed"] = f"the mapping thread failed: {mapper.error}"
    return out


def steps(device: str, step: Any, n: int) -> dict[str, float]:
    """Median and p90 of n steps: host wall time to completion, and on a GPU the time between events."""
    out = quantiles("wall", [timed_call(step, device) for _ in range(n)])
    if device == "cuda":
        out.update(quantiles("gpu", [one_call_seconds(device, step) for _ in range(n)]))
    return out


def quantiles(label: str, seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {f"{label}_ms_median": statistics.median(ordered) * 1e3,
            f"{label}_ms_p90": ordered[int(0.9 * (len(ordered) - 1))] * 1e3}
