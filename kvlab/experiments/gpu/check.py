"""The prepared GPU check (run it through experiments/gpu_check.sh): one JSON with every part's result.

Each part runs in its own subprocess with its own timeout (a sticky CUDA error or a hang loses that part
only) and records ok/error; the JSON is rewritten after every part, so even a killed run leaves what it had.
Two selections of the same parts: the check (default, under 8 minutes: gpu_check.json) and --first-contact
(the short first session, about 90 s: first_contact.json); --parts picks any. The parts, in the order they run
(the deliberate fault always last):
  environment      versions, the driver, MINIMUM and RECOMMENDED granularity, the device   (both)
  unmapped_view    a torch tensor over a reservation with nothing mapped                   (first contact)
  vmm_round_trip   map, write, unmap, remap at a new address, read back; a worker thread  (first contact)
  vmm_latency      per-call latency of the VMM calls, the driver used directly             (first contact)
  cuda_vmm         vmm/drivers/cuda.py: latency through its checked call, zero-copy views  (check)
  vmm_sizes        map / set-access / unmap per call against range size, 1..512 x 2 MiB;  (both)
                   set-access and unmap per page vs per run: the driver's measured:FILE
  kernel_costs     kvlab's Triton kernel paged vs contiguous (same kernel), Llama-3-8B     (check)
                   bf16, batch x context x block: the kernel term's measured:FILE
  background_map   decode step time while a thread maps 2 MiB pages, and without          (check)
  layer_layout     a step's attention, per-layer vs cross-layer layout on 2 MiB pages      (check)
  handoff_copy     export/import/map per page vs device copies of scattered/contiguous KV (check)
  vmm_cache        one vmm cache's prefill and decode in fp16 and bf16 against fp32 SDPA   (first contact)
  triton_vs_sdpa   the compiled Triton paged kernel against SDPA, timed beside it (--parts)
  triton_kernel    the same kernel on first contact's three cases                          (first contact)
  vmm_vs_paged     the tiny model through the LLM API on cuda                              (check)
  elastic_cuda     the elastic backend on the CUDA driver: its block pool's chunks follow  (check)
                   the blocks; greedy tokens equal paged's (experiments/gpu/parts_elastic.py)
  gpu_tests        pytest -m gpu                                                           (check)
  cuda_pool        the pool's CUDA chunks shared by two processes: export, import, map,    (check)
                   write in one, read in the other, tear down (experiments/gpu/parts_pool.py)
  cuda_pool_engines two tiny engines in two processes on one CUDA pool: the tokens of one    (check)
                   engine alone, nothing left after (experiments/gpu/parts_pool_engines.py)
  unmapped_access  a driver copy from, then a kernel read of, an unmapped page (faults)    (both)

Whether a GPU is present is decided before any part runs (experiments/gpu/detect.py), never by a part's
result. Without a GPU the check fails loudly (exit 2) unless --dry-run-cpu asks for the dry run: every part as
far as a CPU allows, the driver calls against the recording fake (tests/fakes/fake_cuda.py), the Triton kernel
in its interpreter on tiny shapes, the bench on cpu. Numbers from a dry run check the plumbing, not a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlab.experiments.gpu import (
    parts_background,
    parts_driver,
    parts_elastic,
    parts_engine,
    parts_handoff,
    parts_kernels,
    parts_layout,
    parts_pool,
    parts_pool_engines,
    parts_triton,
    parts_vmm_sizes,
)
from kvlab.experiments.gpu.detect import detect_gpu
from kvlab.experiments.gpu.harness import ROOT, CheckDoc, run_one, run_part

PARTS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "environment": parts_driver.part_environment, "unmapped_view": parts_driver.part_unmapped_view,
    "vmm_round_trip": parts_driver.part_vmm_round_trip, "vmm_latency": parts_driver.part_vmm_latency,
    "cuda_vmm": parts_engine.part_cuda_vmm, "vmm_sizes": parts_vmm_sizes.part_vmm_sizes,
    "kernel_costs": parts_kernels.part_kernel_costs, "background_map": parts_background.part_background_map,
    "layer_layout": parts_layout.part_layer_layout, "handoff_copy": parts_handoff.part_handoff_copy,
    "vmm_cache": parts_engine.part_vmm_cache,
    "triton_vs_sdpa": parts_triton.part_triton_vs_sdpa, "triton_kernel": parts_triton.part_triton_kernel,
    "vmm_vs_paged": parts_engine.part_vmm_vs_paged, "elastic_cuda": parts_elastic.part_elastic_cuda,
    "gpu_tests": parts_engine.part_gpu_tests,
    "cuda_pool": parts_pool.part_cuda_pool, "cuda_pool_engines": parts_pool_engines.part_cuda_pool_engines,
    "unmapped_access": parts_driver.part_unmapped_access,
}
# each part's own timeout; first compiles of the Triton kernel take tens of seconds each (cached on disk). The
# measuring parts stop adding points at 75% of theirs (timing.part_deadline) and keep what they measured.
PART_SECONDS = {"environment": 60, "unmapped_view": 15, "vmm_round_trip": 20, "vmm_latency": 20, "cuda_vmm": 45,
                "vmm_sizes": 40, "kernel_costs": 110, "background_map": 45, "layer_layout": 60, "handoff_copy": 40,
                "vmm_cache": 30, "triton_vs_sdpa": 110, "triton_kernel": 60, "vmm_vs_paged": 90,
                "elastic_cuda": 30, "gpu_tests": 120, "cuda_pool": 75, "cuda_pool_engines": 100,
                "unmapped_access": 25}


@dataclass(frozen=True)
class Selection:
    name: str
    parts: tuple[str, ...]
    total_seconds: int       # the shell wrapper kills everything at 475 s; the brief allows 8 minutes
    json_name: str


# The parts that settle the simulator's unknowns run first, so a check cut at its budget keeps them.
CHECK = Selection("check", ("environment", "cuda_vmm", "vmm_sizes", "kernel_costs", "background_map", "layer_layout",
                            "handoff_copy", "vmm_vs_paged", "elastic_cuda", "gpu_tests", "cuda_pool",
                            "cuda_pool_engines", "unmapped_access"), 450, "gpu_check.json")
FIRST_CONTACT = Selection("first-contact", ("environment", "unmapped_view", "vmm_round_trip", "vmm_latency",
                                            "vmm_sizes", "vmm_cache", "triton_kernel", "unmapped_access"), 150,
                          "first_contact.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run-cpu", action="store_true", help="run every part on CPU (fake driver, interpreter)")
    p.add_argument("--first-contact", action="store_true",
                   help=f"the short first session: {', '.join(FIRST_CONTACT.parts)} (writes first_contact.json)")
    p.add_argument("--out", type=Path, help="JSON path (default $OUT/gpu_check.json, else results/gpu_check.json; "
                                            "first_contact.json with --first-contact)")
    p.add_argument("--parts", help=f"comma list of: {', '.join(PARTS)} (default: the selection's)")
    p.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.part:
        return run_one(PARTS[args.part], args.dry_run_cpu, args.part_out)
    selection = FIRST_CONTACT if args.first_contact else CHECK
    names = [n.strip() for n in args.parts.split(",") if n.strip()] if args.parts else list(selection.parts)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"gpu_check: error: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}",
              file=sys.stderr)
        return 2
    return run_check(names, selection, args.dry_run_cpu, args.out or default_out(selection.json_name))


def default_out(name: str) -> Path:
    return Path(os.environ["OUT"]) / name if os.environ.get("OUT") else ROOT / "results" / name


def run_check(names: list[str], selection: Selection, dry: bool, out_file: Path) -> int:
    """Every named part in registry order (the environment first, the fault last), within the selection's
    total budget; exit 2 without a GPU unless this is the dry run."""
    out_file.parent.mkdir(parents=True, exist_ok=True)
    check = CheckDoc(out_file, dry, selection.name)
    if not dry and not gpu_found(check):
        return 2
    check.doc["why"] = "--dry-run-cpu" if dry else "; ".join(check.doc["gpu"]["evidence"])
    check.save()
    for name in sorted(set(names) | {"environment"}, key=list(PARTS).index):
        check.record(name, timed_part(name, dry, selection.total_seconds - check.elapsed()))
    parts = check.doc["parts"]
    print(f"gpu_check ({check.doc['mode']}, {selection.name}): {sum(p['ok'] for p in parts.values())}/{len(parts)} "
          f"parts ok, {check.doc['seconds']} s, written to {out_file}")
    return 0 if all(p["ok"] for p in parts.values()) else 1


def gpu_found(check: CheckDoc) -> bool:
    gpu = detect_gpu()
    check.doc["gpu"] = gpu
    if gpu["present"]:
        return True
    check.doc.update(mode="no-gpu", why="no GPU found: " + "; ".join(gpu["evidence"]))
    check.save()
    print(f"gpu_check: error: no GPU found ({'; '.join(gpu['evidence'])}); pass --dry-run-cpu for the CPU dry run",
          file=sys.stderr)
    return False


def timed_part(name: str, dry: bool, left: float) -> dict[str, Any]:
    if left < 10:
        return {"ok": False, "error": "not run: the check's time budget is spent"}
    print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
    result = run_part(name, dry, min(PART_SECONDS[name], left))
    print(f"gpu_check: {name} {'ok' if result['ok'] else 'FAILED: ' + result['error']} ({result.get('seconds')} s)",
          file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
