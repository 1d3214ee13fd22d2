"""The fallback study's grid: the machines it simulates, the model shapes it decides, and one Row per decision.

Decisions come from `decisions.decide` on simulated machines, so the CUDA rows are exact on a CPU machine:
deciding imports no kernel implementation (only --measure does, for kernels that run here).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvlab.common.attention.priority import priority
from kvlab.common.attention.rules import Environment
from kvlab.common.attention.spec import PHASES, AttentionSpec
from kvlab.common.errors import ConfigError
from kvlab.common.kv.registry import REGISTRY
from kvlab.experiments.studies.fallbacks.decisions import CAUSES, decide, kernel_head_dim, reason_cause, simulated

NUM_KV_HEADS = 2
H200_CC = (9, 0)
EXTRA_PACKAGES = ("flash_attn", "flashinfer")
DTYPES = ("float32", "float16", "bfloat16")
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class Grid:
    head_dims: tuple[int, ...] = (64, 72, 80, 96, 100, 112, 128, 192, 256)
    dtypes: tuple[str, ...] = DTYPES
    block_sizes: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)
    gqa_ratios: tuple[int, ...] = (1, 3, 4, 8)
    kv_dtypes: tuple[str, ...] = ("auto",)      # the KV-cache dtype axis (auto = the model dtype; fp8 variants)

    def num_rows(self, num_scenarios: int) -> int:
        """Rows of a paged-layout backend vary with block size; rows of a contiguous one (no blocks) do not."""
        shapes = len(self.head_dims) * len(self.dtypes) * len(self.gqa_ratios)
        layouts = list(layout_backends().values())
        points = layouts.count("paged") * len(self.block_sizes) + len(layouts) - layouts.count("paged")
        return num_scenarios * len(PHASES) * shapes * points * len(self.kv_dtypes)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    label: str
    device: str
    compute_capability: tuple[int, int] | None
    env: Environment


def default_scenarios() -> list[Scenario]:
    """This CPU as it is; an H200 (cc 9.0) with this machine's packages (the project's H200 has the same:
    triton and torch's flex_attention, no flash-attn, no FlashInfer); the H200 with both installed."""
    here = simulated()
    gpu = simulated(triton_interpret=False)   # a GPU machine compiles Triton kernels
    return [
        Scenario("cpu", "cpu (as installed)", "cpu", None, Environment(here.packages, None)),
        Scenario("cuda", "cuda cc 9.0 (as installed here)", "cuda", H200_CC, gpu),
        Scenario("cuda+fa+fi", "cuda cc 9.0 (+flash-attn, flashinfer)", "cuda", H200_CC,
                 simulated(*EXTRA_PACKAGES, triton_interpret=False)),
    ]


@dataclass(slots=True)
class Row:
    """One decision: a grid point x backend x phase in one scenario."""
    scenario: str
    device: str
    compute_capability: str | None
    packages: list[str]
    backend: str
    layout: str
    phase: str
    head_dim: int
    dtype: str
    block_size: int | None
    gqa_ratio: int
    num_q_heads: int
    num_kv_heads: int
    kernel: str
    kernel_head_dim: int               # the head dim the kernel computes with (padding)
    preferred: str                     # the device's first-priority kernel for this layout
    fallback: bool                     # a higher-priority kernel was refused
    displaced: list[str] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)              # rule families that refused the displaced
    reasons: dict[str, list[str]] = field(default_factory=dict)  # displaced kernel -> reasons
    refused: dict[str, list[str]] = field(default_factory=dict)  # every refused kernel this phase -> reasons
    kv_cache_dtype: str = "auto"


def layout_backends() -> dict[str, str]:
    """Backend -> layout: the first registered backend of each attention layout (paged -> paged, vmm ->
    contiguous), and every other backend of the paged layout (elastic). Kernels are chosen by layout, so vmm
    speaks for reserve; each block-table backend gets rows of its own because each sets its block size on its
    own (--block-size, --elastic-block-size) and a paged kernel's rules bite at block sizes, so elastic's
    fallbacks are counted beside paged's rather than assumed."""
    first: dict[str, str] = {}
    for spec in REGISTRY.specs():
        first.setdefault(spec.layout, spec.name)
    listed = set(first.values())
    return {spec.name: spec.layout for spec in REGISTRY.specs() if spec.name in listed or spec.layout == "paged"}


def grid_points(grid: Grid, layout: str) -> Iterator[tuple[int, str, int | None, int]]:
    blocks = grid.block_sizes if layout == "paged" else (None,)
    for head_dim in grid.head_dims:
        for dtype in grid.dtypes:
            for block_size in blocks:
                for gqa in grid.gqa_ratios:
                    yield head_dim, dtype, block_size, gqa


def cause_order(cause: str) -> int:
    return CAUSES.index(cause) if cause in CAUSES else len(CAUSES)


def causes_of(reasons: list[str]) -> list[str]:
    return sorted({reason_cause(r) for r in reasons}, key=cause_order)


def decide_rows(scenario: Scenario, backend: str, layout: str, head_dim: int, dtype: str, block_size: int | None,
                gqa: int, kv_dtype: str = "auto") -> list[Row]:
    spec = AttentionSpec(layout, scenario.device, dtype, head_dim, gqa * NUM_KV_HEADS, NUM_KV_HEADS,
                         block_size, scenario.compute_capability, kv_cache_dtype=kv_dtype)
    decision = decide(spec, env=scenario.env)
    cc = scenario.compute_capability
    shared = {"scenario": scenario.name, "device": scenario.device,
              "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
              "packages": sorted(scenario.env.packages or ()), "backend": backend, "layout": layout,
              "head_dim": head_dim, "dtype": dtype, "block_size": block_size, "gqa_ratio": gqa,
              "kv_cache_dtype": kv_dtype,
              "num_q_heads": spec.num_q_heads, "num_kv_heads": NUM_KV_HEADS,
              "preferred": priority(scenario.device, layout)[0]}
    rows = []
    for phase, pd in decision.phases.items():
        reasons = {r.kernel: list(r.reasons) for r in pd.displaced}
        rows.append(Row(**shared, phase=phase, kernel=pd.kernel,
                        kernel_head_dim=kernel_head_dim(pd.kernel, head_dim), fallback=pd.is_fallback,
                        displaced=list(reasons), causes=causes_of([x for rs in reasons.values() for x in rs]),
                        reasons=reasons,
                        refused={r.kernel: list(r.reasons) for r in decision.refusals if r.phase == phase}))
    return rows


def run_grid(grid: Grid, scenarios: list[Scenario], progress: bool = False) -> list[Row]:
    jobs = [(s, b, layout, *p, kv) for s in scenarios for b, layout in layout_backends().items()
            for p in grid_points(grid, layout) for kv in grid.kv_dtypes]
    if progress:
        from kvlab.experiments.reporting.tables import progress_bar
        jobs = progress_bar(jobs, desc="deciding", unit="config", leave=False)
    return [row for job in jobs for row in decide_rows(*job)]


def row_key(row: Row) -> tuple:
    return (row.scenario, row.backend, row.phase, row.head_dim, row.dtype, row.block_size, row.kv_cache_dtype,
            row.gqa_ratio)


def check_grid(grid: Grid) -> None:
    lists = (grid.head_dims, grid.dtypes, grid.block_sizes, grid.gqa_ratios)
    sizes = grid.head_dims + grid.block_sizes + grid.gqa_ratios
    if not all(lists) or any(d not in DTYPES for d in grid.dtypes) or any(x < 1 for x in sizes):
        raise ConfigError(f"fallbacks grid: dtypes must be among {', '.join(DTYPES)}; head dims, block "
                          "sizes and GQA ratios non-empty lists of positive integers")
    if not grid.kv_dtypes or any(k not in KV_DTYPES for k in grid.kv_dtypes):
        raise ConfigError(f"fallbacks grid: kv dtypes must be a non-empty list among {', '.join(KV_DTYPES)}")
