"""Every `kvlab` subcommand: the module that defines it (`add_parser(subparsers)`, `run(args)`) and the one-line
summary `kvlab --help` prints. The summaries live here so the top-level help needs no subcommand module (most
import torch); tests/test_cli_help.py checks that each equals its module's own help text, and that the README
and docs/ list every command."""
from __future__ import annotations

from typing import NamedTuple


class Command(NamedTuple):
    module: str
    summary: str


COMMANDS = {
    "generate": Command("kvlab.experiments.cli.generate", "generate a continuation of a prompt"),
    "bench": Command("kvlab.experiments.bench.offline", "A/B: one workload through several backends, side by side"),
    "simulate": Command("kvlab.experiments.sim.cli",
                        "roofline simulation at GPU scale (real scheduler, accounting-only caches)"),
    "fallbacks": Command("kvlab.experiments.studies.fallbacks", "which attention kernel each backend gets, and why"),
    "pool": Command("kvlab.experiments.pool.cli",
                    "a machine-wide KV page pool shared by engines (create, status, limit)"),
    "sharing": Command("kvlab.experiments.studies.sharing",
                       "KV memory saved by sharing: parallel sampling and beam search"),
    "serve": Command("kvlab.experiments.serve.cli", "an OpenAI-compatible HTTP server over one backend"),
    "prefix": Command("kvlab.experiments.studies.prefix",
                      "prefix-cache hit rate and savings vs unit size, paged vs vmm"),
    "calibrate": Command("kvlab.experiments.bench.calibrate",
                         "measure host map/unmap latency per page size (driver profile)"),
    "study": Command("kvlab.experiments.studies.cli",
                     "studies that answer one question each (page-size, pool, corners)"),
    "compare": Command("kvlab.experiments.compare",
                       "what differs between two saved runs: configuration, then figures"),
}


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand `argv` names: its first argument that is not a top-level option (-h, -v)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None
