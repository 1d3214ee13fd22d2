"""The roofline cost model and the RooflineRunner: no model, a simulated clock.

A decode step reads every weight once and the K/V of every cached token the batch attends to, so it costs
(weight bytes + KV tokens read x KV bytes per token) / bandwidth. Prefill, when modelled, is compute-bound:
tokens x 2 x params / (peak FLOP/s x MFU). The seed article ignores prefill (identical across policies), so
that term is off by default.

Tensor parallelism (`ModelSpec.tp`): a ModelSpec describes one rank's shard, sharded as common/dist/ shards
the real model (heads, KV heads and MLP columns divided by tp; embedding, norms and LM head replicated), so
weight bytes, KV bytes per token and FLOPs are per rank. Each step adds 2 ring all-reduces per layer of the
step's [tokens, hidden] activations over the hardware's interconnect (docs/tensor-parallel.md, "Simulator").
At tp=1 every figure is the unsharded model's, unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvlab.common.errors import ConfigError
from kvlab.common.kv.types import KVShape
from kvlab.common.model_config import ModelConfig

if TYPE_CHECKING:
    from kvlab.common.request import SchedulerOutput
    from kvlab.experiments.sim.kernels import KernelTerm


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    bandwidth: float          # HBM bytes/s
    peak_flops: float         # dense bf16 FLOP/s
    memory_bytes: float
    link_bandwidth: float = 0.0   # all-reduce bus bandwidth per GPU, bytes/s (an assumption, see below)
    link_latency: float = 0.0     # seconds per ring step of an all-reduce (an assumption, see below)


# Interconnect figures are approximations, not measurements. Bandwidth: NVIDIA's published NVLink bandwidth per
# GPU, one direction (NVLink 4 on H100/H200 SXM: 900 GB/s total = 450 GB/s each way; NVLink 3 on A100 SXM:
# 600 GB/s total = 300 GB/s each way), used as the ring all-reduce's bus bandwidth (nccl-tests' "busbw"
# convention; measured busbw is typically somewhat lower). Latency: 2 us per ring step, an assumed round
# figure for one NVLink hop plus NCCL's per-step overhead (small-message all-reduces on NVLink cost ~10-20 us).
NVLINK_LATENCY = 2e-6
HARDWARE = {
    "h100": Hardware("h100", 3.35e12, 989e12, 80e9, 450e9, NVLINK_LATENCY),
    "h200": Hardware("h200", 4.8e12, 989e12, 141e9, 450e9, NVLINK_LATENCY),
    "a100-80g": Hardware("a100-80g", 2.039e12, 312e12, 80e9, 300e9, NVLINK_LATENCY),
}


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int,
           tied: bool = False, window: int | None = None, max_positions: int = 8192) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tied,
                       max_position_embeddings=max_positions, sliding_window=window)


MODEL_CONFIGS = {
    "llama3-8b": _llama(128256, 4096, 14336, 32, 32, 8, 128),
    "llama3-70b": _llama(128256, 8192, 28672, 80, 64, 8, 128),
    "llama2-7b": _llama(32000, 4096, 11008, 32, 32, 32, 128),
    "smollm2-135m": _llama(49152, 576, 1536, 30, 9, 3, 64, tied=True),
    # Mistral-7B v0.1 (sliding window 4096 in every layer), and the same model with full attention
    "mistral-7b": _llama(32000, 4096, 14336, 32, 32, 8, 128, window=4096, max_positions=32768),
    "mistral-7b-full": _llama(32000, 4096, 14336, 32, 32, 8, 128, max_positions=32768),
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
KV_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1}     # kv_cache_dtype "auto" stores the model dtype


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the cost model needs from an architecture, at the serving dtype, for one of `tp` ranks (the
    weight, KV and FLOP figures are one rank's shard; at tp=1, the whole model)."""
    name: str
    config: ModelConfig
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"      # fp8_e4m3 / fp8_e5m2: 1-byte K/V (reads and capacity)
    tp: int = 1                       # tensor-parallel ranks

    def __post_init__(self) -> None:
        if self.tp != 1:
            from kvlab.common.dist.shard import check_tp_size
            check_tp_size(self.config, self.tp)     # one line naming the valid sizes

    @property
    def shard(self) -> ModelConfig:
        """One rank's ModelConfig, as common/dist/ shards it (the model itself at tp=1)."""
        if self.tp == 1:
            return self.config
        from kvlab.common.dist.shard import shard_config
        return shard_config(self.config, self.tp)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_params(self) -> int:
        """Parameters one rank holds (sharded layers / tp + the replicated embedding, norms and LM head)."""
        return self.shard.num_params

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.shard
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * KV_DTYPE_BYTES.get(self.kv_cache_dtype, self.itemsize)

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.num_params

    @property
    def activation_bytes_per_token(self) -> int:
        """What one all-reduce moves per token: one row of [tokens, hidden] at the model dtype."""
        return self.config.hidden_size * self.itemsize

    def kv_shape(self, device: str = "cuda") -> KVShape:
        """One rank's cache shape, for accounting-only caches: the device only tells the vmm driver how mappings
        behave (CUDA mappings never merge, host VMAs do); nothing is allocated."""
        c = self.shard
        return KVShape(c.num_layers, c.num_kv_heads, c.head_dim, c.num_heads, dtype=self.dtype, device=device,
                       kv_cache_dtype=self.kv_cache_dtype, sliding_window=c.sliding_window)


def model_spec(name_or_path: str, dtype: str = "bfloat16", kv_cache_dtype: str = "auto", tp: int = 1) -> ModelSpec:
    """A preset name (llama3-8b, llama3-70b, llama2-7b, mistral-7b[-full], smollm2-135m, tiny) or an HF
    config.json / model dir; `tp` > 1: one rank's shard of it (ConfigError when tp does not divide it)."""
    if kv_cache_dtype != "auto" or tp != 1:
        import dataclasses
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        return dataclasses.replace(model_spec(name_or_path, dtype), kv_cache_dtype=kv_cache_dtype, tp=tp)
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")
    if name_or_path in MODEL_CONFIGS:
        return ModelSpec(name_or_path, MODEL_CONFIGS[name_or_path], dtype)
    if name_or_path == "tiny":
        from kvlab.common.presets import TINY_CONFIG
        return ModelSpec("tiny", TINY_CONFIG, dtype)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        from kvlab.common.loader import config_from_hf, read_json
        return ModelSpec(path.parent.name, config_from_hf(read_json(path), path), dtype)
    raise ConfigError(f"unknown model {name_or_path!r}; use one of {', '.join([*MODEL_CONFIGS, 'tiny'])} "
                      f"or a path to an HF config.json")


def hardware(name: str) -> Hardware:
    if name not in HARDWARE:
        raise ConfigError(f"unknown hardware {name!r}; choose one of: {', '.join(HARDWARE)}")
    return HARDWARE[name]


@dataclass(frozen=True, slots=True)
class RooflineCost:
    hardware: Hardware
    model: ModelSpec
    model_prefill: bool = False      # off, as in the seed article
    mfu: float = 0.5
    # the model's figures every step reads, worked out once (ModelSpec derives each from its config per call)
    _weight_bytes: int = field(init=False, repr=False, compare=False)
    _kv_bytes_per_token: int = field(init=False, repr=False, compare=False)
    _flops_per_token: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"mfu must be in (0, 1], got {self.mfu}")
        if self.model.tp > 1 and self.hardware.link_bandwidth <= 0:
            raise ConfigError(f"hardware {self.hardware.name!r} has no interconnect bandwidth; tensor parallelism "
                              f"needs link_bandwidth > 0")
        object.__setattr__(self, "_weight_bytes", self.model.weight_bytes)
        object.__setattr__(self, "_kv_bytes_per_token", self.model.kv_bytes_per_token)
        object.__setattr__(self, "_flops_per_token", self.model.flops_per_token)

    def decode_seconds(self, kv_tokens: int) -> float:
        """One step that reads all weights and `kv_tokens` cached tokens."""
        return (self._weight_bytes + kv_tokens * self._kv_bytes_per_token) / self.hardware.bandwidth

    def kv_read_seconds(self, kv_tokens: int) -> float:
        """Reading `kv_tokens` cached tokens' K/V at full bandwidth: the roofline's attention time."""
        return kv_tokens * self._kv_bytes_per_token / self.hardware.bandwidth

    def attention_compute_seconds(self, query_key_pairs: float) -> float:
        """QK^T and PV over `query_key_pairs` (query, key) pairs in every layer and head, at `mfu` of peak."""
        c = self.model.shard
        flops = 4.0 * query_key_pairs * c.num_heads * c.head_dim * c.num_layers
        return flops / (self.hardware.peak_flops * self.mfu)

    def prefill_seconds(self, tokens: int) -> float:
        """Compute-bound prefill (or recompute) of `tokens` tokens at `mfu` of peak."""
        return tokens * self._flops_per_token / (self.hardware.peak_flops * self.mfu)

    def allreduce_seconds(self, tokens: int) -> float:
        """One ring all-reduce of [tokens, hidden] over tp ranks: 2(tp-1) steps, each moving 1/tp of the bytes
        over the link, plus the link latency per step: 2(tp-1)/tp x bytes / bus bandwidth + 2(tp-1) x latency."""
        tp = self.model.tp
        if tp == 1:
            return 0.0
        steps = 2 * (tp - 1)
        nbytes = tokens * self.model.activation_bytes_per_token
        return steps / tp * nbytes / self.hardware.link_bandwidth + steps * self.hardware.link_latency

    def comm_seconds(self, tokens: int) -> float:
        """A step's all-reduces: 2 per layer (after o_proj and after down_proj); 0 at tp=1."""
        if self.model.tp == 1:
            return 0.0
        return 2 * self.model.config.num_layers * self.allreduce_seconds(tokens)

    def step_seconds(self, kv_tokens: int, prefill_tokens: int, comm_tokens: int = 0) -> float:
        """One rank's step: its shard's roofline, plus the all-reduces of `comm_tokens` activations at tp > 1."""
        step = self.decode_seconds(kv_tokens)
        step = step + self.prefill_seconds(prefill_tokens) if self.model_prefill else step
        return step + self.comm_seconds(comm_tokens) if self.model.tp > 1 else step


class RooflineRunner:
    """Engine runner without a model: every scheduled item gets `token_id`, and the clock advances by the
    roofline time of the step. Sequences must ignore EOS (the simulator's requests do). With a `kernel` term
    (experiments/sim/kernels.py) each item's attention is charged at its layout's speed; without one, a step
    costs exactly the roofline's. `step_seconds` sums the steps, `attention_seconds` their attention part, and
    `driver_seconds` what a wrapper (the serving tap) added to them for driver calls."""

    def __init__(self, cost: RooflineCost, token_id: int = 0, kernel: KernelTerm | None = None) -> None:
        self.cost = cost
        self.token_id = token_id
        self.kernel = kernel
        self.now = 0.0
        self.steps = 0
        self.prefill_tokens = 0
        self.comm_seconds = 0.0       # simulated time in all-reduces (tp > 1)
        self.step_seconds = 0.0
        self.attention_seconds = 0.0
        self.driver_seconds = 0.0

    def clock(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        """Idle until `t` (the next arrival) when nothing is scheduled."""
        self.now = max(self.now, t)

    def execute(self, out: SchedulerOutput) -> dict[int, int]:
        kv_tokens = prefill = decode = 0
        attention = 0.0
        sampled: dict[int, int] = {}
        token, kernel = self.token_id, self.kernel
        window = self.cost.model.config.sliding_window
        for item in out.items:              # once per running sequence per step, so kept flat
            n, start = item.num_tokens, item.start
            # keys the item's last query reads: a sliding-window model reads at most W (its kernels skip the rest)
            attended = start + n if window is None else min(start + n, window + n - 1)
            kv_tokens += attended
            if kernel is not None:
                attention += self.item_attention(start, n, attended)
            if n > 1:
                prefill += n
            else:
                decode += n
            if item.needs_logits:
                sampled[item.seq.seq_id] = token
        if out.items:
            self.charge_step(kv_tokens, prefill, decode, attention)
        return sampled

    def item_attention(self, start: int, n: int, attended: int) -> float:
        """One item's attention under the kernel term: its ideal time (K/V reads; for a modelled prefill, the
        larger of those and its FLOPs) times its layout's factor for the phase."""
        cost, kernel = self.cost, self.kernel
        read = cost.kv_read_seconds(attended)
        if n == 1:
            return read * kernel.factor("decode", attended)
        window = cost.model.config.sliding_window
        per_query = start + (n + 1) / 2 if window is None else min(start + (n + 1) / 2, window)
        compute = cost.attention_compute_seconds(n * per_query) if cost.model_prefill else 0.0
        return max(read, compute) * kernel.factor("prefill", attended)

    def charge_step(self, kv_tokens: int, prefill: int, decode: int, attention: float) -> None:
        # all-reduced activations: the decode tokens, and the prefill tokens when prefill is charged at all
        comm_tokens = decode + (prefill if self.cost.model_prefill else 0)
        if self.kernel is None:
            step = self.cost.step_seconds(kv_tokens, prefill, comm_tokens)
            attention = self.cost.kv_read_seconds(kv_tokens)
        else:
            step = self.cost.step_seconds(0, prefill, comm_tokens) + attention
        self.now += step
        self.step_seconds += step
        self.attention_seconds += attention
        self.comm_seconds += self.cost.comm_seconds(comm_tokens)
        self.steps += 1
        self.prefill_tokens += prefill
