"""`kvlab bench handoff`: what handing a prompt's KV from a prefill engine to a decode engine costs, against context
length, for each backend (issue 30): the pull's latency (both sides, from the decode engine's connect to its ack),
the prefill side's own time (its export, then its release once the KV is taken: vmm unmaps the pages there), the
KV bytes copied and the units (pages, blocks, tokens) moved. Medians over repeats with their [min-max] spread; one
process pinned to one core, one torch thread.

The two engines run in one process (the prefill engine serves pulls from its own thread, as in a server); vmm draws
both engines' pages from one pool. The prompts are not computed: a runner samples token 1 without running the
model, because a handoff's cost depends on how much KV there is, not on its values; the KV memory itself is real
and fully mapped. So the model gives only the KV shape, and contexts past its position limit are allowed.

    kvlab bench handoff [--models tiny,smollm2-135m] [--backends vmm,paged,reserve] [--contexts 1024,...,32768]
Results: DIR/handoff.md (the table), DIR/handoff.json (rows and provenance), DIR/provenance.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_MODEL_LEN
from kvlab.experiments.cli import flags
from kvlab.experiments.reporting.tables import median, with_spread

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
REMOTE = {"do_remote_decode": True}
POOL_PAGE = 64 * 1024
SETTLE_S = 30.0


@dataclass(frozen=True)
class HandoffSettings:
    models: tuple[str, ...]
    backends: tuple[str, ...]
    contexts: tuple[int, ...]
    repeats: int
    dtype: str
    cpu: int
    out: str | None


class KVOnlyRunner:
    """Samples token 1 for every sequence and computes nothing (see the module's docstring)."""

    def execute(self, out: Any) -> dict[int, int]:
        return dict.fromkeys(out.specs, 1)

    def clock(self) -> float:
        return time.perf_counter()


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("handoff", help="prefill->decode KV handoff latency and bytes against context length",
                              description=__doc__)
    p.add_argument("--models", type=flags.parse_list, default=["tiny"], help="comma list of presets (default tiny)")
    p.add_argument("--backends", type=flags.parse_list, default=["vmm", "paged", "reserve"])
    p.add_argument("--contexts", type=flags.arg_type(parse_contexts), default=CONTEXTS,
                   help="comma list of context lengths in tokens (default 1024,...,32768)")
    p.add_argument("--repeats", type=int, default=5, help="handoffs per cell (default %(default)s)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32", help="KV dtype")
    p.add_argument("--cpu", type=int, default=0, help="the core the run is pinned to (default %(default)s)")
    p.add_argument("--out", metavar="DIR", help="results directory (default results/handoff-<timestamp>)")
    p.set_defaults(run=run)


def parse_contexts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise ConfigError(f"--contexts takes a comma list of token counts, got {text!r}") from None
    if not values or min(values) < 2 or max(values) > MAX_MODEL_LEN:
        raise ConfigError(f"--contexts: every context must be 2 to {MAX_MODEL_LEN:,} tokens, got {text[:80]!r}")
    return values


def settings_from(args: argparse.Namespace) -> HandoffSettings:
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    if args.cpu not in os.sched_getaffinity(0):
        raise ConfigError(f"--cpu {args.cpu} is not a core this process may run on {sorted(os.sched_getaffinity(0))}")
    flags.check_output_path(args.out, "--out", directory=True)
    return HandoffSettings(tuple(args.models), tuple(args.backends), args.contexts, args.repeats, args.dtype,
                           args.cpu, args.out)


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    rows = measure_all(settings)
    out = Path(settings.out or f"results/handoff-{time.strftime('%Y%m%d-%H%M%S')}")
    write_results(out, rows, settings)
    print(markdown(rows))
    print(f"\nresults in {out}/ (handoff.md, handoff.json, provenance.json)")
    return 0


# -- measuring --------------------------------------------------------------------------------------------------
def measure_all(settings: HandoffSettings) -> list[dict[str, Any]]:
    """Every model's rows, this process pinned to one core with one torch thread."""
    import torch
    os.sched_setaffinity(0, {settings.cpu})
    torch.set_num_threads(1)
    return [row for model in settings.models for row in measure_model(model, settings)]


def measure_model(model_name: str, settings: HandoffSettings) -> list[dict[str, Any]]:
    from kvlab.common.loader import load_model
    model, _ = load_model(model_name, settings.dtype, "cpu")
    shape = model.kv_shape(settings.dtype, "cpu")
    rows = []
    for backend in settings.backends:
        with EnginePair(model_name, backend, shape, max(settings.contexts)) as pair:
            for context in settings.contexts:
                runs = [pair.handoff(context) for _ in range(settings.repeats)]
                rows.append(summarise(model_name, backend, context, shape.bytes_per_token, runs))
                latency = with_spread([r["seconds"] * 1e3 for r in runs])
                print(f"{model_name} {backend} {context:,} tokens: {latency} ms", flush=True)
    return rows


class EnginePair:
    """A prefill engine and a decode engine of one backend (vmm: on a pool made for them), with KVOnlyRunners."""

    def __init__(self, model: str, backend: str, shape: Any, longest: int) -> None:
        self.model, self.backend, self.shape, self.longest = model, backend, shape, longest
        self.holder = self.prefill = self.decode = None

    def __enter__(self) -> EnginePair:
        budget = -(-self.shape.bytes_per_token * (self.longest + 1024) // POOL_PAGE) * POOL_PAGE + (16 << 20)
        pool = None
        if self.backend == "vmm":
            from kvlab.vmm import pool as pools
            self.holder = pools.create(f"bench-handoff-{os.getpid()}-{uuid.uuid4().hex[:6]}", 2 * budget,
                                       page_size=POOL_PAGE)
            pool = self.holder.name
        self.prefill = self._engine("prefill", budget, pool)
        self.decode = self._engine("decode", budget, pool)
        return self

    def _engine(self, role: str, budget: int, pool: str | None) -> Any:
        from kvlab.common.config import make_config
        from kvlab.common.engine import Engine
        from kvlab.common.kv.seam import create_cache
        config = make_config(model=self.model, backend=self.backend, kv_role=role, kv_cache_bytes=budget,
                             max_model_len=self.longest + 16, max_num_seqs=1, dtype=self.shape.dtype,
                             max_num_batched_tokens=self.longest + 16, kv_pool=pool)
        return Engine(config, create_cache(config, self.shape), KVOnlyRunner())

    def handoff(self, context: int) -> dict[str, Any]:
        """One prompt through both engines; the figures of its pull."""
        from kvlab.common.sampling_params import SamplingParams
        prompt = [3 + i % 500 for i in range(context)]
        first = _finish(self.prefill, prompt, SamplingParams(max_tokens=1, ignore_eos=True), REMOTE)
        before = self.prefill.handoff.stats.to_dict()
        done = _finish(self.decode, prompt, SamplingParams(max_tokens=2, ignore_eos=True), first.kv_transfer_params)
        if done.error is not None:
            raise RuntimeError(f"the handoff failed: {done.error}")
        after = _settled(self.prefill, before["count"])
        return {**done.handoff, "prefill_seconds": after["seconds"] - before["seconds"],
                "prefill_bytes_copied": after["bytes_copied"] - before["bytes_copied"]}

    def __exit__(self, *exc: object) -> None:
        for engine in (self.decode, self.prefill):
            if engine is not None:
                engine.close()
        if self.holder is not None:
            self.holder.close()


def _finish(engine: Any, prompt: list[int], params: Any, kv: dict[str, Any]) -> Any:
    engine.add_request(prompt, params, kv_transfer_params=kv)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step().finished
    return outputs[0]


def _settled(engine: Any, count: int) -> dict[str, Any]:
    """The prefill engine's stats once it released the KV of its handoff number `count + 1`."""
    deadline = time.monotonic() + SETTLE_S
    while (stats := engine.handoff.stats.to_dict())["count"] <= count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the prefill engine did not release its KV within {SETTLE_S:.0f} s: {stats}")
        engine.handoff.poll_idle()
        time.sleep(0.001)
    return stats


def summarise(model: str, backend: str, context: int, bytes_per_token: int, runs: list[dict]) -> dict[str, Any]:
    ms = [r["seconds"] * 1e3 for r in runs]
    prefill = [r["prefill_seconds"] * 1e3 for r in runs]
    return {"model": model, "backend": backend, "context": context, "kv_bytes": context * bytes_per_token,
            "latency_ms": ms, "latency_ms_median": median(ms), "prefill_ms": prefill,
            "prefill_ms_median": median(prefill), "bytes_copied": runs[0]["bytes_copied"],
            "prefill_bytes_copied": runs[0]["prefill_bytes_copied"], "units_moved": runs[0]["units_moved"],
            "unit": runs[0]["unit"]}


# -- reporting --------------------------------------------------------------------------------------------------
HEADERS = ["model", "backend", "context", "KV bytes", "latency ms, median [min-max]",
           "prefill side ms (export + release)", "bytes copied", "units moved"]


def cells(row: dict[str, Any]) -> list[Any]:
    def ms(v: float) -> str:
        return f"{v:.2f}"
    return [row["model"], row["backend"], row["context"], row["kv_bytes"], with_spread(row["latency_ms"], ms),
            with_spread(row["prefill_ms"], ms), row["bytes_copied"], f"{row['units_moved']:,} {row['unit']}s"]


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(table_cell(c) for c in cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def table_cell(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def write_results(out: Path, rows: list[dict[str, Any]], settings: HandoffSettings) -> None:
    from kvlab.experiments.reporting.provenance import provenance, write_provenance
    record = provenance({"command": "bench handoff", **asdict(settings), "runner": "KVOnlyRunner (no model compute)",
                         "threads": 1, "pinned_cpu": settings.cpu})
    write_provenance(out, record)
    (out / "handoff.json").write_text(json.dumps({"rows": rows, "provenance": record}, indent=1))
    note = ("Bytes copied: K/V bytes each copying side moves (the prefill engine into shared memory, the decode "
            "engine out of it); vmm moves page ownership only.")
    (out / "handoff.md").write_text(markdown(rows) + "\n\n" + note + "\n")



