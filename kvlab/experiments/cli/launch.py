"""The `kvlab` script's entry point: guard the start-up (experiments/cli/startup.py), then run the command."""
from __future__ import annotations

from kvlab.experiments.cli.startup import guard_startup


def main() -> int:
    guard_startup()
    from kvlab.experiments.cli.main import main as run_command
    return run_command()             # which ends the guard inside its own try (no gap for a Ctrl-C)
