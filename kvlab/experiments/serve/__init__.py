"""Serving: `kvlab serve` (cli.py, server.py), an OpenAI-compatible server; the load generator is
experiments/loadgen."""
