"""`kvlab bench serve`'s flags checked before any work or output, through the one validation layer
(common/validate.py, experiments/limits.py): each bad value is one line naming the flag."""
from __future__ import annotations

import argparse
import math
import shlex
from urllib.parse import urlsplit

from kvlab.common.errors import ConfigError
from kvlab.common.limits import MAX_MODEL_LEN, check_seed
from kvlab.common.validate import check_int, check_number, check_text, shown
from kvlab.experiments.limits import MAX_PROMPT_TOKENS, MAX_REQUESTS, MAX_SPAN_S, MAX_VOCAB
from kvlab.experiments.loadgen import latency, result_file
from kvlab.experiments.loadgen.datasets import LOW_TOKEN

MIN_BURSTINESS, MAX_BURSTINESS = 0.01, 100.0      # gaps' CV from 10 down to 0.1
MAX_SCALE = MAX_MODEL_LEN / 4096                  # the seed dataset's 4096-token cap, scaled, stays a sequence
MAX_URL_CHARS = 2048


def check_args(args: argparse.Namespace) -> None:
    """Every numeric and text flag; raises ConfigError on the first bad one."""
    check_counts(args)
    check_lengths(args)
    check_traffic(args)
    check_metrics(args)
    args.server_args_list = split_server_args(args.server_args)
    result_file.check_result_flags(args)


def check_counts(args: argparse.Namespace) -> None:
    args.num_prompts = check_int("--num-prompts", args.num_prompts, 1, MAX_REQUESTS)
    if args.max_concurrency is not None:
        args.max_concurrency = check_int("--max-concurrency", args.max_concurrency, 1, MAX_REQUESTS)
    args.seed = check_seed("--seed", args.seed)
    args.vocab_size = check_int("--vocab-size", args.vocab_size, LOW_TOKEN + 1, MAX_VOCAB)


def check_lengths(args: argparse.Namespace) -> None:
    args.input_len = check_int("--random-input-len", args.input_len, 1, MAX_MODEL_LEN)
    args.output_len = check_int("--random-output-len", args.output_len, 1, MAX_MODEL_LEN)
    args.prefix_len = check_int("--random-prefix-len", args.prefix_len, 0, MAX_MODEL_LEN)
    args.range_ratio = check_number("--random-range-ratio", args.range_ratio, 0.0, 1.0)
    if args.range_ratio >= 1:
        raise ConfigError(f"--random-range-ratio must be in [0, 1), got {args.range_ratio:g}")
    args.scale = check_number("--scale", args.scale, 0.0, MAX_SCALE, strict=True)
    tokens = args.num_prompts * (args.prefix_len + int(args.input_len * (1 + args.range_ratio)))
    if args.dataset == "random" and tokens > MAX_PROMPT_TOKENS:
        raise ConfigError(f"--num-prompts x prompt length reach {tokens:,} tokens, more than the maximum "
                          f"{MAX_PROMPT_TOKENS:,} (MAX_PROMPT_TOKENS); send fewer or shorter prompts")


def check_traffic(args: argparse.Namespace) -> None:
    for rate in rates_of(args):
        check_rate(rate, args.num_prompts)
    args.burstiness = check_number("--burstiness", args.burstiness, MIN_BURSTINESS, MAX_BURSTINESS)
    for flag in ("connect_timeout", "read_timeout", "request_timeout"):
        name = "--" + flag.replace("_", "-")
        setattr(args, flag, check_number(name, getattr(args, flag), 0.0, MAX_SPAN_S, strict=True, unit=" s"))


def rates_of(args: argparse.Namespace) -> list[float]:
    from kvlab.experiments.loadgen.rows import parse_rates
    return parse_rates(args.request_rates) if args.request_rates else [args.request_rate]


def check_rate(rate: float, num_prompts: int) -> float:
    """> 0 or inf, and slow enough to send every prompt within MAX_SPAN_S (a rate of 1e-300 would wait forever)."""
    if math.isinf(rate) and rate > 0:
        return rate
    check_number("--request-rate", rate, 0.0, strict=True, unit=" requests/s (or inf)")
    if num_prompts / rate > MAX_SPAN_S:
        raise ConfigError(f"--request-rate {rate:g} sends {num_prompts:,} prompts over {num_prompts / rate:.3g} s, "
                          f"more than the maximum {MAX_SPAN_S:g} s (MAX_SPAN_S); raise the rate")
    return rate


def check_metrics(args: argparse.Namespace) -> None:
    unknown = [m for m in args.percentile_metrics if m not in latency.METRICS]
    if unknown:
        raise ConfigError(f"unknown --percentile-metrics {shown(unknown[0])}; choose from {', '.join(latency.METRICS)}")
    for p in args.metric_percentiles:
        try:
            value = float(p)
        except ValueError:
            value = p
        check_number("each --metric-percentiles value", value, 0.0, 100.0, strict=True)
    latency.parse_goodput(args.goodput)


def split_server_args(text: str) -> list[str]:
    try:
        return shlex.split(check_text("--server-args", text, MAX_URL_CHARS))
    except ValueError as e:
        raise ConfigError(f"--server-args {shown(text)}: {e}") from None


def base_url(args: argparse.Namespace) -> str:
    """--base-url, or http://--host:--port as vLLM builds it; an http(s) URL with a host and a valid port."""
    url = args.base_url
    if url is None:
        host = check_text("--host", args.host, 255)
        port = check_int("--port", args.port, 1, 65535)
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return check_url(url)


def check_url(url: str) -> str:
    check_text("--base-url", url, MAX_URL_CHARS)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"--base-url {shown(url)}: not a URL ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--base-url {shown(url)}: give an http:// or https:// URL with a host, "
                          "e.g. http://127.0.0.1:8000")
    if port == 0:
        raise ConfigError(f"--base-url {shown(url)}: port must be in [1, 65535]")
    return url.rstrip("/")


def check_endpoint(endpoint: str | None) -> str | None:
    if endpoint is not None and not check_text("--endpoint", endpoint, MAX_URL_CHARS).startswith("/"):
        raise ConfigError(f"--endpoint {shown(endpoint)}: a path such as /v1/completions")
    return endpoint


def check_backends(names: list[str]) -> list[str]:
    """Every --backends name registered, before the first server starts."""
    from kvlab.common.kv.registry import REGISTRY
    known = REGISTRY.names()
    for name in names:
        if name not in known:
            raise ConfigError(f"unknown backend {shown(name)} in --backends; choose from: {', '.join(known)}")
    return names
