"""Writes tests/golden/sim_rows.json: simulated rows (host timings excluded) that tests/test_sim_golden.py
compares byte for byte. Regenerate only when a change is MEANT to move simulated figures, and say so:
    PYTHONPATH=.:tests python tests/golden/make_sim_rows.py"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    from sim_golden_cases import collect
    with tempfile.TemporaryDirectory() as tmp:
        rows = collect(Path(tmp))
    (HERE / "sim_rows.json").write_text(json.dumps(rows, sort_keys=True, indent=0, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
