"""The prepared GPU check (run it through experiments/gpu_check.sh): one JSON with every part's result.

Each part runs in its own subprocess with its own timeout (a sticky CUDA error or a hang loses that part
only) and records ok/error; the JSON is rewritten after every part, so even a killed run leaves what it had.
Parts: environment; cuda_vmm (vmm/cuda.py on the real driver: granularities, per-call latency of
create/map/set-access/unmap/release for 2 MiB pages, mem_get_info around them, a zero-copy view round trip);
triton_vs_sdpa (the compiled Triton paged kernel against SDPA: error and time); vmm_vs_paged (tiny model
through the LLM API on cuda); gpu_tests (pytest -m gpu); unmapped_access (touching an unmapped page faults).

Whether a GPU is present is decided before any part runs, by `nvidia-smi -L` (or, where it cannot answer, a
torch probe with a generous timeout), never by a part's result. Without a GPU the check fails loudly (exit 2)
unless --dry-run-cpu asks for the dry run: every part as far as a CPU allows, the driver calls against the
recording fake (vmm/drivers/fake_cuda.py), the Triton kernel in its interpreter on a tiny shape, the
bench on cpu. Numbers from a dry run check the plumbing, not a GPU.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20
TOTAL_SECONDS = 450          # the shell wrapper kills everything at 475 s; the brief allows 8 minutes
# first compiles of the Triton kernel take tens of seconds each (cached on disk for the later parts)
PART_SECONDS = {"environment": 60, "cuda_vmm": 45, "triton_vs_sdpa": 110, "vmm_vs_paged": 90, "gpu_tests": 150,
                "unmapped_access": 25}
PART_TIMEOUT_ENV = "KVLAB_GPU_CHECK_PART_SECONDS"
NVIDIA_SMI_SECONDS = 30
TORCH_PROBE_SECONDS = 180    # a cold torch import plus the first CUDA init on a fresh machine


# -- helpers shared by the parts -------------------------------------------------------------------------------

def summary(samples: list[float], scale: float = 1e6) -> dict[str, float]:
    """Median and p90 of per-call seconds, in microseconds by default."""
    ordered = sorted(samples)
    return {"median": statistics.median(ordered) * scale, "p90": ordered[int(0.9 * (len(ordered) - 1))] * scale,
            "calls": len(ordered)}


def device_timer(device: str, fn: Callable[[], Any], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median/p90 milliseconds per call: CUDA events on a GPU, perf_counter on the CPU."""
    import torch
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return summary(samples, 1e3)


def load_fake_driver() -> Any:
    """The recording fake of cuda.bindings.driver (vmm/drivers/fake_cuda.py)."""
    from kvlab.vmm.drivers.fake_cuda import FakeCudaDriver
    return FakeCudaDriver()


def mem_free() -> int | None:
    import torch
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


# -- parts -----------------------------------------------------------------------------------------------------

def part_environment(dry: bool) -> dict[str, Any]:
    import numpy
    import torch
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "numpy": numpy.__version__,
                           "cuda_available": torch.cuda.is_available(),
                           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET")}
    for name in ("triton", "cuda.bindings"):          # imported: an ABI mismatch shows here
        try:
            out[name] = getattr(__import__(name, fromlist=["_"]), "__version__", "installed")
        except ImportError as exc:
            out[name] = f"not importable: {exc}"
    for dist in ("pytest", "transformers", "flash-attn", "flashinfer-python"):   # metadata only: fast
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    if not dry and not torch.cuda.is_available():
        out["failed"] = "a GPU is present but torch.cuda.is_available() is False: a CPU build of torch?"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=props.name, capability=list(torch.cuda.get_device_capability(0)),
                   total_memory_gib=round(props.total_memory / 2**30, 1))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=15, check=False)
            out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["nvidia_smi"] = f"unavailable: {exc}"
    return out


def allocation_prop(drv: Any) -> Any:
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
    return prop


def access_desc(drv: Any) -> Any:
    desc = drv.CUmemAccessDesc()
    desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


def per_call_latency(vm: Any, page: int, pages: int) -> dict[str, Any]:
    """Every call one page at a time through vmm/cuda.py's checked `call`, timed on the host."""
    prop, access = allocation_prop(vm.drv), [access_desc(vm.drv)]
    times: dict[str, list[float]] = {k: [] for k in ("create", "map", "set_access", "unmap", "release")}

    def timed(name: str, args: tuple, into: list[float]) -> Any:
        t0 = time.perf_counter()
        out = vm.call(name, *args)
        into.append(time.perf_counter() - t0)
        return out
    free = {"before_create": mem_free()}
    base = int(vm.call("cuMemAddressReserve", pages * page, 0, 0, 0))
    handles = [timed("cuMemCreate", (page, prop, 0), times["create"]) for _ in range(pages)]
    free["after_create"] = mem_free()
    for i, h in enumerate(handles):
        timed("cuMemMap", (base + i * page, page, 0, h, 0), times["map"])
        timed("cuMemSetAccess", (base + i * page, page, access, 1), times["set_access"])
    free["after_map"] = mem_free()
    vm.call("cuCtxSynchronize")           # unmap does not wait for kernels (gpu-apis.md §1.7)
    for i in range(pages):
        timed("cuMemUnmap", (base + i * page, page), times["unmap"])
    for h in handles:
        timed("cuMemRelease", (h,), times["release"])
    vm.call("cuMemAddressFree", base, pages * page)
    free["after_release"] = mem_free()
    out: dict[str, Any] = {"page_bytes": page, "pages": pages, "us": {k: summary(v) for k, v in times.items()}}
    out["mem_get_info_free_bytes"] = free
    if free["before_create"] is not None:
        out["created_mib_seen_by_mem_get_info"] = (free["before_create"] - free["after_create"]) / MiB
        out["mapped_mib_seen_by_mem_get_info"] = (free["before_create"] - free["after_map"]) / MiB
    return out


def view_round_trip(vm: Any) -> dict[str, Any]:
    """vmm/cuda.py end to end: reserve 4 pages, map 2, a zero-copy fp16 view, write on the GPU, read back."""
    page = vm.page_size
    region = vm.reserve(4 * page)
    vm.create_pool(2)
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


def part_cuda_vmm(dry: bool) -> dict[str, Any]:
    from kvlab.vmm.drivers.cuda import CudaVirtualMemory
    vm = CudaVirtualMemory(0, driver=load_fake_driver() if dry else None)
    drv = vm.drv
    recommended = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    try:
        out: dict[str, Any] = {
            "driver": "recording fake (vmm/drivers/fake_cuda.py)" if dry else "cuda.bindings.driver",
            "minimum_granularity": vm.granularity(),
            "recommended_granularity": int(vm.call("cuMemGetAllocationGranularity", allocation_prop(drv),
                                                   recommended)),
            "page_size": vm.page_size,
        }
        page = -(-2 * MiB // vm.granularity()) * vm.granularity()
        out["latency"] = per_call_latency(vm, page, 16 if dry else 64)
        out["round_trip"] = view_round_trip(vm)
        if not dry and "view_error" in out["round_trip"]:
            out["failed"] = f"zero-copy view failed on the GPU: {out['round_trip']['view_error']}"
        elif "failed" in out["round_trip"]:
            out["failed"] = out["round_trip"]["failed"]
    finally:
        vm.close()
    if dry:
        out["fake_leaks"] = {k: str(v) for k, v in drv.leaks().items()}
    return out


def triton_configs(dry: bool) -> list[dict[str, Any]]:
    if dry:
        tiny = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16, "dtype": "float32"}
        return [{**tiny, "query_lens": [1, 1], "context_lens": [40, 64]},
                {**tiny, "query_lens": [5], "context_lens": [37]}]
    llama = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}   # Llama-3-8B per layer
    out = [{**llama, "dtype": dt, "query_lens": [1] * 16, "context_lens": [ctx] * 16}
           for dt in ("float16", "bfloat16") for ctx in (1024, 8192)]
    out.append({**llama, "dtype": "float16", "query_lens": [1] * 16, "context_lens": list(range(4096, 8192, 256))})
    out.append({**llama, "dtype": "bfloat16", "query_lens": [64, 1, 200], "context_lens": [512, 3000, 1000]})
    return out


TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


def triton_one(cfg: dict[str, Any], device: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from kvlab.experiments.bench.perf.kernel_inputs import dense_decode_inputs, paged_case, reference
    from kvlab.paged.kernels.torch_ref import paged_attention_torch
    from kvlab.paged.kernels.triton_paged import paged_attention_triton
    case = paged_case(cfg["query_lens"], cfg["context_lens"], cfg["block_size"], cfg["num_heads"],
                      cfg["num_kv_heads"], cfg["head_dim"], getattr(torch, cfg["dtype"]), device)
    out = paged_attention_triton(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    err = float((out.float() - reference(case)).abs().max())
    row = {**{k: v for k, v in cfg.items() if k not in ("query_lens", "context_lens")},
           "batch": len(cfg["query_lens"]), "max_query_len": max(cfg["query_lens"]),
           "max_context": max(cfg["context_lens"]), "max_abs_err": err, "ok": err <= TOLERANCE[cfg["dtype"]]}
    repeats = 3 if device == "cpu" else 20
    row["triton_ms"] = device_timer(device, lambda: paged_attention_triton(case.q, case.k_cache, case.v_cache,
                                                                           case.meta, case.scale), repeats)
    row["torch_paged_gather_ms"] = device_timer(device, lambda: paged_attention_torch(
        case.q, case.k_cache, case.v_cache, case.meta, case.scale), repeats)
    if case.meta.is_decode and len(set(cfg["context_lens"])) == 1:   # SDPA on the contiguous layout
        q, k, v = dense_decode_inputs(case)
        row["sdpa_contiguous_ms"] = device_timer(device, lambda: F.scaled_dot_product_attention(
            q, k, v, scale=case.scale, enable_gqa=True), repeats)
    return row


def part_triton_vs_sdpa(dry: bool) -> dict[str, Any]:
    import torch
    device = "cpu" if dry else "cuda"
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the CPU dry run needs TRITON_INTERPRET=1 before Triton is imported")
    if not dry and os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 on a GPU run: unset it (triton 3.6 + numpy 2.5 break the "
                           "interpreter; this part checks the compiled kernel)")
    rows = []
    for cfg in triton_configs(dry):
        try:
            rows.append(triton_one(cfg, device))
        except Exception as exc:  # noqa: BLE001 - keep the other shapes
            rows.append({**cfg, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        if device == "cuda":
            torch.cuda.empty_cache()
    out = {"device": device, "mode": "interpreter, tiny shapes" if dry else "compiled", "configs": rows}
    bad = [r for r in rows if not r.get("ok")]
    if bad:
        out["failed"] = f"{len(bad)} of {len(rows)} Triton configurations failed or exceeded the tolerance"
    return out


def bench_workload(dry: bool) -> dict[str, Any]:
    if dry:
        return {"device": "cpu", "dtype": "float32", "requests": 4, "prompt": (24, 32), "output": 8,
                "page_size": 64 * 1024, "max_model_len": 64}
    return {"device": "cuda", "dtype": "float16", "requests": 16, "prompt": (512, 1024), "output": 128,
            "page_size": 2 * MiB, "max_model_len": 2048}


def part_vmm_vs_paged(dry: bool) -> dict[str, Any]:
    import numpy as np

    from kvlab import LLM, SamplingParams
    w = bench_workload(dry)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 1024, int(n)).tolist() for n in rng.integers(*w["prompt"], w["requests"])]
    params = SamplingParams(max_tokens=w["output"], ignore_eos=True, temperature=0.0)
    out: dict[str, Any] = {"workload": w, "backends": {}}
    outputs, seconds = {}, {}
    for backend in ("vmm", "paged"):
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
            seconds[backend] = min(runs)
            outputs[backend] = [r.outputs[0].token_ids for r in result]
            m = llm.metrics()
            out["backends"][backend] = {
                "seconds": runs, "output_tokens_per_s": w["requests"] * w["output"] / seconds[backend],
                "kernels": m.kernels, "refused_kernels": [r["kernel"] for r in m.refused_kernels],
                "kernel_fallbacks": m.kernel_fallbacks, "allocator_share": m.allocator_share,
                "map_calls": llm.cache_stats().map_calls, "mean_batch": m.mean_batch}
        finally:
            llm.close()
    out["vmm_over_paged"] = seconds["paged"] / seconds["vmm"]
    out["identical_outputs"] = sum(a == b for a, b in zip(outputs["vmm"], outputs["paged"]))
    return out


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text())


def part_gpu_tests(dry: bool) -> dict[str, Any]:
    if importlib.util.find_spec("pytest") is None:
        return {"ran": False, "note": "pytest is not installed here; the gpu-marked tests were not run"}
    files = gpu_test_files()
    if not files:
        return {"ran": False, "failed": "no test file under tests/ has a pytest.mark.gpu test"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-o", "addopts=", "-q", "-rs", "-p", "no:cacheprovider",
           *files]
    budget = float(os.environ.get(PART_TIMEOUT_ENV, PART_SECONDS["gpu_tests"])) - 15   # die before the part does
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(budget, 5), check=False)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)",
                                                lines[-1] if lines else "")}
    out = {"ran": True, "files": files, "returncode": proc.returncode, "summary": lines[-1] if lines else "",
           "counts": counts, "tail": lines[-40:]}
    if proc.returncode not in (0, 5):          # 5: every test deselected
        out["failed"] = f"pytest -m gpu exited with {proc.returncode}: {out['summary']}"
    return out


def part_unmapped_access(dry: bool) -> dict[str, Any]:
    """Reading a reserved but unmapped page from a kernel: expected to fault (sticky); why the cache maps
    every page a kernel may touch before launch."""
    if dry:
        return {"ran": False, "note": "needs a GPU: a CPU cannot take a CUDA page fault"}
    import torch

    from kvlab.vmm.drivers.cuda import CudaVirtualMemory
    vm = CudaVirtualMemory(0)
    region = vm.reserve(2 * vm.page_size)
    vm.create_pool(1)
    vm.map(region, 0, 0, 1)
    view = vm.tensor_view(region, torch.uint8, (2 * vm.page_size,))
    try:
        total = int(view[vm.page_size:].sum())
        torch.cuda.synchronize()
        return {"ran": True, "faulted": False, "note": f"read an unmapped page without error (sum {total})"}
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError or its AcceleratorError subclass
        return {"ran": True, "faulted": True, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}


PARTS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "environment": part_environment, "cuda_vmm": part_cuda_vmm, "triton_vs_sdpa": part_triton_vs_sdpa,
    "vmm_vs_paged": part_vmm_vs_paged, "gpu_tests": part_gpu_tests, "unmapped_access": part_unmapped_access,
}


# -- orchestration ---------------------------------------------------------------------------------------------

def part_env(dry: bool, timeout: float) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env[PART_TIMEOUT_ENV] = str(int(timeout))
    env["TRITON_INTERPRET"] = "1" if dry else "0"   # compiled kernels on the GPU; the interpreter on CPU
    return env


def run_part(name: str, dry: bool, timeout: float, script: str = __file__) -> dict[str, Any]:
    """One part of `script` (this check, or first_contact.py) in its own subprocess, with its own timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "part.json"
        cmd = [sys.executable, str(Path(script).resolve()), "--part", name, "--part-out", str(result_file)]
        cmd += ["--dry-run-cpu"] if dry else []
        return run_subprocess(cmd, part_env(dry, timeout), timeout, result_file)


def run_subprocess(cmd: list[str], env: dict[str, str], timeout: float, result_file: Path) -> dict[str, Any]:
    """Run one part's process in its own process group (a timeout kills its children too) and return the
    result file it wrote, also when it was killed afterwards: a part that faulted on purpose may hang in CUDA
    teardown after recording the fault."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        timed_out = True
    seconds = round(time.perf_counter() - t0, 2)
    doc = read_result(result_file)
    if doc is not None:
        doc["seconds"] = seconds
        if timed_out:
            doc["timed_out"] = f"killed after {timeout:.0f} s, after it had written its result"
        return doc
    why = f"timed out after {timeout:.0f} s" if timed_out else f"the part process exited with {proc.returncode}"
    return {"ok": False, "error": f"{why} and wrote no result", "seconds": seconds,
            "stderr_tail": (stderr or "")[-2000:]}


def read_result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_result(path: Path, doc: dict[str, Any]) -> None:
    """Atomically: a part killed while writing leaves no half file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)


# -- is there a GPU? (decided before any part runs) ------------------------------------------------------------

def nvidia_smi_gpus(timeout: float = NVIDIA_SMI_SECONDS) -> tuple[list[str] | None, str]:
    """The GPUs `nvidia-smi -L` lists; None when it cannot answer (absent, failed, timed out)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi is not on PATH"
    try:
        proc = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi -L did not answer: {exc}"
    gpus = [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith("GPU ")]
    if proc.returncode != 0 and not gpus:
        first = (proc.stdout + proc.stderr).strip().splitlines()
        return None, f"nvidia-smi -L exited with {proc.returncode}: {first[0] if first else 'no output'}"
    return gpus, f"nvidia-smi -L lists {len(gpus)} GPU(s)"


def torch_probe(timeout: float = TORCH_PROBE_SECONDS) -> tuple[int | None, str]:
    """torch.cuda.device_count() in a fresh process; None when the probe itself failed."""
    code = "import torch; print(torch.cuda.device_count())"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return None, f"the torch probe did not finish in {timeout:.0f} s"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].isdigit():
        tail = proc.stderr.strip().splitlines()
        return None, f"the torch probe failed: {tail[-1] if tail else proc.returncode}"
    return int(lines[-1]), f"torch.cuda.device_count() = {lines[-1]}"


def detect_gpu() -> dict[str, Any]:
    """nvidia-smi first; the torch probe only where nvidia-smi lists nothing."""
    gpus, smi = nvidia_smi_gpus()
    if gpus:
        return {"present": True, "gpus": gpus, "evidence": [smi]}
    count, probe = torch_probe()
    return {"present": bool(count), "gpus": [], "evidence": [smi, probe]}


def run_one(name: str, dry: bool, out_file: Path, parts: dict[str, Callable] | None = None) -> int:
    """Inside a part's subprocess: run `parts[name]` (this check's parts by default), write
    {"ok", "result" | "error"}."""
    try:
        result = (PARTS if parts is None else parts)[name](dry)
        doc = {"ok": "failed" not in result, "result": result}
        if "failed" in result:
            doc["error"] = result["failed"]
    except Exception as exc:  # noqa: BLE001 - the error is the result
        doc = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    write_result(out_file, doc)
    return 0


def default_out(name: str = "gpu_check.json") -> Path:
    return Path(os.environ["OUT"]) / name if os.environ.get("OUT") else ROOT / "results" / name


def check_parser(description: str, parts: dict[str, Callable], json_name: str) -> argparse.ArgumentParser:
    """The flags every part-runner shares (this check and first_contact.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--dry-run-cpu", action="store_true", help="run every part on CPU (fake driver, interpreter)")
    p.add_argument("--out", type=Path, help=f"JSON path (default $OUT/{json_name}, else results/{json_name})")
    p.add_argument("--parts", default=",".join(parts), help=f"comma list of: {', '.join(parts)}")
    p.add_argument("--part", choices=list(parts), help=argparse.SUPPRESS)
    p.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = check_parser(__doc__.splitlines()[0], PARTS, "gpu_check.json").parse_args(argv)
    if args.part:
        return run_one(args.part, args.dry_run_cpu, args.part_out)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    out_file = args.out or default_out()
    out_file.parent.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run_cpu
    check = Check(out_file, dry)
    if not dry:
        gpu = detect_gpu()
        check.doc["gpu"] = gpu
        if not gpu["present"]:
            check.doc.update(mode="no-gpu", why="no GPU found: " + "; ".join(gpu["evidence"]))
            check.save()
            print(f"gpu_check: error: no GPU found ({'; '.join(gpu['evidence'])}); "
                  f"pass --dry-run-cpu for the CPU dry run", file=sys.stderr)
            return 2
    check.set_mode(dry, "--dry-run-cpu" if dry else "; ".join(check.doc["gpu"]["evidence"]))
    for name in ["environment", *(n for n in names if n != "environment")]:
        check.run(name, dry)
    parts = check.doc["parts"]
    print(f"gpu_check ({check.doc['mode']}): {sum(p['ok'] for p in parts.values())}/{len(parts)} parts ok, "
          f"{check.doc['seconds']} s, written to {out_file}")
    return 0 if all(p["ok"] for p in parts.values()) else 1


class Check:
    """The JSON document, rewritten after every part so a killed run keeps what it had."""

    def __init__(self, path: Path, dry: bool) -> None:
        self.path = path
        self.start = time.perf_counter()
        self.doc: dict[str, Any] = {"mode": "cpu-dry-run" if dry else "gpu", "why": "",
                                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": {}}

    def set_mode(self, dry: bool, why: str) -> None:
        self.doc.update(mode="cpu-dry-run" if dry else "gpu", why=why)
        self.save()

    def run(self, name: str, dry: bool) -> dict[str, Any]:
        left = TOTAL_SECONDS - (time.perf_counter() - self.start)
        if name not in PARTS:
            result = {"ok": False, "error": f"unknown part; choose from {', '.join(PARTS)}"}
        elif left < 10:
            result = {"ok": False, "error": "not run: the 8-minute budget is spent"}
        else:
            print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
            result = run_part(name, dry, min(PART_SECONDS[name], left))
            print(f"gpu_check: {name} {'ok' if result['ok'] else 'FAILED: ' + result['error']} "
                  f"({result.get('seconds')} s)", file=sys.stderr, flush=True)
        self.doc["parts"][name] = result
        self.save()
        return result

    def save(self) -> None:
        self.doc["seconds"] = round(time.perf_counter() - self.start, 1)
        self.path.write_text(json.dumps(self.doc, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
