"""First contact with a GPU (issue 18): about 90 s, one JSON, each part in its own process with its own timeout.

Run it through `bash experiments/gpu_check.sh --first-contact` (or `python experiments/gpu/first_contact.py` with
PYTHONPATH at the repository). In order:
  versions       cuda.bindings, torch, triton, numpy, the driver; MINIMUM and RECOMMENDED granularity
  unmapped_view  a torch tensor over a reservation with nothing mapped: does creating it succeed?
  vmm_round_trip map, write, unmap, remap the same handle at a new address, read back (driver memcpy, no
                 torch); map from a worker thread; mem_get_info deltas; the first bytes of a fresh page
  vmm_cache      one VMMKVCache (through create_cache) prefill + decode in fp16 and bf16 against fp32 SDPA,
                 and which kernel ran
  triton_kernel  the compiled Triton paged kernel, decode and prefill, against SDPA on Llama-3-8B shapes:
                 max error and compile time
  vmm_latency    median per-call latency of create, map, set-access, unmap, release over 100 pages of the
                 RECOMMENDED granularity
  unmapped_touch last, alone: a read of an unmapped page, recorded as the fault it raises
The driver is used directly (cuda.bindings.driver), plus kvlab's public create_cache path, so a reorganisation
of vmm's internals does not break it. --dry-run-cpu runs the same parts on CPU: the recording fake driver
(vmm/drivers/fake_cuda.py), the Triton interpreter on tiny shapes, the vmm cache on host memory; what
needs device memory says so. Without a GPU and without --dry-run-cpu it exits 2.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kvlab.experiments.gpu.check import (
    access_desc,
    allocation_prop,
    check_parser,
    default_out,
    detect_gpu,
    load_fake_driver,
    run_one,
    run_part,
    summary,
    write_result,
)

MiB = 2**20
TOTAL_SECONDS = 150          # typical run ~60-90 s; the caps below bound a bad one
PART_SECONDS = {"versions": 30, "unmapped_view": 15, "vmm_round_trip": 20, "vmm_cache": 30, "triton_kernel": 60,
                "vmm_latency": 20, "unmapped_touch": 15}
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


# -- the driver, used directly -----------------------------------------------------------------------------------

class Driver:
    """cuda.bindings.driver (or the recording fake) with checked calls; the primary context (the one torch
    uses) is current on the creating thread."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.drv = load_fake_driver() if dry else importlib.import_module("cuda.bindings.driver")
        self.call("cuInit", 0)
        self.dev = self.call("cuDeviceGet", 0)
        self.ctx = self.call("cuDevicePrimaryCtxRetain", self.dev)
        self.call("cuCtxSetCurrent", self.ctx)
        self.prop = allocation_prop(self.drv)
        self.access = [access_desc(self.drv)]

    def call(self, name: str, *args: Any) -> Any:
        err, *values = getattr(self.drv, name)(*args)
        if err != self.drv.CUresult.CUDA_SUCCESS:
            raise DriverCallError(name, getattr(err, "name", str(err)))
        return values[0] if len(values) == 1 else (values or None)

    def granularity(self, which: str) -> int:
        flag = getattr(self.drv.CUmemAllocationGranularity_flags, f"CU_MEM_ALLOC_GRANULARITY_{which}")
        return int(self.call("cuMemGetAllocationGranularity", self.prop, flag))

    def reserve(self, size: int) -> int:
        return int(self.call("cuMemAddressReserve", size, 0, 0, 0))

    def map(self, ptr: int, size: int, handle: Any) -> None:
        self.call("cuMemMap", ptr, size, 0, handle, 0)
        self.call("cuMemSetAccess", ptr, size, self.access, 1)

    def close(self) -> None:
        self.call("cuDevicePrimaryCtxRelease", self.dev)


class DriverCallError(RuntimeError):
    def __init__(self, name: str, result: str) -> None:
        super().__init__(f"{name} returned {result}")
        self.result = result


def mem_free(dry: bool) -> int | None:
    if dry:
        return None
    import torch
    return torch.cuda.mem_get_info()[0]


def host_bytes(d: Driver, ptr: int, n: int) -> bytes:
    """n bytes from device address ptr, copied by the driver (no torch tensor over the address)."""
    import numpy as np
    buf = np.zeros(n, dtype=np.uint8)
    d.call("cuMemcpyDtoH", buf.ctypes.data, ptr, n)
    return buf.tobytes()


def to_device(d: Driver, ptr: int, data: bytes) -> None:
    import numpy as np
    buf = np.frombuffer(data, dtype=np.uint8).copy()
    d.call("cuMemcpyHtoD", ptr, buf.ctypes.data, len(data))


class ArrayInterface:
    """A bare __cuda_array_interface__ over a device address, as a VMM cache hands torch its views."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


# -- parts -------------------------------------------------------------------------------------------------------

def part_versions(dry: bool) -> dict[str, Any]:
    import platform
    import subprocess

    import numpy
    import torch
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "numpy": numpy.__version__,
                           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
    for name in ("triton", "cuda.bindings"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "installed")
        except ImportError as exc:
            out[name] = f"not importable: {exc}"
    d = Driver(dry)
    try:
        out["driver"] = "recording fake" if dry else d.call("cuDriverGetVersion")
        out["minimum_granularity"] = d.granularity("MINIMUM")
        out["recommended_granularity"] = d.granularity("RECOMMENDED")
    finally:
        d.close()
    if not dry:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15, check=False)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    return out


def part_unmapped_view(dry: bool) -> dict[str, Any]:
    """Item 6: torch asked to wrap a reserved address with nothing mapped behind it, three ways."""
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
            try:
                view = make()
                out[name] = {"created": True, "data_ptr_equals_base": view.data_ptr() == base}
                del view
            except Exception as exc:  # noqa: BLE001 - the outcome is the measurement
                out[name] = {"created": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        torch.cuda.synchronize()
        return out
    finally:
        d.call("cuMemAddressFree", base, size)
        d.close()


def part_vmm_round_trip(dry: bool) -> dict[str, Any]:
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
    if dry:
        out["fake_leaks"] = {k: str(v) for k, v in d.drv.leaks().items()}
    else:
        out["mem_get_info_delta_mib"] = {k: (free["start"] - v) / MiB for k, v in free.items() if k != "start"}
    if not dry and not out["remapped_reads_back"]:
        out["failed"] = "the remapped handle did not read back what was written through the first address"
    return out


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


def part_vmm_cache(dry: bool) -> dict[str, Any]:
    """One VMMKVCache built through the registry: a prefill and a decode step per dtype, against fp32 SDPA."""
    out: dict[str, Any] = {"device": "cpu" if dry else "cuda", "dtypes": {}}
    for dtype in ("float16", "bfloat16"):
        try:
            out["dtypes"][dtype] = cache_steps(dtype, out["device"])
        except Exception as exc:  # noqa: BLE001 - keep the other dtype
            out["dtypes"][dtype] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    bad = [k for k, v in out["dtypes"].items() if not v["ok"]]
    if bad:
        out["failed"] = f"vmm cache steps failed or exceeded the tolerance for {', '.join(bad)}"
    return out


def cache_steps(dtype: str, device: str) -> dict[str, Any]:
    import torch

    from kvlab.common.attention.metadata import BatchItem
    from kvlab.common.config import make_config
    from kvlab.common.kv.seam import create_cache
    from kvlab.common.kv.types import KVShape
    from kvlab.common.sequence import Sequence
    page = 2 * MiB if device == "cuda" else 64 * 1024
    shape = KVShape(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=32, dtype=dtype, device=device)
    config = make_config(backend="vmm", device=device, dtype=dtype, page_size=page, max_num_seqs=2,
                         max_model_len=512, kv_cache_bytes=2 * 8 * page, max_num_batched_tokens=1024)
    cache = create_cache(config, shape)
    g = torch.Generator(device=device).manual_seed(0)
    errors = []
    try:
        seqs = [Sequence(i, str(i), [1] * n, 4) for i, n in enumerate((100, 37))]
        history: dict[int, tuple[list, list]] = {s.seq_id: ([], []) for s in seqs}
        steps = [[BatchItem(s, 0, s.num_tokens) for s in seqs], [BatchItem(s, s.num_tokens, 1) for s in seqs]]
        for items in steps:
            for it in items:
                cache.allocator.allocate(it.seq, it.context_len)
            meta = cache.storage.prepare(items)
            total = sum(it.num_tokens for it in items)
            q, k, v = (torch.randn(total, h, 128, generator=g, device=device) for h in (32, 8, 8))
            low = [t.to(getattr(torch, dtype)) for t in (q, k, v)]
            got = cache.storage.attention(0, *low, meta, 128 ** -0.5).float()
            errors.append(step_error(items, got, q, k, v, history))   # fp32 inputs: includes their rounding
        report = cache.kernel_report()
    finally:
        cache.close()
    err = max(errors)
    return {"ok": err <= TOLERANCE[dtype] * 4, "max_abs_err_vs_fp32": err, "prefill_err": errors[0],
            "decode_err": errors[1], "kernels": report.get("kernels", {}),
            "runtime_fallbacks": report.get("runtime_fallbacks", [])}


def step_error(items: list, got: Any, q: Any, k: Any, v: Any, history: dict) -> float:
    """Max abs error of one step against fp32 causal SDPA over each sequence's whole fp32 history."""
    import torch
    import torch.nn.functional as F
    start, worst = 0, 0.0
    for it in items:
        n = it.num_tokens
        keys, values = history[it.seq.seq_id]
        keys.append(k[start:start + n])
        values.append(v[start:start + n])
        kk, vv = torch.cat(keys), torch.cat(values)
        ctx = kk.shape[0]
        mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
        ref = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q[start:start + n], kk, vv)),
                                             attn_mask=mask, scale=128 ** -0.5, enable_gqa=True)[0].transpose(0, 1)
        worst = max(worst, float((got[start:start + n] - ref).abs().max()))
        start += n
        it.seq.num_computed_tokens = it.context_len
    return worst


def triton_cases(dry: bool) -> list[dict[str, Any]]:
    if dry:
        tiny = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16, "dtype": "float32"}
        return [{**tiny, "phase": "decode", "query_lens": [1, 1], "context_lens": [40, 64]},
                {**tiny, "phase": "prefill", "query_lens": [5], "context_lens": [37]}]
    llama = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}     # Llama-3-8B, per layer
    return [{**llama, "dtype": "float16", "phase": "decode", "query_lens": [1] * 16, "context_lens": [4096] * 16},
            {**llama, "dtype": "float16", "phase": "prefill", "query_lens": [512, 1, 200],
             "context_lens": [512, 3000, 1000]},
            {**llama, "dtype": "bfloat16", "phase": "decode", "query_lens": [1] * 16, "context_lens": [4096] * 16}]


def part_triton_kernel(dry: bool) -> dict[str, Any]:
    import torch

    from kvlab.experiments.bench.perf.kernel_inputs import paged_case, reference
    from kvlab.paged.kernels.triton_paged import paged_attention_triton
    device = "cpu" if dry else "cuda"
    rows = []
    for c in triton_cases(dry):
        row = {k: v for k, v in c.items() if k not in ("query_lens", "context_lens")}
        try:
            case = paged_case(c["query_lens"], c["context_lens"], c["block_size"], c["num_heads"],
                              c["num_kv_heads"], c["head_dim"], getattr(torch, c["dtype"]), device)
            run = lambda: paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale)  # noqa: B023
            first = timed_call(run, device)
            steady = sorted(timed_call(run, device) for _ in range(3))[1]
            err = float((run().float() - reference(case)).abs().max())
            row.update(max_abs_err_vs_sdpa=err, ok=err <= TOLERANCE[c["dtype"]], first_call_s=first,
                       steady_call_s=steady, compile_s=max(first - steady, 0.0))
        except Exception as exc:  # noqa: BLE001 - keep the other cases
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        rows.append(row)
    out = {"device": device, "mode": "interpreter, tiny shapes" if dry else "compiled", "cases": rows}
    if not all(r["ok"] for r in rows):
        out["failed"] = f"{sum(not r['ok'] for r in rows)} of {len(rows)} Triton cases failed or exceeded tolerance"
    return out


def timed_call(fn: Callable[[], Any], device: str) -> float:
    import torch
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def part_vmm_latency(dry: bool) -> dict[str, Any]:
    d = Driver(dry)
    page = d.granularity("RECOMMENDED")
    pages = 16 if dry else 100
    times: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}

    def timed(kind: str, name: str, *args: Any) -> Any:
        t0 = time.perf_counter()
        value = d.call(name, *args)
        times[kind].append(time.perf_counter() - t0)
        return value
    base = d.reserve(pages * page)
    handles = [timed("create", "cuMemCreate", page, d.prop, 0) for _ in range(pages)]
    for i, h in enumerate(handles):
        timed("map", "cuMemMap", base + i * page, page, 0, h, 0)
        timed("set_access", "cuMemSetAccess", base + i * page, page, d.access, 1)
    d.call("cuCtxSynchronize")
    for i in range(pages):
        timed("unmap", "cuMemUnmap", base + i * page, page)
    for h in handles:
        timed("release", "cuMemRelease", h)
    d.call("cuMemAddressFree", base, pages * page)
    d.close()
    return {"driver": "recording fake" if dry else "cuda.bindings.driver", "page_bytes": page, "pages": pages,
            "median_us": {k: summary(v)["median"] for k, v in times.items()},
            "p90_us": {k: summary(v)["p90"] for k, v in times.items()}}


def part_unmapped_touch(dry: bool) -> dict[str, Any]:
    """A copy from, then a kernel read of, a reserved page with nothing mapped (the kernel read is sticky)."""
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


PARTS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "versions": part_versions, "unmapped_view": part_unmapped_view, "vmm_round_trip": part_vmm_round_trip,
    "vmm_cache": part_vmm_cache, "triton_kernel": part_triton_kernel, "vmm_latency": part_vmm_latency,
    "unmapped_touch": part_unmapped_touch,
}


# -- orchestration -------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = check_parser(__doc__.splitlines()[0], PARTS, "first_contact.json")
    args = p.parse_args(argv)
    if args.part:
        return run_one(args.part, args.dry_run_cpu, args.part_out, PARTS)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    out_file = args.out or default_out("first_contact.json")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"mode": "cpu-dry-run" if args.dry_run_cpu else "gpu",
                           "started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}
    start = time.perf_counter()
    if not args.dry_run_cpu:
        doc["gpu"] = detect_gpu()
        if not doc["gpu"]["present"]:
            doc["mode"] = "no-gpu"
            write_result(out_file, doc)
            print(f"first_contact: error: no GPU found ({'; '.join(doc['gpu']['evidence'])}); pass --dry-run-cpu "
                  "for the CPU dry run", file=sys.stderr)
            return 2
    for name in sorted(names, key=list(PARTS).index):     # the fault part always last
        left = TOTAL_SECONDS - (time.perf_counter() - start)
        if left < 5:
            result = {"ok": False, "error": f"not run: the {TOTAL_SECONDS} s budget is spent"}
        else:
            print(f"first_contact: {name} ...", file=sys.stderr, flush=True)
            result = run_part(name, args.dry_run_cpu, min(PART_SECONDS[name], left), __file__)
            print(f"first_contact: {name} {'ok' if result['ok'] else 'FAILED: ' + result['error']} "
                  f"({result.get('seconds')} s)", file=sys.stderr, flush=True)
        doc["parts"][name] = result
        doc["seconds"] = round(time.perf_counter() - start, 1)
        write_result(out_file, doc)
    ok = sum(r["ok"] for r in doc["parts"].values())
    print(f"first_contact ({doc['mode']}): {ok}/{len(doc['parts'])} parts ok, {doc['seconds']} s, "
          f"written to {out_file}")
    return 0 if ok == len(doc["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
