"""The TorchRunner: one step of the real model over any backend.

Runner interface (the Engine needs nothing else; experiments/sim/roofline.py implements it without a model):
- `execute(out: SchedulerOutput) -> dict[seq_id, list[(token, logprob)] | token]`: compute `out.items`
  (the cache already holds room for them) and return a sample for every item with `needs_logits`;
  `out.specs[seq_id]` says how many samples (n at parallel sampling's first token, 2 * beam_width beam
  candidates). A bare token id means "every requested sample is this token, logprob 0" (no logits).
- `clock() -> float`: seconds on the runner's clock (wall time here, simulated for the RooflineRunner).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvlab.common.errors import ConfigError, ModelLoadError
from kvlab.common.sampler import Sample, Sampler

if TYPE_CHECKING:
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.model import LlamaForCausalLM
    from kvlab.common.request import SchedulerOutput


class TorchRunner:
    def __init__(self, model: LlamaForCausalLM, cache: KVCache, seed: int = 0,
                 max_model_len: int | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.sampler = Sampler(seed, self.device)
        if max_model_len is not None:
            check_model_len(max_model_len, model.config.max_position_embeddings)
            model.ensure_rope_len(max_model_len)

    def clock(self) -> float:
        return time.perf_counter()

    def execute(self, out: SchedulerOutput) -> dict[int, list[Sample]]:
        items = out.items
        if not items:
            return {}
        meta = self.cache.prepare(items)
        ids = [t for it in items for t in it.seq.token_ids[it.start:it.context_len]]
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            logits = self.model.forward(input_ids, meta.input_positions, self.cache, meta)
        if not torch.isfinite(logits).all():
            raise ModelLoadError("the model produced non-finite logits (NaN or Inf): its weights are corrupt or "
                                 "overflow the dtype; check the checkpoint or use float32")
        rows = [it.seq.seq_id for it in items if it.needs_logits]
        if not rows:
            return {}
        seqs = [it.seq for it in items if it.needs_logits]
        samples = self.sampler(logits, [out.specs[sid] for sid in rows], seqs)
        return dict(zip(rows, samples))


def check_model_len(max_model_len: int, max_positions: int) -> None:
    """RoPE past the positions a model was trained for gives garbage, not an error: refuse it up front."""
    if max_model_len > max_positions:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                          f"{max_positions}; lower max_model_len")
