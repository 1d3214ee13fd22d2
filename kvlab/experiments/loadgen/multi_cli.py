"""`kvlab bench serve --base-urls URL,URL,...`: the multi-model mode's flags, read once into a MultiSpec and
checked before any request; the per-model lines, the result file (one block per model, the configuration and
the provenance) and the share plot."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_int, check_number
from kvlab.experiments.cli import flags
from kvlab.experiments.limits import MAX_PROMPT_TOKENS, MAX_REQUESTS, MAX_SPAN_S
from kvlab.experiments.loadgen import checks
from kvlab.experiments.loadgen.client import Target, Timeouts, fetch_model
from kvlab.experiments.loadgen.load_run import LoadSpec
from kvlab.experiments.loadgen.multi import MultiSpec, model_plans, run_multi, summary_line
from kvlab.experiments.loadgen.phases import Phases

MAX_MODELS = 16


def add_multi_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-urls", type=flags.parse_list, metavar="URL,URL,...",
                   help="multi-model mode: one server per model, driven at once by phase-shifted bursts "
                        "(--num-prompts and --request-rate do not apply; docs/pool-ab.md)")
    add_phase_flags(p)


def add_phase_flags(p: argparse.ArgumentParser) -> None:
    """The phases' flags (also `kvlab study pool`'s)."""
    p.add_argument("--burst-rate", type=float, default=4.0, help="multi: requests/s of a model in its burst")
    p.add_argument("--idle-rate", type=float, default=0.0, help="multi: requests/s of a model outside its burst")
    p.add_argument("--period", type=float, default=12.0,
                   help="multi: seconds per period; model i bursts in the i-th of its N equal phases")
    p.add_argument("--duty-cycle", type=float, default=1.0,
                   help="multi: fraction of its phase a model bursts, in (0, 1] (1: bursts tile the period)")
    p.add_argument("--periods", type=int, default=2, help="multi: periods in the run")


def phases_from(args: argparse.Namespace, models: int, load: LoadSpec) -> Phases:
    """The multi-model flags, checked: bounded rates, a run within MAX_SPAN_S and MAX_REQUESTS (the prompts'
    lengths from `load`, already checked)."""
    burst = check_number("--burst-rate", args.burst_rate, 0.0, 1e6, strict=True, unit=" requests/s")
    idle = check_number("--idle-rate", args.idle_rate, 0.0, burst, unit=" requests/s (at most --burst-rate)")
    duty = check_number("--duty-cycle", args.duty_cycle, 0.0, 1.0, strict=True)
    periods = check_int("--periods", args.periods, 1, 10_000)
    period = check_number("--period", args.period, 0.0, MAX_SPAN_S / periods, strict=True,
                          unit=" s (x --periods within MAX_SPAN_S)")
    phases = Phases(models, period, duty, burst, idle, periods, args.burstiness)
    expected = burst * duty * phases.phase_s * periods + idle * (period - duty * phases.phase_s) * periods
    if expected > MAX_REQUESTS:
        raise ConfigError(f"the phases send about {expected:,.0f} requests per model, more than the maximum "
                          f"{MAX_REQUESTS:,} (MAX_REQUESTS); lower --burst-rate, --period or --periods")
    tokens = expected * (load.prefix_len + load.input_len * (1 + load.range_ratio))
    if args.dataset == "random" and tokens > MAX_PROMPT_TOKENS:
        raise ConfigError(f"the phases' prompts reach about {tokens:,.0f} tokens per model, more than the maximum "
                          f"{MAX_PROMPT_TOKENS:,} (MAX_PROMPT_TOKENS); send fewer or shorter prompts")
    return phases


def check_urls(urls: list[str]) -> list[str]:
    if not 1 <= len(urls) <= MAX_MODELS:
        raise ConfigError(f"--base-urls takes 1 to {MAX_MODELS} servers, got {len(urls)}")
    urls = [checks.check_url(u) for u in urls]
    if len(set(urls)) < len(urls):
        raise ConfigError("--base-urls names a server twice: one server per model")
    return urls


def multi_spec_from(args: argparse.Namespace, load: LoadSpec) -> tuple[MultiSpec, list[str]]:
    """The one place the multi-model flags are read (after checks.check_args)."""
    if args.backends:
        raise ConfigError("--base-urls drives running servers; --backends starts its own: give one of them")
    urls = check_urls(args.base_urls)
    return MultiSpec(phases_from(args, len(urls), load), load), urls


def run(args: argparse.Namespace, load: LoadSpec) -> int:
    multi, urls = multi_spec_from(args, load)
    timeouts = Timeouts(args.connect_timeout, args.read_timeout, args.request_timeout)
    targets = [Target(u, args.backend, checks.check_endpoint(args.endpoint), args.model, timeouts=timeouts,
                      ignore_eos=load.ignore_eos) for u in urls]
    model_plans(multi)                                  # the phases' and the dataset's errors before any request
    targets = [replace(t, model=t.model or fetch_model(t)) for t in targets]
    p = multi.phases
    print(f"kvlab bench serve: {len(targets)} models, bursts of {p.burst_rate:g} req/s ({p.idle_rate:g} between) "
          f"for {p.duty:.0%} of each {p.phase_s:g} s phase, {p.periods} periods of {p.period_s:g} s", flush=True)
    result = run_multi(multi, targets, progress=not args.disable_tqdm)
    for block in result["models"]:
        print(summary_line(block))
    if args.save_result:
        print(f"wrote {save(args, multi, result)}")
    return 0 if all(b["completed"] for b in result["models"]) else 1


def save(args: argparse.Namespace, multi: MultiSpec, result: dict[str, Any]) -> Path:
    """The result JSON (configuration, provenance, one block per model, the share timeline) and its plot."""
    from kvlab.experiments.loadgen.shares import plot_shares, share_timeline
    from kvlab.experiments.reporting.provenance import jsonable, provenance
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(args.result_dir or ".") / (args.result_filename or f"multi-{multi.phases.models}models-{now}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {"command": "bench serve", "base_urls": [b["base_url"] for b in result["models"]],
              "phases": multi.phases, "load": multi.load}
    timeline = share_timeline(result["samples"], multi.phases.duration_s)
    doc = {"date": now, "config": config, "provenance": provenance(config), "models": result["models"],
           "share_timeline": timeline, "samples": result["samples"], "sample_errors": result["sample_errors"]}
    path.write_text(json.dumps(jsonable(doc), indent=1))
    labels = [f"model {b['model_index']} ({b['base_url']})" for b in result["models"]]
    plot_shares(path.with_suffix(".png"), [("each engine's share of the memory", timeline)], labels,
                [b["bursts"] for b in result["models"]])
    return path
