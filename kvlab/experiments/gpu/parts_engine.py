"""The GPU check's parts that go through kvlab: vmm/drivers/cuda.py's CudaVirtualMemory (latency and a
zero-copy view round trip), one vmm cache's attention against SDPA, vmm against paged through the LLM API,
and the gpu-marked tests. Each takes `dry` and returns its JSON result ("failed" marks a failure)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from typing import Any

from kvlab.experiments.gpu.driver import MiB, access_desc, allocation_prop, driver_module, mem_free
from kvlab.experiments.gpu.harness import PART_TIMEOUT_ENV, ROOT
from kvlab.experiments.gpu.timing import per_call_latency

TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


def part_cuda_vmm(dry: bool) -> dict[str, Any]:
    """vmm/drivers/cuda.py on the driver: granularities, per-call latency of 2 MiB pages through its checked
    `call`, and a zero-copy view round trip."""
    from kvlab.vmm.drivers.cuda import CudaVirtualMemory
    vm = CudaVirtualMemory(0, driver=driver_module(True) if dry else None)
    drv = vm.drv
    recommended = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    try:
        out: dict[str, Any] = {
            "driver": "recording fake (tests/fakes/fake_cuda.py)" if dry else "cuda.bindings.driver",
            "minimum_granularity": vm.granularity(),
            "recommended_granularity": int(vm.call("cuMemGetAllocationGranularity", allocation_prop(drv),
                                                   recommended)),
            "page_size": vm.page_size,
        }
        page = -(-2 * MiB // vm.granularity()) * vm.granularity()
        out["latency"] = per_call_latency(vm.call, allocation_prop(drv), [access_desc(drv)], page,
                                          16 if dry else 64, lambda: mem_free(dry))
        out["round_trip"] = view_round_trip(vm)
        out.update(view_verdict(out["round_trip"], dry))
    finally:
        vm.close()
    if dry:
        out["fake_leaks"] = {k: str(v) for k, v in drv.leaks().items()}
    return out


def view_verdict(trip: dict[str, Any], dry: bool) -> dict[str, str]:
    if not dry and "view_error" in trip:
        return {"failed": f"zero-copy view failed on the GPU: {trip['view_error']}"}
    return {"failed": trip["failed"]} if "failed" in trip else {}


def view_round_trip(vm: Any) -> dict[str, Any]:
    """Reserve 4 pages, map 2, a zero-copy fp16 view, write on the GPU, read back; then release."""
    page = vm.page_size
    region = vm.reserve(4 * page)
    vm.create_store(2)
    vm.map(region, 0, 1, 1)                # pool page 1 at VA page 0, pool page 0 at VA page 1
    vm.map(region, page, 0, 1)
    out: dict[str, Any] = {"mapped_pages": 2, "reserved_pages": 4}
    try:
        out.update(exercise_views(vm, region))
    except Exception as exc:  # noqa: BLE001 - a CPU build of torch cannot wrap device memory: say so, go on
        out["view_error"] = f"{type(exc).__name__}: {exc}"
    vm.unmap(region, 0, 2)
    vm.release(region)                     # refused if a view were still alive
    out["live_mappings_after_release"] = vm.stats.num_mappings
    checks = ("data_ptr_equals_base", "alias_matches", "round_trip_equal")
    if "view_error" not in out and not all(out[k] for k in checks):
        out["failed"] = "the zero-copy view round trip did not hold: " + ", ".join(f"{k}={out[k]}" for k in checks)
    return out


def exercise_views(vm: Any, region: Any) -> dict[str, bool]:
    """Its views die with its frame, so the caller can release the region."""
    import torch
    page = vm.page_size
    view = vm.tensor_view(region, torch.float16, (page,))     # exactly the 2 mapped pages
    pattern = torch.arange(page, device=view.device).remainder(2039).to(torch.float16)
    view.copy_(pattern)
    second = vm.tensor_view(region, torch.float16, (page // 2,), offset=page)
    out = {"data_ptr_equals_base": view.data_ptr() == region.base,
           "alias_matches": bool(torch.equal(second, pattern[page // 2:])),
           "round_trip_equal": bool(torch.equal(view.cpu(), pattern.cpu()))}
    torch.cuda.synchronize()
    return out


def part_vmm_cache(dry: bool) -> dict[str, Any]:
    """One vmm cache built through the registry: a prefill and a decode step per dtype, against fp32 SDPA."""
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
    from kvlab.common.config import make_config
    from kvlab.common.kv.seam import create_cache
    from kvlab.common.kv.types import KVShape
    from kvlab.experiments.gpu.cache_steps import prefill_then_decode
    page = 2 * MiB if device == "cuda" else 64 * 1024
    shape = KVShape(num_layers=1, num_kv_heads=8, head_dim=128, num_q_heads=32, dtype=dtype, device=device)
    config = make_config(backend="vmm", device=device, dtype=dtype, page_size=page, max_num_seqs=2,
                         max_model_len=512, kv_cache_bytes=2 * 8 * page, max_num_batched_tokens=1024)
    cache = create_cache(config, shape)
    try:
        errors = [max(float((got - ref).abs().max()) for got, ref in step)
                  for step in prefill_then_decode(cache, (100, 37))]
        report = cache.kernel_report()
    finally:
        cache.close()
    err = max(errors)
    return {"ok": err <= TOLERANCE[dtype] * 4, "max_abs_err_vs_fp32": err, "prefill_err": errors[0],
            "decode_err": errors[1], "kernels": report.get("kernels", {}),
            "runtime_fallbacks": report.get("runtime_fallbacks", [])}


def bench_workload(dry: bool) -> dict[str, Any]:
    if dry:
        return {"device": "cpu", "dtype": "float32", "requests": 4, "prompt": (24, 32), "output": 8,
                "page_size": 64 * 1024, "max_model_len": 64}
    return {"device": "cuda", "dtype": "float16", "requests": 16, "prompt": (512, 1024), "output": 128,
            "page_size": 2 * MiB, "max_model_len": 2048}


def part_vmm_vs_paged(dry: bool) -> dict[str, Any]:
    """The tiny model through the LLM API on each backend: throughput, kernels, identical greedy outputs."""
    import numpy as np

    from kvlab import SamplingParams
    w = bench_workload(dry)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1024, int(n)).tolist() for n in rng.integers(*w["prompt"], w["requests"])]
    params = SamplingParams(max_tokens=w["output"], ignore_eos=True, temperature=0.0)
    out: dict[str, Any] = {"workload": w, "backends": {}}
    outputs, seconds = {}, {}
    for backend in ("vmm", "paged"):
        out["backends"][backend], outputs[backend], seconds[backend] = generate_on(backend, w, prompts, params, dry)
    out["vmm_over_paged"] = seconds["paged"] / seconds["vmm"]
    out["identical_outputs"] = sum(a == b for a, b in zip(outputs["vmm"], outputs["paged"]))
    return out


def generate_on(backend: str, w: dict[str, Any], prompts: list, params: Any, dry: bool) -> tuple:
    """(figures, output token ids, best seconds) of one backend after a short warm-up."""
    from kvlab import LLM, SamplingParams
    llm = LLM("tiny", backend=backend, device=w["device"], dtype=w["dtype"], page_size=w["page_size"],
              max_num_seqs=w["requests"], max_model_len=w["max_model_len"], max_num_batched_tokens=4096,
              kv_cache_bytes=(64 if dry else 1024) * MiB, threads=1 if dry else 0)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
        runs = []
        for _ in range(1 if dry else 2):
            t0 = time.perf_counter()
            result = llm.generate(prompts, params)
            runs.append(time.perf_counter() - t0)
        m = llm.metrics()
        figures = {"seconds": runs, "output_tokens_per_s": w["requests"] * w["output"] / min(runs),
                   "kernels": m.kernels, "refused_kernels": [r["kernel"] for r in m.refused_kernels],
                   "kernel_fallbacks": m.kernel_fallbacks, "allocator_share": m.allocator_share,
                   "map_calls": llm.cache_stats().map_calls, "mean_batch": m.mean_batch}
    finally:
        llm.close()
    return figures, [r.outputs[0].token_ids for r in result], min(runs)


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


def part_gpu_tests(dry: bool) -> dict[str, Any]:
    """`pytest -m gpu` over the test files that have gpu-marked tests, inside this part's timeout."""
    if importlib.util.find_spec("pytest") is None:
        return {"ran": False, "note": "pytest is not installed here; the gpu-marked tests were not run"}
    files = gpu_test_files()
    if not files:
        return {"ran": False, "failed": "no test file under tests/ has a pytest.mark.gpu test"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-q", "-rs", "-p", "no:cacheprovider",
           *files]
    budget = float(os.environ.get(PART_TIMEOUT_ENV, 150)) - 15      # die before the part does
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(budget, 5), check=False)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)",
                                                lines[-1] if lines else "")}
    out = {"ran": True, "files": files, "returncode": proc.returncode, "summary": lines[-1] if lines else "",
           "counts": counts, "tail": lines[-40:]}
    if proc.returncode not in (0, 5):          # 5: every test deselected
        out["failed"] = f"pytest -m gpu exited with {proc.returncode}: {out['summary']}"
    return out
