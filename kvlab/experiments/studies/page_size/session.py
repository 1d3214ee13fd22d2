"""One `kvlab study page-size` invocation: provenance.json first, every search into the journal as it finishes,
the report and files at the end. Ctrl-C or SIGTERM stops the searches, writes a partial report from what is done
and exits 130; `--resume DIR` reruns the study with DIR's own settings (its provenance) and skips what is done."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.reporting.checkpoint import sigterm_interrupts
from kvlab.experiments.studies.page_size.journal import Journal
from kvlab.experiments.studies.page_size.settings import StudySettings

COMMAND = "study page-size"
LOCAL = ("resume", "jobs", "ray", "no_progress", "out", "no_save")    # where and how, not what: never stored


def stored_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that decide the study's answer, as plain JSON (provenance.json's config.args)."""
    return {k: v for k, v in vars(args).items() if k not in LOCAL and not callable(v)}


def resumed_args(args: argparse.Namespace) -> argparse.Namespace:
    """DIR's own flags, with this command line's jobs, ray and progress."""
    from kvlab.experiments.reporting.provenance import read_provenance
    folder = Path(args.resume)
    record = read_provenance(folder) if folder.is_dir() else None
    stored = ((record or {}).get("config") or {}).get("args")
    if not isinstance(stored, dict) or (record or {}).get("config", {}).get("command") != COMMAND:
        raise ConfigError(f"--resume {folder}: not a `kvlab {COMMAND}` results directory (no provenance.json)")
    if args.no_save:
        raise ConfigError("--resume writes into its directory: drop --no-save")
    local = {k: getattr(args, k) for k in LOCAL}
    return argparse.Namespace(**{**vars(args), **stored, **local, "out": str(folder)})


def start(s: StudySettings, args: argparse.Namespace) -> tuple[Journal, Path | None]:
    if not s.save:
        return Journal(), None
    from kvlab.experiments.reporting.provenance import provenance, write_provenance
    from kvlab.experiments.reporting.tables import results_dir
    from kvlab.experiments.studies.page_size.output import settings_json
    if args.resume:
        folder = Path(args.resume)
        return Journal.resume(folder), folder
    folder = results_dir(s.out)
    write_provenance(folder, provenance({"command": COMMAND, "args": stored_args(args),
                                         "settings": settings_json(s)}))
    return Journal(folder), folder


def partial(s: StudySettings, journal: Journal, folder: Path | None, seconds: float) -> dict[str, Any]:
    from kvlab.experiments.studies.page_size.study import assemble, brief
    from kvlab.experiments.studies.page_size.verdict import verdict
    cells = assemble(s, journal.searches)
    where = f"; finish it with `kvlab {COMMAND} --resume {folder}`" if folder else ""
    return {"cells": cells, "verdict": verdict(brief(cells)) or "none yet", "host_seconds": seconds,
            "interrupted": f"INTERRUPTED after {len(journal.done)} searches: a partial report{where}."}


def finish(s: StudySettings, result: dict[str, Any], folder: Path | None, to_stderr: bool = False) -> None:
    from kvlab.experiments.studies.page_size.output import save
    from kvlab.experiments.studies.page_size.report import report
    text = report(s, result)
    out = sys.stderr if to_stderr else sys.stdout
    print(text, file=out)
    if folder is not None:
        print(f"results in {save(s, result, text, folder)}/", file=out)


def run_session(args: argparse.Namespace, settings_from: Callable[[argparse.Namespace], StudySettings]) -> int:
    from kvlab.experiments.studies.page_size.study import run_study
    if args.resume:
        args = resumed_args(args)
    s = settings_from(args)
    journal, folder = start(s, args)
    t0 = time.perf_counter()
    try:
        with sigterm_interrupts():
            result = run_study(s, journal)
    except KeyboardInterrupt:
        finish(s, partial(s, journal, folder, time.perf_counter() - t0), folder, True)
        raise
    finish(s, result, folder)
    return 0
