"""vmm's two KV layouts in the simulator, and the cross-layer layout's optional attention penalty.

- per-layer (kvlab's and vAttention's default): 2L virtual tensors K_0..K_{L-1}, V_0..V_{L-1}, each
  [slots, max_len, H_kv, D]. A page holds page / (H_kv * D * elem) tokens of one layer's K or V; a sequence grows
  by one page in each of the 2L tensors: 2L cuMemMap calls, and up to 2L partly filled pages stranded at its end.
- cross-layer (vAttention's "megacache"): 2 virtual tensors K and V, each [slots, max_len, L, H_kv, D]. A page
  holds page / (L * H_kv * D * elem) tokens of every layer's K (or V): L times fewer tokens per page, 2 map calls
  per growth, and at most 2 partly filled pages stranded per sequence.

The simulator books a cross-layer case exactly as the per-layer backend with pages L times smaller: the same
tokens per page, the same number of page groups in the budget (budget / (2 x page)) and the same stranding. Only
the driver calls differ: each real cross-layer page stands for L of those emulated pages, mapped in one call, so
the tap divides the driver's counters by L (`layers_per_page`) and charges the real page's per-call latency.

The penalty: a cross-layer stride puts each layer's slice of a block on its own page, which costs TLB reach and
L2 reuse. kvcached's layout benchmark (ovg-project/kvcached benchmarks/bench_layout, GB10) measured attention
+56% and request throughput -31% for a cross-layer contiguous layout; docs/evidence.md records the figure and
what it compares. It is an option (`kvcached`), not the default (`none`): kvlab's layout keeps a sequence's
tokens adjacent, and whether the penalty appears on an H100/H200 is for the GPU check to measure.
"""
from __future__ import annotations

from typing import Any

from kvlab.common.errors import ConfigError
from kvlab.experiments.sim.roofline import ModelSpec, RooflineRunner

LAYOUTS = ("per-layer", "cross-layer")
CROSS_LAYER = "cross-layer"
LAYOUT_OPTION = "vmm_layout"          # the SimCase option naming the layout (absent: per-layer)
HOST_PAGE = 4096
PENALTIES = {"none": 0.0, "kvcached": 0.56}
PENALTY_SOURCES = {"none": "no layout penalty (default)",
                   "kvcached": "kvcached benchmarks/bench_layout, GB10: attention +56% for a cross-layer stride "
                               "(docs/evidence.md)"}


def add_layout_flags(p: Any, each: str) -> None:
    """--vmm-layout and --layout-penalty, for every command that simulates vmm; `each`: what runs once per layout."""
    from kvlab.experiments.cli.flags import parse_list
    p.add_argument("--vmm-layout", type=parse_list, default=["per-layer"],
                   help=f"comma list of {', '.join(LAYOUTS)}: {each} runs in each (vmm-SIZE-crosslayer names one)")
    p.add_argument("--layout-penalty", choices=list(PENALTIES), default="none",
                   help="a cross-layer case's attention penalty: none (default) or kvcached (+56%%, kvcached's "
                        "bench_layout on GB10; docs/evidence.md)")


def check_layout(name: str) -> str:
    if name not in LAYOUTS:
        raise ConfigError(f"unknown vmm layout {name!r}; choose one of: {', '.join(LAYOUTS)}")
    return name


def check_penalty(name: str) -> float:
    if name not in PENALTIES:
        raise ConfigError(f"unknown layout attention penalty {name!r}; choose one of: {', '.join(PENALTIES)}")
    return PENALTIES[name]


def layers(model: ModelSpec) -> int:
    return model.shard.num_layers


def tokens_per_page(page_size: int, model: ModelSpec, layout: str = "per-layer") -> int:
    """Tokens one page holds: of one layer's K (or V) per-layer, of every layer's cross-layer."""
    per_layer_token = model.kv_bytes_per_token // (2 * layers(model))
    per_token = per_layer_token * (layers(model) if layout == CROSS_LAYER else 1)
    return page_size // per_token


def tensors(model: ModelSpec, layout: str = "per-layer") -> int:
    """Virtual tensors (one contiguous range per sequence each): 2L per-layer, K and V cross-layer."""
    return 2 if layout == CROSS_LAYER else 2 * layers(model)


def emulated_page(page_size: int, model: ModelSpec) -> int:
    """The per-layer page size that books a cross-layer page of `page_size` (see the module's note)."""
    n = layers(model)
    if page_size % n or (page_size // n) % HOST_PAGE:
        raise ConfigError(f"a cross-layer vmm page of {page_size} B over {n} layers leaves {page_size / n:g} B per "
                          f"layer, not a multiple of {HOST_PAGE} B; use a page of at least {n * HOST_PAGE} B "
                          f"(e.g. 2MiB)")
    return page_size // n


def layers_per_page(options: dict, model: ModelSpec) -> int:
    """How many emulated per-layer pages one real page of the case stands for (1 unless cross-layer)."""
    return layers(model) if options.get(LAYOUT_OPTION) == CROSS_LAYER else 1


class LayoutRunner(RooflineRunner):
    """The roofline runner with a layout's attention penalty: every step's attention time x (1 + penalty)."""

    def __init__(self, *args, penalty: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.penalty = penalty

    def charge_step(self, kv_tokens: int, prefill: int, decode: int, attention: float) -> None:
        before = self.attention_seconds
        super().charge_step(kv_tokens, prefill, decode, attention)
        extra = (self.attention_seconds - before) * self.penalty
        self.now += extra
        self.step_seconds += extra
        self.attention_seconds += extra
