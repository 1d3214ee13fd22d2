"""Serving: `kvlab serve` (an OpenAI-compatible server) and `kvlab bench serve` (a load generator)."""
from kvlab.experiments.serve.server import add_parser, run

__all__ = ["add_parser", "run"]
