"""`kvlab study pool`: the flags, read once into PoolStudySettings and checked before any server starts; the
table, the files and the share plot."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_MODEL_LEN, check_seed
from kvlab.common.loader import locate
from kvlab.common.machine import check_fits_in_ram
from kvlab.common.validate import check_int, check_number, check_output_path, shown
from kvlab.experiments.cli import flags
from kvlab.experiments.loadgen import checks, latency
from kvlab.experiments.loadgen.load_run import LoadSpec
from kvlab.experiments.loadgen.multi import MultiSpec, model_plans
from kvlab.experiments.loadgen.multi_cli import MAX_MODELS, add_phase_flags, phases_from
from kvlab.experiments.studies.pool.settings import BASELINE, CONFIGURATIONS, PoolStudySettings

POOL_PAGE = 64 * 1024            # the pool's, vmm's and elastic's default page: every split is whole pages
DEFAULT_SLO = ["ttft:1000", "tpot:100"]


def add_study(which: Any) -> None:
    p = which.add_parser("pool", help="one shared KV pool for vmm (or elastic) servers vs static splits, "
                                      "phase-shifted bursts",
                         description="The same KV memory as (a) one shared pool for N vmm servers, (b) a static "
                                     "equal split for N paged servers, (c) the same for vmm, (d) for reserve, (e) "
                                     "one shared pool for N elastic servers (paged kernels over the pool's pages); "
                                     "the same phase-shifted bursts against each, repeated with the order "
                                     "alternated; p99 TTFT/TPOT and SLO attainment per model (docs/pool-ab.md).")
    p.add_argument("--engines", type=int, default=3, help="servers (models) per configuration")
    p.add_argument("--total-bytes", type=flags.parse_bytes, default=9 * 2**20,
                   help="the KV memory every configuration shares out (default 9MiB)")
    p.add_argument("--configurations", type=flags.parse_list, default=list(CONFIGURATIONS),
                   help=f"comma list of {','.join(CONFIGURATIONS)} (must include the baseline {BASELINE})")
    p.add_argument("--repeats", type=int, default=3, help="paired repeats, the order reversed on odd ones")
    p.add_argument("--model", default="tiny", help="the kvlab model every server serves")
    p.add_argument("--max-model-len", type=int, default=256, help="every server's, so reserve's split is fair")
    p.add_argument("--random-input-len", dest="input_len", type=int, default=128)
    p.add_argument("--random-output-len", dest="output_len", type=int, default=64)
    p.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=0.25)
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps in a burst (1 = Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", default=DEFAULT_SLO,
                   help=f"SLOs, vllm bench serve's syntax (default {' '.join(DEFAULT_SLO)})")
    add_phase_flags(p)
    p.add_argument("--server-args", default="", help="extra `kvlab serve` flags for every server, one string")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds for a configuration's servers to start")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/pool-ab-<timestamp>)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run, dataset="random", prefix_len=0, burst_rate=6.0, period=12.0, duty_cycle=0.5)


def configurations(keys: list[str]) -> tuple:
    unknown = [k for k in keys if k not in CONFIGURATIONS]
    if unknown or len(set(keys)) < len(keys) or BASELINE not in keys:
        raise ConfigError(f"--configurations takes distinct letters of {','.join(CONFIGURATIONS)} including the "
                          f"baseline {BASELINE}, got {','.join(keys)}")
    return tuple(CONFIGURATIONS[k] for k in keys)


STUDY_OWNED = ("--backend", "--kv-cache-bytes", "--kv-pool", "--kv-pool-bytes", "--max-model-len", "--model",
               "--port", "--host")    # each server's flags the study sets itself


def check_memory(total: int, engines: int) -> int:
    total = check_int("--total-bytes", total, engines * POOL_PAGE, 1 << 50)
    if total % (engines * POOL_PAGE):
        raise ConfigError(f"--total-bytes {total:,} must be a multiple of --engines x 64 KiB "
                          f"({engines * POOL_PAGE:,}), so every split is whole pages")
    check_fits_in_ram("--total-bytes", total, "lower --total-bytes")
    return total


def load_spec(args: argparse.Namespace) -> LoadSpec:
    max_len = check_int("--max-model-len", args.max_model_len, 2, MAX_MODEL_LEN)
    input_len = check_int("--random-input-len", args.input_len, 1, max_len)
    output_len = check_int("--random-output-len", args.output_len, 1, max_len)
    ratio = check_number("--random-range-ratio", args.range_ratio, 0.0, 0.99)
    if (input_len + output_len) * (1 + ratio) > max_len:
        raise ConfigError(f"the longest request ((input + output) x (1 + range ratio) = "
                          f"{(input_len + output_len) * (1 + ratio):.0f} tokens) exceeds --max-model-len {max_len}")
    burstiness = check_number("--burstiness", args.burstiness, checks.MIN_BURSTINESS, checks.MAX_BURSTINESS)
    latency.parse_goodput(args.goodput)
    return LoadSpec("random", 1, check_seed("--seed", args.seed), 1024, 1.0, input_len, output_len, ratio,
                    burstiness, None, args.model, tuple(args.goodput), latency.METRICS, ("50", "99"))


def settings_from(args: argparse.Namespace) -> PoolStudySettings:
    """The one place the study's flags are read; everything checked before a server starts."""
    engines = check_int("--engines", args.engines, 2, MAX_MODELS)
    total = check_memory(args.total_bytes, engines)
    load = load_spec(args)
    multi = MultiSpec(phases_from(args, engines, load), load)
    model_plans(multi)                                  # every model gets requests, before any server starts
    locate(args.model)                                  # a model no server could load, before any starts
    extra = checks.split_server_args(args.server_args)
    owned = next((a for a in extra if a.split("=")[0] in STUDY_OWNED), None)
    if owned is not None:
        raise ConfigError(f"--server-args {shown(owned)}: the study sets that flag on every server itself")
    server_args = ("--max-model-len", str(args.max_model_len), *extra)
    if args.out is not None:
        check_output_path("--out", args.out, directory=True)
    return PoolStudySettings(multi, total, configurations(args.configurations),
                             check_int("--repeats", args.repeats, 1, 100), args.model, server_args,
                             check_number("--start-timeout", args.start_timeout, 0.0, 3600.0, strict=True,
                                          unit=" s"), args.out, not args.no_progress)


def run(args: argparse.Namespace) -> int:
    from kvlab.experiments.studies.pool.study import execute
    return execute(settings_from(args), "kvlab " + shlex.join(sys.argv[1:]))
