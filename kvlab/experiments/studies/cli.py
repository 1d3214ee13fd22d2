"""`kvlab study STUDY`: one subcommand per study, each registered by its package's `add_study(which)`."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.studies import corners
from kvlab.experiments.studies.page_size import cli as page_size
from kvlab.experiments.studies.pool import cli as pool

STUDIES = (page_size, pool, corners)


def add_parser(subparsers: Any) -> None:
    study = subparsers.add_parser("study", help="studies that answer one question each (page-size, pool, corners)")
    which = study.add_subparsers(dest="study", required=True, metavar="STUDY")
    for module in STUDIES:
        module.add_study(which)
