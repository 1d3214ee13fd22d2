"""`kvlab serve`'s flags. The server itself (experiments/serve/server.py: torch, uvicorn, the engine) is imported
only when it runs, so `kvlab serve --help` and a flag error come back at once."""
from __future__ import annotations

import argparse

from kvlab.experiments.cli import flags as cli

DEFAULT_MAX_WAITING = 1024
ROLES = ("colocated", "prefill", "decode", "router")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server over one backend",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                          "/metrics with one engine stepping in a process of its own.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="requests queued beyond this are answered 429")
    p.add_argument("--served-model-name", help="the model id clients see (default: --model)")
    p.add_argument("--engine-thread", action="store_true",
                   help="step the engine in a thread of the server process instead of a process of its own "
                        "(one GIL for both: slower when streaming; see docs/serving.md)")
    add_role_flags(p)
    cli.add_engine_flags(p)
    p.set_defaults(run=run)


def add_role_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", choices=ROLES, default=None,
                   help="colocated (default): prefill and decode in one engine; prefill | decode: one side of "
                        "disaggregated serving; router: the proxy in front of them (docs/disaggregation.md)")
    p.add_argument("--prefill", nargs="+", metavar="URL", help="router: the prefill engines' servers")
    p.add_argument("--decode", nargs="+", metavar="URL", help="router: the decode engines' servers")
    p.add_argument("--colocated", nargs="+", metavar="URL",
                   help="router: colocated engines' servers instead, each request sent whole to one (the baseline)")
    p.add_argument("--upstream-timeout", type=float, metavar="S",
                   help="router: seconds each engine call may take (a stream: each piece; default 300)")


def run(args: argparse.Namespace) -> int:
    from kvlab.experiments.serve import server
    return server.run(args)
