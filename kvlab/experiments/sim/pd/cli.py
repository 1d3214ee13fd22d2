"""`kvlab simulate pd`: prefill/decode disaggregation against colocated engines on as many GPUs. Cross-device, the
KV handoff is a copy over NVLink or PCIe (paged's blocks; vmm's contiguous ranges) or, for vmm, a map of the
prefill GPU's pages read remotely every decode step; same-device (prefill and decode processes sharing one GPU), a
zero-copy remap (vmm) or a device-to-device copy (paged). The handoff table by context length, figures at given
rates, or an SLO search on the request rate with bootstrap intervals over seeds (docs/disaggregation.md)."""
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
from kvlab.experiments.loadgen.rows import parse_rates
from kvlab.experiments.reporting.checkpoint import keeping
from kvlab.experiments.reporting.tables import table
from kvlab.experiments.sim.gpu_figures import LINKS, MEMORY_UTILIZATION, kv_budget_gb, link
from kvlab.experiments.sim.layouts import check_layout
from kvlab.experiments.sim.pd.run import ARRANGEMENTS, SAME_DEVICE, PdSpec, Setup, make_handoff, run_point
from kvlab.experiments.sim.pool.cli import over_seeds
from kvlab.experiments.sim.results import report
from kvlab.experiments.sim.roofline import model_spec
from kvlab.experiments.sim.serve import slo, summary
from kvlab.experiments.sim.serve.cli import add_driver_axes, check_run_flags, checked_goodput
from kvlab.experiments.sim.serve.costs import PROFILES, extrapolated, extrapolation_note, profile
from kvlab.experiments.sim.serve.grid import Saved, pool_map, saved_points
from kvlab.experiments.sim.serve.run import ServeSpec, parse_backends
from kvlab.experiments.sim.serve.stats import spread

VMM_CROSS = ("copy", "remote")
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
    p.add_argument("--arrangements", type=flags.parse_list, default=list(ARRANGEMENTS),
                   help="comma list: cross-device (one GPU per engine) and same-device (prefill i and decode i share "
                        "GPU i's time and memory; needs --prefill = --decode)")
    p.add_argument("--vmm-handoffs", type=flags.parse_list, default=list(VMM_CROSS),
                   help="cross-device vmm handoffs, comma list: copy (contiguous ranges over the link), remote (map "
                        "the prefill GPU's pages, read them over the link every decode step)")
    p.add_argument("--transfer-overhead-us", type=float, default=0.0,
                   help="fixed cost per copy issued, microseconds (default 0: bytes only; no source yet)")
    add_driver_axes(p)
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
    p.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs for goodput: ttft:MS tpot:MS e2el:MS "
                                                                  "(as simulate serve and simulate pool)")
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
    resume: str | None = None               # the results directory of an interrupted run to finish
    argv: tuple[str, ...] = ()              # the command line, stored for --resume


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
    check_pd_axes(args)
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
                      driver_profile=args.driver_costs, background_mapping=args.background_mapping,
                      set_access=args.set_access, layout_penalty=args.layout_penalty,
                      goodput=checked_goodput(args.goodput))
    cases = parse_backends(list(args.backends), args.budget_gb, args.watermark, tuple(args.vmm_layout))
    setups = tuple(setups_of(cases, links, args.driver_costs, tuple(args.arrangements), tuple(args.vmm_handoffs)))
    spec = PdSpec(serve, args.prefill, args.decode, args.transfer_overhead_us * 1e-6)
    return PdSettings(spec, setups, links, args.budget_gb, rates,
                      tuple(range(args.seed, args.seed + args.seeds)), dict(args.slo), args.slo_start,
                      args.slo_tolerance, args.handoff_table, args.jobs, not args.no_progress, args.resume or args.out,
                      not args.no_save, args.resume, tuple(getattr(args, "command_line", ())))


def check_pd_axes(args: argparse.Namespace) -> None:
    for name in args.arrangements:
        if name not in ARRANGEMENTS:
            raise ConfigError(f"unknown --arrangements {name!r}; choose from {', '.join(ARRANGEMENTS)}")
    for name in args.vmm_handoffs:
        if name not in VMM_CROSS:
            raise ConfigError(f"unknown --vmm-handoffs {name!r}; choose from {', '.join(VMM_CROSS)}")
    for name in args.vmm_layout:
        check_layout(name)
    if SAME_DEVICE in args.arrangements and args.prefill != args.decode:
        raise ConfigError("--arrangements same-device pairs prefill i with decode i on one GPU: give --prefill = "
                          "--decode, or --arrangements cross-device")
    check_number("--transfer-overhead-us", args.transfer_overhead_us, high=1e6, unit=" us")


def setups_of(cases: list[Any], links: tuple[str, ...], driver_costs: str,
              arrangements: tuple[str, ...] = ("cross-device",), vmm_cross: tuple[str, ...] = ("copy",)
              ) -> list[Setup]:
    """Each backend colocated, then disaggregated. Cross-device: paged copied over every link, vmm copied and/or
    mapped remotely over every link. Same-device: vmm remapped, paged copied device to device."""
    out = []
    for case in cases:
        if case.policy not in ("paged", "vmm"):
            raise ConfigError(f"--backends {case.backend_label}: simulate pd compares paged (copy) and vmm "
                              "(remap, copy, remote)")
        if case.policy == "vmm":
            profile(driver_costs, None, case.options["page_size"])
        out.append(Setup(case))
        if "cross-device" in arrangements:
            kinds = ("copy",) if case.policy == "paged" else vmm_cross
            out += [Setup(case, kind, name) for kind in kinds for name in links]
        if SAME_DEVICE in arrangements:
            out.append(Setup(case, "remap" if case.policy == "vmm" else "copy", arrangement=SAME_DEVICE))
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
    saved = checkpoint_of(s)
    s = dataclasses.replace(s, out=str(saved.checkpoint.out)) if saved else s      # save() writes there too
    with keeping(saved and saved.checkpoint, "simulate pd"):
        if s.slo:
            searches = pool_map(_search, [(x, s.spec, seed, s.slo, s.slo_start, s.slo_tolerance) for x in s.setups
                                          for seed in s.seeds], s.jobs, s.progress, "search", "simulate pd", saved)
            per = {label: [f["slo_rate"] for f in searches if f["setup"] == label] for label in labels}
            result = {"slo": s.slo, **summary.slo_summary(per, labels[0]), "searches": searches}
            text += "\n\n" + slo_table(result, searches, s)
        else:
            rows = pool_map(_point, [(x, s.spec, rate, seed) for x in s.setups for rate in s.rates
                                     for seed in s.seeds], s.jobs, s.progress, desc="simulate pd", saved=saved)
            result = {"runs": rows}
            text += "\n\n" + grid_table(rows, s)
    meta = {"spec": dataclasses.asdict(s.spec), "setups": labels, "budget_gb": s.budget_gb, "seeds": list(s.seeds)}
    report(text, t0, (s.out, "simulate pd", "sim_pd.json", meta, result) if s.save else None)
    return 0


def checkpoint_of(s: PdSettings) -> Saved | None:
    """Every finished point (a run, or a whole SLO search) kept as it finishes; None with --no-save."""
    total = len(s.setups) * len(s.seeds) * (1 if s.slo else len(s.rates))
    if s.slo:
        return saved_points(s, total, lambda job: f"{job[0].label} seed {job[2]} search", RUN_ONLY)
    return saved_points(s, total, lambda job: f"{job[0].label} rate {job[2]:g} seed {job[3]}", RUN_ONLY)


RUN_ONLY = ("jobs", "progress", "out", "save", "resume", "argv")      # how to run and where, not what


def handoff_table(s: PdSettings) -> str:
    """Handoff time (ms) and bytes copied by context length, for every setup's handoff."""
    model = model_spec(s.spec.serve.model)
    costs = s.spec.serve.driver_profile
    starred = {x.label for x in s.setups if x.kind in ("remap", "remote") and x.case.policy == "vmm"
               and extrapolated(PROFILES[costs], x.case.options["page_size"])}
    columns = [(x.label + (" *" if x.label in starred else ""), make_handoff(x, s.spec))
               for x in s.setups if x.handoff is not None]
    body = [[f"{tokens:,}", f"{tokens * model.kv_bytes_per_token / 1e9:.3g}",
             *(f"{h.seconds(tokens) * 1e3:.3g} ms / {h.bytes_copied(tokens) / 1e9:.3g} GB / {h.transfers(tokens):,}"
               for _, h in columns)] for tokens in CONTEXTS]
    sources = "; ".join(LINKS[name].source for name in s.links)
    note = extrapolation_note(PROFILES[costs], [(label, x.case.options["page_size"]) for x in s.setups
                                                 for label in [x.label] if label in starred])
    return table(["context", "KV GB", *(label for label, _ in columns)], body,
                 f"KV handoff per request, {model.name}: time / bytes copied / copies issued (per copy "
                 f"{s.spec.transfer_overhead_s * 1e6:g} us). Copies at the link's one-way peak ({sources}), "
                 f"same-device copies at the memory bandwidth (read + write); remaps and remote maps at {costs} "
                 f"({PROFILES[costs].source}): cuMemMap per page + cuMemSetAccess {s.spec.serve.set_access}"
                 ) + ("\n" + note if note else "")


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
    return table(["setup", "rate", *FIGURES], body, setting_line(s) + over_seeds(s.seeds))


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
