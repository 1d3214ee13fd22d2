"""`kvlab serve --role router`: its flags read into RouterSettings (every engine URL checked before anything
starts), and the router's app served by the same uvicorn setup as an engine's server."""
from __future__ import annotations

import argparse
import urllib.parse

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_number, check_text, shown
from kvlab.experiments.cli import flags as cli
from kvlab.experiments.serve.router import RouterSettings

MAX_URL_CHARS = 2048
DEFAULT_UPSTREAM_TIMEOUT_S = 300.0
MAX_UPSTREAM_TIMEOUT_S = 24 * 3600.0
ENGINE_ONLY = ("served_model_name", "engine_thread")


def check_url(flag: str, text: str) -> str:
    """An engine's base URL: http(s)://host:port with no path beyond '/'."""
    check_text(flag, text, MAX_URL_CHARS)
    try:
        parts = urllib.parse.urlsplit(text)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:                               # an unclosed [IPv6, or a port not a number in [0, 65535]
        parts, port_ok = urllib.parse.urlsplit(""), False
    spaced = not text.isprintable() or any(c.isspace() for c in text)    # a router that would answer 503 forever
    if spaced or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"{flag} takes engine URLs such as http://127.0.0.1:8100, got {shown(text)}")
    return text.rstrip("/")


def router_settings(args: argparse.Namespace) -> RouterSettings:
    if args.colocated and (args.prefill or args.decode):
        raise ConfigError("--role router takes --prefill and --decode engines, or --colocated ones, not both")
    for flag in () if args.colocated else ("prefill", "decode"):
        if not getattr(args, flag):
            raise ConfigError(f"--role router needs --{flag} URL [URL ...] (the {flag} engines' servers), "
                              "or --colocated URL [URL ...]")
    engine_flags = [name for name in (*cli.engine_flag_names(), "config", *ENGINE_ONLY) if vars(args).get(name)]
    if engine_flags:
        flag = "--" + engine_flags[0].replace("_", "-")
        raise ConfigError(f"{flag} configures an engine; --role router runs none (give it to the engines' servers)")
    given = DEFAULT_UPSTREAM_TIMEOUT_S if args.upstream_timeout is None else args.upstream_timeout
    timeout = check_number("--upstream-timeout", given, 0.0, MAX_UPSTREAM_TIMEOUT_S, strict=True, unit=" s")
    roles = ("prefill", "decode", "colocated")
    return RouterSettings({role: [check_url(f"--{role}", u) for u in getattr(args, role) or []] for role in roles},
                          timeout)


def check_engine_role(args: argparse.Namespace) -> None:
    """An engine's server takes no router flag."""
    for name in ("prefill", "decode", "colocated", "upstream_timeout"):
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} is the router's flag; use it with --role router")
