"""`kvlab study page-size`: the flags, read once into StudySettings; the table and the verdict."""
from __future__ import annotations

import argparse
import math
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_int, is_digits
from kvlab.experiments.cli import flags
from kvlab.experiments.limits import MAX_REQUESTS
from kvlab.experiments.sim.kernels import CHOICES, kernel_profile
from kvlab.experiments.sim.layouts import add_layout_flags, check_layout
from kvlab.experiments.sim.roofline import HARDWARE, hardware, model_spec
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.sim.serve.costs import PROFILES, known_profile
from kvlab.experiments.sim.serve.run import ServeSpec
from kvlab.experiments.studies.page_size.settings import Cell, StudySettings

DEFAULT_SLO = "p99_ttft_ms<=2000,p99_tpot_ms<=100"
DEFAULT_REQUESTS = 1000          # p99 is then the 10th-slowest request, not the slowest
DEFAULT_RATIOS = "1,1.5,2"


def add_study(which: Any) -> None:
    p = which.add_parser("page-size", help="paged block vs vmm page size: SLO rate, throughput, break-evens",
                         description="For a model, hardware, workload and SLO: the highest rate meeting the SLO "
                                     "and the throughput of each paged block size and vmm page size, and for each "
                                     "vmm page size the kernel advantage and driver latency that flip the answer "
                                     "(docs/study.md).")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--hardware", default="h100", help=f"one of {', '.join(HARDWARE)}")
    p.add_argument("--dataset", default="seed", help="seed | random | trace:FILE.jsonl | prefix:system|multiturn|"
                                                     "fewshot")
    p.add_argument("--num-prompts", type=int, default=DEFAULT_REQUESTS, help="requests a run")
    p.add_argument("--input-len", type=int, default=1024, help="random dataset")
    p.add_argument("--output-len", type=int, default=128, help="random dataset")
    p.add_argument("--slo", type=flags.arg_type(slo.parse_slo), default=slo.parse_slo(DEFAULT_SLO),
                   help=f"targets the rate must meet (default {DEFAULT_SLO})")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=3, help="paired seeds SEED..SEED+K-1")
    p.add_argument("--budget-gb", type=float, default=8.0, help="KV budget per GPU in GB (1e9 bytes)")
    p.add_argument("--paged-blocks", type=flags.parse_list, default=["16", "128"],
                   help="tokens per block, comma list (default 16,128)")
    p.add_argument("--vmm-pages", type=parse_pages, default=[2 * 1024 ** 2],
                   help="page sizes, comma list (default 2MiB: the only size stock CUDA maps and the driver "
                        "figures were measured at; 64KiB,256KiB use them extrapolated, docs/evidence.md)")
    p.add_argument("--driver-costs", type=flags.parse_list, default=["cuda-a100"],
                   help=f"driver profiles, comma list of {', '.join([*PROFILES, 'host'])}")
    p.add_argument("--calibration", help="host profile: `kvlab calibrate`'s JSON")
    p.add_argument("--kernel-costs", type=flags.parse_list, default=["central"],
                   help=f"kernel profiles, comma list of {CHOICES} (docs/evidence.md)")
    p.add_argument("--kernel-ratios", type=parse_ratios, default=parse_ratios(DEFAULT_RATIOS),
                   help="the curve's paged/contiguous decode kernel ratios at 16-token blocks (default "
                        f"{DEFAULT_RATIOS})")
    p.add_argument("--background-mapping", choices=("on", "off"), default="on",
                   help="vmm maps on a background thread, overlapped with the step (vAttention's step_async)")
    add_layout_flags(p, "each vmm page size")
    p.add_argument("--elastic-blocks", type=flags.parse_list, default=[],
                   help="an optional arm: elastic (paged blocks and kernels over pages mapped on demand) at these "
                        "block sizes, comma list, each over each --vmm-pages size; splits layout from elasticity "
                        "(default: none)")
    p.add_argument("--prefix-caching", choices=("off", "on", "both"), default="off", help="an optional axis")
    p.add_argument("--tensor-parallel-sizes", type=flags.parse_list, default=["1"], help="an optional axis")
    p.add_argument("--no-flips", action="store_true", help="skip the kernel-ratio curve (the grid only)")
    p.add_argument("--driver-flips", action="store_true", help="also search each vmm unit's driver-latency flip")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (the local pool)")
    p.add_argument("--ray", metavar="ADDRESS", help="run the searches on a Ray cluster (`local`: start one here)")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/<timestamp>/)")
    p.add_argument("--resume", metavar="DIR", help="finish an interrupted study in DIR with its own settings")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def parse_ratios(text: str) -> list[float]:
    try:
        ratios = sorted({float(item) for item in flags.parse_list(text)})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of numbers: {text[:80]!r}") from None
    if not ratios or not all(math.isfinite(r) and 1.0 <= r <= 100.0 for r in ratios):
        raise argparse.ArgumentTypeError("kernel ratios lie in [1, 100]")
    return ratios


def parse_pages(text: str) -> list[int]:
    pages = [flags.parse_bytes(item) for item in flags.parse_list(text)]
    if len(set(pages)) < len(pages) or min(pages, default=1) <= 0:     # each size is one column of the study
        raise argparse.ArgumentTypeError(f"distinct page sizes of at least 1 byte, each once, got {text[:80]}")
    return pages


def positive_ints(flag: str, items: list[str]) -> tuple[int, ...]:
    if not all(is_digits(i) and int(i) > 0 for i in items) or len(set(map(int, items))) < len(items):
        raise ConfigError(f"{flag} takes distinct positive integers, got {','.join(items)[:80]}")
    return tuple(int(i) for i in items)


def cells(args: argparse.Namespace) -> tuple[Cell, ...]:
    for kernel in args.kernel_costs:
        kernel_profile(kernel)
    tps = positive_ints("--tensor-parallel-sizes", args.tensor_parallel_sizes)
    prefix = {"off": (False,), "on": (True,), "both": (False, True)}[args.prefix_caching]
    for driver in args.driver_costs:
        for tp in tps:
            check_cell(args.hardware, args.model, tp, driver)
    check_int("--seeds", args.seeds, 1, 1000)
    check_int("--num-prompts", args.num_prompts, 1, MAX_REQUESTS)
    return tuple(Cell(d, k, tp, p) for d in args.driver_costs for k in args.kernel_costs for tp in tps
                 for p in prefix)


def check_cell(hardware_name: str, model: str, tp: int, driver_costs: str) -> None:
    """One cell's hardware, model at its TP degree and driver profile exist, before anything runs."""
    hardware(hardware_name)
    check_int("--tensor-parallel-sizes", tp, 1, 1024)
    model_spec(model, tp=tp)
    if not known_profile(driver_costs):
        raise ConfigError(f"unknown --driver-costs {driver_costs!r}; choose {', '.join([*PROFILES, 'host'])}")


def settings_from(args: argparse.Namespace) -> StudySettings:
    """The one place the study's flags are read; checked before anything runs."""
    spec = ServeSpec(dataset=args.dataset, num_requests=args.num_prompts, input_len=args.input_len,
                     output_len=args.output_len, hardware=args.hardware, model=args.model, model_prefill=True,
                     calibration=args.calibration, background_mapping=args.background_mapping == "on",
                     layout_penalty=args.layout_penalty)
    layouts = tuple(dict.fromkeys(check_layout(name) for name in args.vmm_layout))
    checked_cells = cells(args)           # checks --seeds too: before the range of seeds is built
    return StudySettings(spec, args.slo, tuple(range(args.seed, args.seed + args.seeds)), checked_cells,
                         positive_ints("--paged-blocks", args.paged_blocks), tuple(args.vmm_pages), layouts,
                         positive_ints("--elastic-blocks", args.elastic_blocks), args.budget_gb,
                         flips=not args.no_flips, kernel_ratios=tuple(args.kernel_ratios),
                         driver_flips=args.driver_flips, jobs=args.jobs, ray=args.ray,
                         progress=not args.no_progress, out=args.out, save=not args.no_save,
                         plots=not args.no_plots)


def run(args: argparse.Namespace) -> int:
    from kvlab.experiments.studies.page_size.session import run_session
    return run_session(args, settings_from)
