"""`kvlab simulate pd`: prefill/decode disaggregation against colocated engines on as many GPUs, the KV handoff a
copy over NVLink or PCIe (paged) or a remap (vmm); the handoff table by context length, figures at given rates,
or an SLO search on the request rate with bootstrap intervals over seeds."""
from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_int, check_number
from kvlab.experiments.cli import flags
from kvlab.experiments.limits import MAX_REQUESTS, MAX_SPAN_S
from kvlab.experiments.loadgen.sweep import parse_rates
from kvlab.experiments.reporting.tables import table
from kvlab.experiments.sim.gpu_figures import LINKS, MEMORY_UTILIZATION, kv_budget_gb, link
from kvlab.experiments.sim.pd.handoff import Handoff
from kvlab.experiments.sim.pd.run import PdSpec, Setup, run_point
from kvlab.experiments.sim.results import save
from kvlab.experiments.sim.roofline import model_spec
from kvlab.experiments.sim.serve import slo, summary
from kvlab.experiments.sim.serve.cli import check_run_flags
from kvlab.experiments.sim.serve.costs import PROFILES, profile
from kvlab.experiments.sim.serve.grid import pool_map
from kvlab.experiments.sim.serve.run import ServeSpec, parse_backends
from kvlab.experiments.sim.serve.stats import spread

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
FIGURES = ("p99_ttft_ms", "p99_tpot_ms", "output_throughput", "request_goodput")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("pd", help="prefill/decode disaggregation against colocated engines, KV handoff "
                                         "copied (paged) or remapped (vmm)",
                              description="P prefill and D decode engines (one GPU each) against P + D colocated "
                                          "engines; the handoff a copy over a link or a page remap.")
    p.add_argument("--prefill", type=int, default=1, help="prefill engines (GPUs)")
    p.add_argument("--decode", type=int, default=1, help="decode engines (GPUs)")
    p.add_argument("--backends", type=flags.parse_list, default=["paged-16", "vmm-2MiB"],
                   help="comma list: paged-BLOCK (handoff: a copy over each --links), vmm-SIZE (handoff: remap)")
    p.add_argument("--links", type=flags.parse_list, default=list(LINKS), help=f"copy links: {', '.join(LINKS)}")
    p.add_argument("--handoff-table", action="store_true",
                   help="print the handoff time by context length and backend, and exit")
    p.add_argument("--budget-gb", type=float, help="KV GB per GPU (default: the GPU's memory x "
                                                   f"{MEMORY_UTILIZATION} less the weights)")
    p.add_argument("--request-rates", type=flags.parse_list, default=["8"], help="comma list of req/s")
    p.add_argument("--num-prompts", type=int, default=1000)
    flags.add_fleet_workload_flags(p)
    p.add_argument("--driver-costs", default="cuda-a100", help=" | ".join(PROFILES))
    p.add_argument("--slo", type=flags.arg_type(slo.parse_slo), help="search the highest rate meeting e.g. "
                                                                    "p99_ttft_ms<=2000,p99_tpot_ms<=100")
    flags.add_search_run_flags(p)
    p.set_defaults(run=run)


@dataclass(frozen=True)
class PdSettings:
    spec: PdSpec
    setups: tuple[Setup, ...]
    links: tuple[str, ...]
    budget_gb: float
    rates: tuple[float, ...]
    seeds: tuple[int, ...]
    slo: dict[str, float]
    slo_start: float
    slo_tolerance: float
    handoff_table: bool
    jobs: int
    progress: bool
    out: str | None
    save: bool


def settings_from(args: argparse.Namespace) -> PdSettings:
    check_int("--prefill", args.prefill, 1, 64)
    check_int("--decode", args.decode, 1, 64)
    check_int("--num-prompts", args.num_prompts, 1, MAX_REQUESTS)
    for flag in ("--max-len", "--input-len", "--output-len"):
        check_int(flag, getattr(args, flag[2:].replace("-", "_")), 1, 1 << 20, " (tokens per sequence)")
    check_number("--burstiness", args.burstiness, low=1e-3, high=1e3)
    check_number("--scale", args.scale, strict=True, high=1e6)
    if args.driver_costs not in PROFILES:
        raise ConfigError(f"unknown --driver-costs {args.driver_costs!r}; choose {', '.join(PROFILES)}")
    links = tuple(link(name).name for name in args.links)
    args.budget_gb = kv_budget_gb(args.hardware, args.model, 1) if args.budget_gb is None else args.budget_gb
    args.slo = args.slo or {}
    check_run_flags(args)
    rates = tuple(parse_rates(list(args.request_rates)))
    for rate in rates:
        check_number("--request-rates", rate, strict=True, high=1e5, unit=" req/s")
        if args.num_prompts / rate > MAX_SPAN_S:
            raise ConfigError(f"--request-rates {rate:g}/s spreads {args.num_prompts:,} requests over "
                              f"~{args.num_prompts / rate:.3g} s, more than the maximum {MAX_SPAN_S:g} s (a week)")
    if args.out is not None and not args.no_save:
        flags.check_output_path(args.out, "--out", directory=True)
    serve = ServeSpec(dataset=args.dataset, num_requests=args.num_prompts, scale=args.scale, max_len=args.max_len,
                      input_len=args.input_len, output_len=args.output_len, burstiness=args.burstiness,
                      hardware=args.hardware, model=args.model, model_prefill=True, mfu=args.mfu,
                      driver_profile=args.driver_costs)
    setups = tuple(setups_of(parse_backends(list(args.backends), args.budget_gb, args.watermark), links,
                             args.driver_costs))
    return PdSettings(PdSpec(serve, args.prefill, args.decode), setups, links, args.budget_gb, rates,
                      tuple(range(args.seed, args.seed + args.seeds)), dict(args.slo), args.slo_start,
                      args.slo_tolerance, args.handoff_table, args.jobs, not args.no_progress, args.out,
                      not args.no_save)


def setups_of(cases: list[Any], links: tuple[str, ...], driver_costs: str) -> list[Setup]:
    """Each backend colocated, then disaggregated: paged copied over every link, vmm remapped."""
    out = []
    for case in cases:
        if case.policy not in ("paged", "vmm"):
            raise ConfigError(f"--backends {case.backend_label}: simulate pd compares paged (copy) and vmm (remap)")
        out.append(Setup(case))
        if case.policy == "paged":
            out += [Setup(case, name) for name in links]
        else:
            profile(driver_costs, None, case.options["page_size"])
            out.append(Setup(case, "remap"))
    return out


def _point(a: tuple) -> dict[str, Any]:
    return run_point(*a)


def _search(a: tuple[Setup, PdSpec, int, dict[str, float], float, float]) -> dict[str, Any]:
    setup, spec, seed, target, start, tol = a
    found = slo.search(lambda rate: run_point(setup, spec, rate, seed), target, start, tol, high_limit=1e4)
    return {"setup": setup.label, "seed": seed, "slo_rate": found.rate, "evaluations": found.evaluations,
            "at_slo_rate": found.results.get(found.rate, {})}


def run(args: argparse.Namespace) -> int:
    return simulate_pd(settings_from(args))


def simulate_pd(s: PdSettings) -> int:
    t0 = time.perf_counter()
    text = handoff_table(s)
    if s.handoff_table:
        print(text)
        return 0
    labels = [x.label for x in s.setups]
    if s.slo:
        searches = pool_map(_search, [(x, s.spec, seed, s.slo, s.slo_start, s.slo_tolerance) for x in s.setups
                                      for seed in s.seeds], s.jobs, s.progress, unit="search")
        per = {label: [f["slo_rate"] for f in searches if f["setup"] == label] for label in labels}
        result = {"slo": s.slo, **summary.slo_summary(per, labels[0]), "searches": searches}
        text += "\n\n" + slo_table(result, searches, s)
    else:
        rows = pool_map(_point, [(x, s.spec, rate, seed) for x in s.setups for rate in s.rates
                                 for seed in s.seeds], s.jobs, s.progress)
        result = {"runs": rows}
        text += "\n\n" + grid_table(rows, s)
    print(text)
    print(f"\n{time.perf_counter() - t0:.1f} s host time")
    if s.save:
        meta = {"spec": dataclasses.asdict(s.spec), "setups": labels, "budget_gb": s.budget_gb,
                "seeds": list(s.seeds)}
        print(f"results in {save(s.out, 'simulate pd', 'sim_pd.json', meta, result, text)}/")
    return 0


def handoff_table(s: PdSettings) -> str:
    """Handoff time (ms) and bytes copied by context length, for every setup's handoff."""
    model = model_spec(s.spec.serve.model)
    columns = []
    for x in s.setups:
        if x.handoff == "remap":
            page = x.case.options["page_size"]
            columns.append((x.label, Handoff(model, page_size=page, costs=profile(s.spec.serve.driver_profile,
                                                                                  None, page))))
        elif x.handoff is not None:
            columns.append((x.label, Handoff(model, link=link(x.handoff))))
    body = [[f"{tokens:,}", f"{tokens * model.kv_bytes_per_token / 1e9:.3g}",
             *(f"{h.seconds(tokens) * 1e3:.3g} ms / {h.bytes_copied(tokens) / 1e9:.3g} GB" for _, h in columns)]
            for tokens in CONTEXTS]
    sources = "; ".join(LINKS[name].source for name in s.links)
    costs = s.spec.serve.driver_profile
    return table(["context", "KV GB", *(label for label, _ in columns)], body,
                 f"KV handoff per request, {model.name}: time / bytes copied. Copies at the link's one-way peak "
                 f"({sources}); remaps at {costs} ({PROFILES[costs].source})"
                 ": cuMemMap per page + cuMemSetAccess per tensor")


def setting_line(s: PdSettings) -> str:
    v = s.spec
    return (f"{v.prefill} prefill + {v.decode} decode GPUs against {v.prefill + v.decode} colocated, "
            f"{v.serve.model} on {v.serve.hardware}, {s.budget_gb:.1f} GB KV per GPU, {v.serve.num_requests} "
            f"{v.serve.dataset} requests, Poisson arrivals")


def cell(runs: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "-"
    sp = spread(values)
    return f"{sp['mean']:.4g}" if sp["n"] == 1 else f"{sp['mean']:.4g} ± {sp['std']:.2g}"


def grid_table(rows: list[dict[str, Any]], s: PdSettings) -> str:
    body = [[x.label, f"{rate:g}", *(cell([r for r in rows if r["setup"] == x.label and r["request_rate"] == rate],
                                          key) for key in FIGURES)] for x in s.setups for rate in s.rates]
    return table(["setup", "rate", *FIGURES], body, setting_line(s) + " (mean ± std over seeds)")


def slo_table(result: dict[str, Any], searches: list[dict[str, Any]], s: PdSettings) -> str:
    body = []
    for label, r in result["backends"].items():
        ratio = result["ratios"].get(label)
        rel = f"{ratio['ratio']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]" if ratio else "1 (reference)"
        at = [f["at_slo_rate"] for f in searches if f["setup"] == label]
        body.append([label, f"{r['slo_rate']:.3g}", f"[{r['ci95'][0]:.3g}, {r['ci95'][1]:.3g}]", rel,
                     cell(at, "p99_ttft_ms"), cell(at, "p99_tpot_ms")])
    goal = ", ".join(f"{k} <= {v:g}" for k, v in s.slo.items())
    return table(["setup", "SLO rate (req/s)", "95% CI", "ratio [95% CI]", "p99 TTFT ms at it", "p99 TPOT ms at it"],
                 body, f"Highest rate with {goal}; {setting_line(s)}")
