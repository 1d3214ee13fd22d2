"""Serving: `kvlab serve`, an OpenAI-compatible server (the load generator is experiments/loadgen)."""
from kvlab.experiments.serve.server import add_parser, run

__all__ = ["add_parser", "run"]
