"""`kvlab bench serve`'s result file, written as `vllm bench serve` writes it (vllm/benchmarks/serve.py):

- the setup keys (date, backend, label, model and tokenizer ids, num_prompts), then each `--metadata KEY=VALUE`
  as a top-level key (the text after the first '=', both sides stripped), then the traffic keys and the run's;
- the per-request lists (input_lens, output_lens, ttfts, itls, generated_texts, errors; and kvlab's `requests`)
  only with `--save-detailed`;
- the file is `{label or backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json`, or `--result-filename`, in
  `--result-dir` (made when missing); `--append-result` appends the record to it (a newline between records)
  and, as in vLLM, saves even without `--save-result`.
kvlab adds its provenance record under "provenance"."""
from __future__ import annotations

import argparse
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_output_path, check_text, shown

PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "requests")
MAX_METADATA = 256
MAX_LABEL_CHARS = 200


def add_result_file_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save-result", action="store_true", help="write the result JSON (vLLM's keys)")
    p.add_argument("--save-detailed", action="store_true",
                   help="also write the per-request lists (input_lens, ttfts, itls, generated_texts, errors...)")
    p.add_argument("--append-result", action="store_true",
                   help="append the result to the file (saves even without --save-result)")
    p.add_argument("--metadata", nargs="*", metavar="KEY=VALUE",
                   help="key-value pairs written into the result, e.g. --metadata version=0.3.3 tp=1")
    p.add_argument("--label", help="the result's label and its file name's prefix (default: --backend)")
    p.add_argument("--result-dir", help="where the result is written (made when missing; default: the current "
                                        "directory)")
    p.add_argument("--result-filename",
                   help="default {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json")


def saving(args: argparse.Namespace) -> bool:
    return bool(args.save_result or args.append_result)


def check_result_flags(args: argparse.Namespace) -> None:
    """Before any request: the metadata pairs, the label, and that the file can be written."""
    args.metadata_pairs = metadata_pairs(args.metadata or [])
    if args.label is not None:
        label = check_text("--label", args.label, MAX_LABEL_CHARS)
        if not label.isprintable() or "/" in label:
            raise ConfigError(f"--label names the result file: printable text without '/', got {shown(label)}")
    if not saving(args):
        return
    folder = check_output_path("--result-dir", args.result_dir or ".", directory=True)
    if args.result_filename is not None:
        path = folder / check_text("--result-filename", args.result_filename, 4096)
        if path.is_dir():
            raise ConfigError(f"--result-filename {shown(str(path))}: is a directory; give a file path")
        check_output_path("--result-filename", path.parent, directory=True)


def metadata_pairs(items: list[str]) -> dict[str, str]:
    if len(items) > MAX_METADATA:
        raise ConfigError(f"--metadata takes at most {MAX_METADATA} KEY=VALUE pairs, got {len(items)}")
    pairs = {}
    for item in items:
        key, eq, value = check_text("--metadata", item, 4096).partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--metadata takes KEY=VALUE pairs, got {shown(item)}")
        pairs[key.strip()] = value.strip()
    return pairs


def record(args: argparse.Namespace, result: dict[str, Any], model: str, provenance: dict[str, Any],
           now: str) -> dict[str, Any]:
    """The result as vLLM orders it: setup, metadata, traffic, then the run's keys; per-request lists only when
    --save-detailed."""
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    head = {"date": now, "endpoint_type": args.backend, "backend": args.backend, "label": args.label,
            "model_id": model, "tokenizer_id": args.tokenizer or model, "num_prompts": args.num_prompts}
    traffic = {"request_rate": rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}
    kept = {k: v for k, v in result.items() if args.save_detailed or k not in PER_REQUEST}
    return head | args.metadata_pairs | traffic | kept | {"request_rate": rate, "provenance": provenance}


def file_path(args: argparse.Namespace, model: str, now: str) -> Path:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{model.split('/')[-1]}-{now}.json"
    return Path(args.result_dir or ".") / (args.result_filename or name)


def save_result(args: argparse.Namespace, result: dict[str, Any], model: str, provenance: dict[str, Any]) -> Path:
    """Write (or with --append-result, append) the result; its path."""
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = file_path(args, model, now)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = record(args, result, model, provenance, now)
    if not args.append_result:
        path.write_text(json.dumps(doc, indent=1))
        return path
    with path.open("a+", encoding="utf-8") as out:
        if out.tell():
            out.write("\n")
        out.write(json.dumps(doc))              # one line per record, as vLLM appends them
    return path
