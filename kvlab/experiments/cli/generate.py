"""`kvlab generate PROMPT`: print the model's continuation (one line block per sample or beam)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Any

from kvlab.experiments.cli import flags


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate a continuation of a prompt",
                              description="Generate a continuation of PROMPT with any backend.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--n", type=int, default=1, help="parallel samples (share the prompt's KV)")
    p.add_argument("--beam-width", type=int, default=1, help="> 1: beam search")
    p.add_argument("--sample-seed", type=int, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stats", action="store_true", help="print run metrics to stderr")
    flags.add_engine_flags(p)
    p.set_defaults(run=run)


@contextlib.contextmanager
def quiet_capacity():
    logger = logging.getLogger("kvlab.capacity")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run(args: argparse.Namespace) -> int:
    from kvlab.common.llm import LLM
    from kvlab.common.sampling_params import SamplingParams
    from kvlab.experiments.reporting.tables import threads_label
    config = flags.engine_config(vars(args))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.sample_seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
                            beam_width=args.beam_width)
    with quiet_capacity():        # a failed request is one line alone; the warnings follow a run that worked
        llm = LLM(**config.to_dict())
    try:
        (output,) = llm.generate(args.prompt, params)
        if output.error:
            from kvlab.common.errors import RequestError
            raise RequestError(output.error)
        from kvlab.common.capacity import warn_capacity
        warn_capacity(llm.config, llm.engine.cache)
        many = len(output.outputs) > 1
        for c in output.outputs:
            text = c.text if c.text is not None else " ".join(map(str, c.token_ids))
            print(f"[{c.index}] {text}" if many else text)
        if args.stats:
            m = llm.metrics()
            print(f"{config.backend}: {m.output_tokens} tokens in {m.wall_seconds:.2f} s "
                  f"({m.output_tokens_per_s:.1f} tok/s, {threads_label(config.threads)}), kernels {m.kernels}",
                  file=sys.stderr)
    finally:
        llm.close()
    return 0
