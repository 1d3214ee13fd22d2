"""`kvlab compare RUN_A RUN_B`: what differs between two saved runs, configuration first, then figure by figure."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("compare", help="what differs between two saved runs: configuration, then figures",
                              description="Compare two results (a results directory or its JSON file each): the "
                                          "configuration that differs first, then every figure with its spread.")
    p.add_argument("run_a", metavar="RUN_A", help="results directory or JSON file")
    p.add_argument("run_b", metavar="RUN_B", help="results directory or JSON file")
    p.add_argument("--all", action="store_true", help="also list the figures that are equal")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvlab.experiments.compare.diff import compare
    from kvlab.experiments.compare.saved import load_run
    print(compare(load_run(args.run_a), load_run(args.run_b), show_equal=args.all))
    return 0
