"""The GPU check's parts that talk to the CUDA driver directly (experiments/gpu/driver.py): the environment,
a view over unmapped memory, a map/remap round trip, per-call latency, and the deliberate unmapped-page fault.
Each takes `dry` (the CPU dry run: the recording fake) and returns its JSON result ("failed" marks a failure)."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import subprocess
import threading
from typing import Any

from kvlab.experiments.gpu.driver import ArrayInterface, Driver, DriverCallError, MiB, host_bytes, mem_free, to_device
from kvlab.experiments.gpu.timing import per_call_latency

METADATA_ONLY = ("pytest", "transformers", "flash-attn", "flashinfer-python")   # versions without importing


def part_environment(dry: bool) -> dict[str, Any]:
    """Versions (imported where an ABI mismatch would show), the driver and its granularities, the device."""
    import numpy
    import torch
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "numpy": numpy.__version__,
                           "cuda_available": torch.cuda.is_available(),
                           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), **imported_versions()}
    out.update(driver_facts(dry))
    if not dry and not torch.cuda.is_available():
        out["failed"] = "a GPU is present but torch.cuda.is_available() is False: a CPU build of torch?"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, capability=list(torch.cuda.get_device_capability(0)),
                   total_memory_gib=round(props.total_memory / 2**30, 1), nvidia_smi=nvidia_smi())
    return out


def imported_versions() -> dict[str, str]:
    out = {}
    for name in ("triton", "cuda.bindings"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "installed")
        except ImportError as exc:
            out[name] = f"not importable: {exc}"
    for dist in METADATA_ONLY:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def driver_facts(dry: bool) -> dict[str, Any]:
    """The driver version and the MINIMUM and RECOMMENDED granularity (or why they could not be read)."""
    try:
        d = Driver(dry)
    except (ImportError, DriverCallError) as exc:
        return {"driver": f"unavailable: {type(exc).__name__}: {exc}"}
    try:
        return {"driver": "recording fake" if dry else d.call("cuDriverGetVersion"),
                "minimum_granularity": d.granularity("MINIMUM"),
                "recommended_granularity": d.granularity("RECOMMENDED")}
    finally:
        d.close()


def nvidia_smi() -> str:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"
    return smi.stdout.strip() or smi.stderr.strip()


def part_unmapped_view(dry: bool) -> dict[str, Any]:
    """torch asked to wrap a reserved address with nothing mapped behind it, two ways."""
    d = Driver(dry)
    size = 2 * d.granularity("MINIMUM")
    base = d.reserve(size)
    out: dict[str, Any] = {"reserved_bytes": size}
    try:
        if dry:
            return {**out, "ran": False, "note": "needs a GPU: a CPU torch cannot wrap a device address"}
        import torch
        ways = {"as_tensor_no_device": lambda: torch.as_tensor(ArrayInterface(base, size)),
                "as_tensor_cuda_0": lambda: torch.as_tensor(ArrayInterface(base, size), device="cuda:0")}
        for name, make in ways.items():
            out[name] = try_view(make, base)
        torch.cuda.synchronize()
        return out
    finally:
        d.call("cuMemAddressFree", base, size)
        d.close()


def try_view(make: Any, base: int) -> dict[str, Any]:
    try:
        view = make()
        return {"created": True, "data_ptr_equals_base": view.data_ptr() == base}
    except Exception as exc:  # noqa: BLE001 - the outcome is the measurement
        return {"created": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}


def part_vmm_round_trip(dry: bool) -> dict[str, Any]:
    """Map, write, unmap, remap the same handle at a new address, read back (driver memcpy, no torch); a map
    from a worker thread; mem_get_info deltas; the first bytes of a fresh and of a reused page."""
    d = Driver(dry)
    page = d.granularity("RECOMMENDED")
    free = {"start": mem_free(dry)}
    a, b = d.reserve(page), d.reserve(page)
    handle = d.call("cuMemCreate", page, d.prop, 0)
    free["after_create"] = mem_free(dry)
    d.map(a, page, handle)
    free["after_map"] = mem_free(dry)
    out: dict[str, Any] = {"page_bytes": page}
    pattern = bytes(i % 251 for i in range(page))
    if dry:
        out["data"] = "not checked: the fake driver has no memory"
    else:
        fresh = host_bytes(d, a, page)
        out["fresh_page_first_bytes"] = fresh[:32].hex()
        out["fresh_page_all_zero"] = not any(fresh)
        to_device(d, a, pattern)
    d.call("cuCtxSynchronize")
    d.call("cuMemUnmap", a, page)
    free["after_unmap"] = mem_free(dry)
    d.map(b, page, handle)                                   # the same handle at a new address
    if not dry:
        out["remapped_reads_back"] = host_bytes(d, b, page) == pattern
    out["worker_thread"] = worker_thread_map(d, page)
    d.call("cuCtxSynchronize")
    d.call("cuMemUnmap", b, page)
    d.call("cuMemRelease", handle)
    free["after_release"] = mem_free(dry)
    out["reused_memory"] = reused_page(d, a, page, pattern)
    for ptr in (a, b):
        d.call("cuMemAddressFree", ptr, page)
    d.close()
    return {**out, **round_trip_verdict(d, dry, out, free)}


def round_trip_verdict(d: Driver, dry: bool, out: dict[str, Any], free: dict[str, int | None]) -> dict[str, Any]:
    if dry:
        return {"fake_leaks": {k: str(v) for k, v in d.drv.leaks().items()}}
    verdict: dict[str, Any] = {"mem_get_info_delta_mib": {k: (free["start"] - v) / MiB for k, v in free.items()
                                                          if k != "start"}}
    if not out["remapped_reads_back"]:
        verdict["failed"] = "the remapped handle did not read back what was written through the first address"
    return verdict


def worker_thread_map(d: Driver, page: int) -> dict[str, str]:
    """cuMemMap from a fresh thread: first with no context current on it, then with the primary context; what
    either attempt acquired is given back at the end, with the context current."""
    out: dict[str, str] = {}
    held: dict[str, list] = {"cuMemUnmap": [], "cuMemRelease": [], "cuMemAddressFree": []}

    def body() -> None:
        for label, set_ctx in (("without_context", False), ("with_primary_context", True)):
            try:
                if set_ctx:
                    d.call("cuCtxSetCurrent", d.ctx)
                ptr = d.reserve(page)
                held["cuMemAddressFree"].append((ptr, page))
                handle = d.call("cuMemCreate", page, d.prop, 0)
                held["cuMemRelease"].append((handle,))
                d.call("cuMemMap", ptr, page, 0, handle, 0)
                held["cuMemUnmap"].append((ptr, page))
                d.call("cuMemSetAccess", ptr, page, d.access, 1)
                d.call("cuCtxSynchronize")
                out[label] = "ok"
            except DriverCallError as exc:
                out[label] = exc.result
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    for name, calls in held.items():          # unmap, then release, then free the addresses
        for args in calls:
            d.call(name, *args)
    return out


def reused_page(d: Driver, ptr: int, page: int, pattern: bytes) -> dict[str, Any]:
    """After the patterned page was released: does a new cuMemCreate show its old bytes (not zeroed)?"""
    handle = d.call("cuMemCreate", page, d.prop, 0)
    d.map(ptr, page, handle)
    out: dict[str, Any] = {}
    if not d.dry:
        seen = host_bytes(d, ptr, page)
        out = {"first_bytes": seen[:32].hex(), "all_zero": not any(seen), "shows_old_pattern": seen == pattern}
    d.call("cuCtxSynchronize")
    d.call("cuMemUnmap", ptr, page)
    d.call("cuMemRelease", handle)
    return out


def part_vmm_latency(dry: bool) -> dict[str, Any]:
    """Median and p90 per-call latency of create, map, set-access, unmap, release over pages of the
    RECOMMENDED granularity, with mem_get_info around them."""
    d = Driver(dry)
    try:
        latency = per_call_latency(d.call, d.prop, d.access, d.granularity("RECOMMENDED"), 16 if dry else 100,
                                   lambda: mem_free(dry))
    finally:
        d.close()
    return {"driver": "recording fake" if dry else "cuda.bindings.driver", **latency}


def part_unmapped_access(dry: bool) -> dict[str, Any]:
    """Last, alone: a driver copy from, then a kernel read of, a reserved page with nothing mapped (the
    kernel read is expected to fault, stickily: why the cache maps every page a kernel may touch first)."""
    if dry:
        return {"ran": False, "note": "needs a GPU: a CPU cannot take a CUDA page fault"}
    import torch
    d = Driver(dry)
    page = d.granularity("MINIMUM")
    base = d.reserve(2 * page)
    d.map(base, page, d.call("cuMemCreate", page, d.prop, 0))
    out: dict[str, Any] = {"ran": True}
    try:
        host_bytes(d, base + page, 16)
        out["driver_copy"] = "no error"
    except DriverCallError as exc:
        out["driver_copy"] = exc.result
    try:
        view = torch.as_tensor(ArrayInterface(base, 2 * page), device="cuda:0")
        total = int(view[page:].sum())
        torch.cuda.synchronize()
        out.update(faulted=False, note=f"a kernel read the unmapped page without error (sum {total})")
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or its AcceleratorError subclass
        out.update(faulted=True, error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
    return out                       # no clean-up: the context is likely poisoned; the process ends here
