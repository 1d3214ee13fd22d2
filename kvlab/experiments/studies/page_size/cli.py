"""`kvlab study page-size`: the flags, read once into StudySettings; the table and the verdict."""
from __future__ import annotations

import argparse
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_REQUESTS
from kvlab.common.validate import check_int
from kvlab.experiments.cli import flags
from kvlab.experiments.sim.kernels import CHOICES, kernel_profile
from kvlab.experiments.sim.roofline import HARDWARE, hardware, model_spec
from kvlab.experiments.sim.serve import slo
from kvlab.experiments.sim.serve.costs import PROFILES
from kvlab.experiments.sim.serve.run import ServeSpec
from kvlab.experiments.studies.page_size.settings import Cell, StudySettings

DEFAULT_SLO = "p99_ttft_ms<=2000,p99_tpot_ms<=100"


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
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=1024, help="random dataset")
    p.add_argument("--output-len", type=int, default=128, help="random dataset")
    p.add_argument("--slo", type=flags.arg_type(slo.parse_slo), default=slo.parse_slo(DEFAULT_SLO),
                   help=f"targets the rate must meet (default {DEFAULT_SLO})")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=3, help="paired seeds SEED..SEED+K-1")
    p.add_argument("--budget-gb", type=float, default=8.0, help="KV budget per GPU in GB (1e9 bytes)")
    p.add_argument("--paged-blocks", type=flags.parse_list, default=["16", "32", "128"], help="tokens per block")
    p.add_argument("--vmm-pages", type=parse_pages, default=[64 * 1024, 256 * 1024, 2 * 1024 ** 2],
                   help="page sizes, comma list (default 64KiB,256KiB,2MiB)")
    p.add_argument("--driver-costs", type=flags.parse_list, default=["cuda-h200"],
                   help=f"driver profiles, comma list of {', '.join([*PROFILES, 'host'])}")
    p.add_argument("--calibration", help="host profile: `kvlab calibrate`'s JSON")
    p.add_argument("--kernel-costs", type=flags.parse_list, default=["published"],
                   help=f"kernel profiles, comma list of {CHOICES} (docs/kernel-costs.md)")
    p.add_argument("--prefix-caching", choices=("off", "on", "both"), default="off", help="an optional axis")
    p.add_argument("--tensor-parallel-sizes", type=flags.parse_list, default=["1"], help="an optional axis")
    p.add_argument("--no-flips", action="store_true", help="skip the break-even searches")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (the local pool)")
    p.add_argument("--ray", metavar="ADDRESS", help="run the searches on a Ray cluster (`local`: start one here)")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/<timestamp>/)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def parse_pages(text: str) -> list[int]:
    pages = [flags.parse_bytes(item) for item in flags.parse_list(text)]
    if len(set(pages)) < len(pages) or min(pages, default=1) <= 0:     # each size is one column of the study
        raise argparse.ArgumentTypeError(f"distinct page sizes of at least 1 byte, each once, got {text[:80]}")
    return pages


def positive_ints(flag: str, items: list[str]) -> tuple[int, ...]:
    if not all(i.isdigit() and int(i) > 0 for i in items) or len(set(map(int, items))) < len(items):
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
    if driver_costs not in (*PROFILES, "host"):
        raise ConfigError(f"unknown --driver-costs {driver_costs!r}; choose {', '.join([*PROFILES, 'host'])}")


def settings_from(args: argparse.Namespace) -> StudySettings:
    """The one place the study's flags are read; checked before anything runs."""
    spec = ServeSpec(dataset=args.dataset, num_requests=args.num_prompts, input_len=args.input_len,
                     output_len=args.output_len, hardware=args.hardware, model=args.model, model_prefill=True,
                     calibration=args.calibration)
    checked_cells = cells(args)           # checks --seeds too: before the range of seeds is built
    return StudySettings(spec, args.slo, tuple(range(args.seed, args.seed + args.seeds)), checked_cells,
                         positive_ints("--paged-blocks", args.paged_blocks), tuple(args.vmm_pages), args.budget_gb,
                         flips=not args.no_flips, jobs=args.jobs, ray=args.ray, progress=not args.no_progress,
                         out=args.out, save=not args.no_save, plots=not args.no_plots)


def run(args: argparse.Namespace) -> int:
    from kvlab.experiments.studies.page_size.output import save
    from kvlab.experiments.studies.page_size.report import report
    from kvlab.experiments.studies.page_size.study import run_study
    s = settings_from(args)
    result = run_study(s)
    text = report(s, result)
    print(text)
    if s.save:
        print(f"results in {save(s, result, text)}/")
    return 0
