"""Every finished search, appended to DIR/searches.jsonl as it finishes: a study interrupted (Ctrl-C, SIGTERM)
keeps what it had, writes a partial report from it, and `--resume DIR` runs only the searches not in it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError

FILE = "searches.jsonl"


def search_key(cell: str, unit: str, seed: int, kernel_scale: float | None, driver_scale: float) -> str:
    """One search's identity: everything that decides its answer but the settings the whole study shares."""
    return json.dumps([cell, unit, seed, kernel_scale, driver_scale])


def result_key(r: dict[str, Any]) -> str:
    return search_key(r["cell"], r["unit"], r["seed"], r["kernel_scale"], r["driver_scale"])


class Journal:
    """The searches done so far, by key; written through to `folder` when it has one."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self.done: dict[str, dict[str, Any]] = {}

    @classmethod
    def resume(cls, folder: Path) -> Journal:
        journal = cls(folder)
        path = folder / FILE
        if not path.is_file():
            raise ConfigError(f"nothing to resume in {folder}: no {FILE}")
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                journal.done[result_key(r)] = r
            except (ValueError, KeyError, TypeError):
                if number < len(lines):            # only the last line may be cut short (killed mid-write)
                    raise ConfigError(f"{path} line {number} is not a search record") from None
        return journal

    def add(self, r: dict[str, Any]) -> None:
        self.done[result_key(r)] = r
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / FILE, "a") as f:
                f.write(json.dumps(r, default=str) + "\n")

    @property
    def searches(self) -> list[dict[str, Any]]:
        return list(self.done.values())
