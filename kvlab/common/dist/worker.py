"""A worker rank (1..tp-1), run as `python -m kvlab.common.dist.worker` (see launch.py): read its task from
standard input, load this rank's shard, build this rank's own KV-cache backend, then follow rank 0's messages:
replay each step's allocation ops, prepare the batch over the mirror sequences and run the shard's forward (its
all-reduces pair with rank 0's). Any failure is one line on the report pipe (the original standard output) and
exit code 1."""
from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from kvlab.common.dist.group import Groups, destroy_groups, die_with_parent, init_groups, rank_device
from kvlab.common.dist.launch import WorkerTask, read_task
from kvlab.common.dist.message import Mirror
from kvlab.common.dist.shard import CommTimer, SafetensorsReader, build_shard, model_reader
from kvlab.common.validate import user_path


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):       # rank 0's to handle: it stops or kills every rank
        signal.signal(sig, signal.SIG_IGN)
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                                      # prints from here on go to standard error
    try:
        run(read_task(sys.stdin.buffer))
    except BaseException as e:  # noqa: BLE001 (report anything, then exit non-zero)
        from kvlab.common.weights import first_line
        report.write(f"{type(e).__name__}: {first_line(e)}\n")
        return 1
    finally:
        report.close()
    return 0


def run(task: WorkerTask) -> None:
    config, rank, tp = task.config, task.rank, task.world
    die_with_parent(task.parent_pid)
    torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // tp))
    cache = None
    try:
        groups = init_groups(rank, tp, task.port, config.device)
        model = load_shard(config, rank, tp, groups)
        cache = rank_cache(config, model, rank)
        serve(rank, model, cache, groups)
    finally:
        if cache is not None:
            cache.close()
        destroy_groups()


def load_shard(config: Any, rank: int, tp: int, groups: Groups):
    """HF directories: read only this rank's slices. Presets and GGUF: load whole, keep this rank's shard."""
    device = rank_device(config.device, rank)
    path = user_path(config.model)
    if path.is_dir():
        from kvlab.common.loader import config_from_hf, read_json
        model_config = config_from_hf(read_json(path / "config.json"), path / "config.json")
        read = SafetensorsReader(path)
    else:
        from kvlab.common.loader import load_model
        full, _ = load_model(config.model, config.dtype, "cpu", config.seed)
        model_config, read = full.config, model_reader(full)
    model = build_shard(model_config, rank, tp, read, config.dtype, device, groups.device, CommTimer())
    model.ensure_rope_len(config.max_model_len)
    model.use_linear(config.linear)
    return model


def rank_cache(config: Any, model: Any, rank: int):
    """This rank's own backend instance over its KV heads, with its share of the KV budget."""
    from kvlab.common.kv.seam import create_cache
    per_rank = config.replace(kv_cache_bytes=config.kv_cache_bytes // config.tensor_parallel_size)
    device = rank_device(config.device, rank)
    return create_cache(per_rank, model.kv_shape(config.dtype, device))


def rank_info(cache: Any) -> dict[str, Any]:
    """What rank 0 gathers to compare ranks: an allocator digest and this rank's KV bytes."""
    import hashlib
    import json
    snap = json.dumps(cache.allocator.snapshot(), sort_keys=True, default=repr)
    stats = cache.stats()
    return {"pid": os.getpid(), "digest": hashlib.sha256(snap.encode()).hexdigest(),
            "free_units": cache.allocator.num_free_units(), "total_units": cache.allocator.num_total_units(),
            "bytes_per_token": cache.shape.bytes_per_token, "reserved_bytes": stats.reserved_bytes,
            "mapped_bytes": stats.mapped_bytes}


def serve(rank: int, model: Any, cache: Any, groups: Groups) -> None:
    mirror = Mirror(cache.allocator)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=groups.control)
        kind, msg = box[0]
        items = mirror.apply(msg)
        if kind == "stop":
            return
        if kind == "info":
            dist.all_gather_object([None] * dist.get_world_size(), rank_info(cache), group=groups.control)
        elif items:
            forward(model, cache, items)


def forward(model: Any, cache: Any, items: list) -> None:
    meta = cache.storage.prepare(items)
    meta.logits_indices = meta.logits_indices[:0]        # rank 0 samples: skip the LM head here
    ids = [t for it in items for t in it.seq.token_ids[it.start:it.context_len]]
    input_ids = torch.tensor(ids, dtype=torch.int64, device=model.device)
    with torch.inference_mode():
        model.forward(input_ids, meta.input_positions, cache.storage, meta)


if __name__ == "__main__":
    sys.exit(main())
