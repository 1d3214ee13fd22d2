"""What the fallback study reads from the kernel registry: a decision per phase without importing any kernel,
the machines it simulates, the head dim each kernel really computes with, and the rule family of a reason."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.common.attention.declarations import REGISTRY
from kvlab.common.attention.dispatch import Refusal, dispatcher_for
from kvlab.common.attention.rules import Environment, package_available
from kvlab.common.attention.spec import PHASES, AttentionSpec
from kvlab.common.attention.triton_tiles import head_pad


@dataclass(slots=True)
class PhaseDecision:
    kernel: str                   # the kernel that runs
    displaced: list[Refusal]      # higher-priority kernels refused, in priority order, with their reasons
    candidates: list[str]         # every kernel that can run, in run-time fallback order

    @property
    def is_fallback(self) -> bool:
        return bool(self.displaced)


@dataclass(slots=True)
class Decision:
    spec: AttentionSpec
    choice: str
    phases: dict[str, PhaseDecision]
    refusals: list[Refusal]


def decide(spec: AttentionSpec, choice: str = "auto", env: Environment | None = None) -> Decision:
    """What `make_dispatcher` would choose, without importing any kernel implementation or warning.
    Raises KernelUnavailable like `make_dispatcher` (explicit kernel that cannot run, or no kernel at all)."""
    d = dispatcher_for(spec, choice, env)
    by_key = {(r.kernel, r.phase): r for r in d.refusals}
    phases = {phase: PhaseDecision(d.chosen(phase), [by_key[(n, phase)] for n in d.displaced.get(phase, [])],
                                   [k.name for k in d.candidates[phase]])
              for phase in PHASES}
    return Decision(d.spec, choice, phases, d.refusals)


def packages_here() -> frozenset[str]:
    """The kernel packages importable in this process."""
    return frozenset(d.package for d in REGISTRY if d.package and package_available(d.package))


def simulated(*extra_packages: str, triton_interpret: bool | None = None) -> Environment:
    """This machine's packages plus `extra_packages` (e.g. "flash_attn", "flashinfer")."""
    return Environment(packages_here() | frozenset(extra_packages), triton_interpret)


# -- silent costs of a kernel that does run -----------------------------------------------------------------
FA_HEAD_DIMS = (32, 64, 96, 128, 192, 256)   # flash-attn's compiled head dims (static_switch.h)


def kernel_head_dim(kernel: str, head_dim: int) -> int:
    """The head dim a kernel computes with: flash-attn rounds up to its next compiled size, Triton and
    FlexAttention to a power of two (>= 16 for Triton's tl.dot); the others compute exactly `head_dim`."""
    if kernel.startswith("flash_attn"):
        return next((d for d in FA_HEAD_DIMS if d >= head_dim), head_dim)
    if kernel == "triton_paged":
        return head_pad(head_dim)
    if kernel == "flex_paged":
        return 1 << (head_dim - 1).bit_length()
    return head_dim


# -- reading reasons -----------------------------------------------------------------------------------------
CAUSES = ("package", "device", "compute_capability", "dtype", "head_dim", "block_size", "gqa", "layout",
          "shared_memory", "kv_dtype", "window")
_CAUSE_PREFIXES = (
    ("ImportError", "package"), ("device", "device"), ("compute capability", "compute_capability"),
    ("dtype", "dtype"), ("head_size", "head_dim"), ("block_size", "block_size"), ("GQA", "gqa"),
    ("layout", "layout"), ("shared memory", "shared_memory"), ("kv_cache_dtype", "kv_dtype"),
    ("sliding window", "window"),
)


def reason_cause(reason: str) -> str:
    """The rule family a refusal reason belongs to (one of CAUSES, or "other")."""
    for prefix, cause in _CAUSE_PREFIXES:
        if reason.startswith(prefix):
            return cause
    return "other"
