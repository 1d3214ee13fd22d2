"""Where the multi-engine simulations (`simulate pool`, `simulate pd`) write: results/<timestamp>/ or --out, with
provenance.json, report.txt (the tables printed) and one JSON of the run (meta and result)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def save(out: str | None, command: str, name: str, meta: dict[str, Any], result: dict[str, Any], text: str) -> Path:
    from kvlab.experiments.reporting.provenance import jsonable, provenance, write_provenance
    from kvlab.experiments.reporting.tables import results_dir
    path = results_dir(out)
    record = provenance({"command": command, **jsonable(meta)})
    write_provenance(path, record)            # makes the directory
    (path / "report.txt").write_text(text + "\n")
    (path / name).write_text(json.dumps(jsonable({"provenance": record, "meta": meta, "result": result}), indent=1))
    return path


def report(text: str, started: float, save_to: tuple | None) -> None:
    """Print the tables and the host time; `save_to`: save()'s arguments less the text, or None (--no-save)."""
    import time
    print(text)
    print(f"\n{time.perf_counter() - started:.1f} s host time")
    if save_to is not None:
        print(f"results in {save(*save_to, text)}/")
