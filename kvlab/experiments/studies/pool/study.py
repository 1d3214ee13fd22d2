"""The A/B itself: for each repeat, each configuration in turn (the order reversed on odd repeats), its servers
started, warmed up, driven by the same phase-shifted bursts, stopped, and (pooled) its pool checked gone."""
from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kvlab.experiments.loadgen.client import Target, Timeouts, run_load
from kvlab.experiments.loadgen.datasets import LoadRequest
from kvlab.experiments.loadgen.multi import run_multi, start_clock
from kvlab.experiments.loadgen.shares import share_timeline
from kvlab.experiments.reporting.tables import progress_bar
from kvlab.experiments.studies.pool.ledger_sampler import LedgerSampler
from kvlab.experiments.studies.pool.servers import Launched, check_pool_gone, servers
from kvlab.experiments.studies.pool.settings import Configuration, PoolStudySettings

WARM_UP = LoadRequest(list(range(3, 35)), 8)     # one short request per server before the measured run
RUN_TIMEOUTS = Timeouts(connect=10.0, read=300.0, request=300.0)   # a queued request streams nothing for long


def execute(s: PoolStudySettings, command: str) -> int:
    """The whole study: the runs, the table printed, the results directory written."""
    from kvlab.experiments.loadgen.sweep import sigterm_unwinds
    with sigterm_unwinds():                                 # unwinds through every server's teardown
        return _execute(s, command)


def _execute(s: PoolStudySettings, command: str) -> int:
    from kvlab.experiments.studies.pool.output import report, save
    out = Path(s.out or Path("results") / datetime.now().strftime("pool-ab-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    records = run_study(s, out)
    text = report(s, records)
    print(text)
    plot = save(s, records, out, text, command)
    print(f"results in {out}/ (table.md, table.csv, runs.json, provenance.json; share plot {plot})")
    return 0 if all(m["completed"] for r in records for m in r["models"]) else 1


def run_study(s: PoolStudySettings, out: Path) -> list[dict[str, Any]]:
    """One record per (repeat, configuration), in the order run."""
    runs = [(r, c) for r in range(s.repeats) for c in s.order(r)]
    records = []
    with progress_bar(runs, disable=not s.progress, unit="run") as bar:
        for repeat, config in bar:
            bar.set_description(f"repeat {repeat + 1}/{s.repeats} {config.label}")
            records.append(run_configuration(s, config, repeat, out))
    return records


def run_configuration(s: PoolStudySettings, config: Configuration, repeat: int, out: Path) -> dict[str, Any]:
    pool = f"kvlab-ab-{os.getpid()}-{repeat}{config.key}"
    argvs = [[*argv, *s.server_args] for argv in config.server_args(s.total_bytes, s.engines, pool)]
    with servers(argvs, s.model, out / "logs" / f"repeat{repeat}-{config.key}", s.start_timeout_s) as launched:
        result = drive(s, config, launched, pool)
    if config.pooled:
        check_pool_gone(pool)
    result["share_timeline"] = share_timeline(result.pop("share_samples"), s.multi.phases.duration_s)
    return {"repeat": repeat, "configuration": config.key, "label": config.label} | result


def drive(s: PoolStudySettings, config: Configuration, launched: list[Launched], pool: str) -> dict[str, Any]:
    """Warm every server up, then the measured run; a pooled configuration's shares come from the pool's books."""
    targets = [Target(server.url, model=s.model, ignore_eos=s.multi.load.ignore_eos, timeouts=RUN_TIMEOUTS)
               for server in launched]
    for target in targets:
        asyncio.run(run_load(replace(target, ignore_eos=True), [WARM_UP], [0.0]))
    t0 = start_clock()
    with contextlib.ExitStack() as stack:
        ledger = stack.enter_context(LedgerSampler(pool, [p.pid for p in launched], t0)) if config.pooled else None
        result = run_multi(s.multi, targets, t0=t0)
    result["share_samples"] = ledger.series if ledger is not None else result["samples"]
    return result
