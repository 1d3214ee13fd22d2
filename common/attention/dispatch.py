"""What an attention kernel declares, and the dispatcher that picks one per phase and falls back at run time.

Kernel implementations live next to their backend (paged/kernels/, vmm/kernels.py); their declarations
(what they support, transcribed from the real libraries) live in common/kernels.py.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from kvlab.common.errors import KernelUnavailable

log = logging.getLogger("kvlab.kernels")

PHASES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Everything a kernel's support predicate may look at."""
    layout: str                      # "paged" | "contiguous"
    device: str                      # "cpu" | "cuda"
    dtype: str                       # "float32" | "float16" | "bfloat16"
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int | None = None    # tokens per block (paged layout)
    compute_capability: tuple[int, int] | None = None  # cuda only

    @property
    def gqa_ratio(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(slots=True)
class KernelDecl:
    """A registry entry. `impl` is "module:function" with the signature
    fn(q [T,H,D], k_cache, v_cache, meta, scale) -> out [T,H,D]; imported only when chosen."""
    name: str
    layout: str
    impl: str
    phases: tuple[str, ...] = PHASES
    package: str | None = None       # importable module the kernel needs
    description: str = ""
    check: Callable[[AttentionSpec], list[str]] = lambda spec: []
    # rules that hold in one phase only (e.g. a decode-only API limit); `phase` is "prefill" or "decode"
    phase_check: Callable[[AttentionSpec, str], list[str]] = lambda spec, phase: []
    # how to tell whether `package` is importable; None asks importlib (a study may simulate other machines)
    installed: Callable[[str], bool] | None = None

    def reasons_against(self, spec: AttentionSpec, phase: str | None = None) -> list[str]:
        """Why this kernel cannot run `spec` (empty if it can); with `phase`, phase-specific rules too."""
        reasons = []
        if spec.layout != self.layout:
            reasons.append(f"layout {spec.layout} (kernel needs {self.layout})")
        if self.package and not (self.installed or package_available)(self.package):
            reasons.append(f"ImportError: package {self.package!r} is not installed")
        reasons += self.check(spec)
        if phase is not None:
            reasons += self.phase_check(spec, phase)
        return reasons

    def load(self) -> Callable[..., torch.Tensor]:
        module, func = self.impl.split(":")
        return getattr(importlib.import_module(module), func)


def package_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@dataclass(slots=True)
class Refusal:
    kernel: str
    phase: str
    reasons: list[str]


@dataclass(slots=True)
class KernelDispatcher:
    """Holds, per phase, the ordered list of kernels that can run the spec; runs the first and falls back
    to the next one if it raises (logged once, counted)."""
    spec: AttentionSpec
    candidates: dict[str, list[KernelDecl]]
    refusals: list[Refusal] = field(default_factory=list)
    displaced: dict[str, list[str]] = field(default_factory=dict)  # per phase: refused kernels ranked higher
    runtime_fallbacks: list[dict[str, str]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    workspace: dict[str, Any] = field(default_factory=dict)   # kernel scratch buffers, per cache
    _impls: dict[str, Callable[..., torch.Tensor]] = field(default_factory=dict)

    def chosen(self, phase: str) -> str:
        return self.candidates[phase][0].name

    def run(self, phase: str, q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        meta.workspace = self.workspace
        while True:
            decl = self.candidates[phase][0]
            try:  # an implementation that cannot even be imported (ABI mismatch, no module) falls back too
                fn = self._impls.get(decl.name) or self._impls.setdefault(decl.name, decl.load())
                out = fn(q, k_cache, v_cache, meta, scale)
            except Exception as exc:  # noqa: BLE001 - any kernel failure falls back, never silently
                self._fall_back(phase, decl, exc)
                continue
            self.calls[decl.name] = self.calls.get(decl.name, 0) + 1
            return out

    def _fall_back(self, phase: str, decl: KernelDecl, exc: Exception) -> None:
        rest = self.candidates[phase][1:]
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if not rest:
            raise KernelUnavailable(f"kernel {decl.name} failed in {phase} ({reason}) and no other kernel "
                                    f"can run this configuration") from exc
        log.warning("kernel %s failed in %s (%s); falling back to %s", decl.name, phase, reason, rest[0].name)
        self.runtime_fallbacks.append({"phase": phase, "kernel": decl.name, "fallback": rest[0].name,
                                       "reason": reason})
        self.candidates[phase] = rest

    def report(self) -> dict[str, Any]:
        return {
            "kernels": {phase: self.chosen(phase) for phase in self.candidates},
            "refused": [{"kernel": r.kernel, "phase": r.phase, "reasons": r.reasons} for r in self.refusals],
            "displaced": {phase: list(names) for phase, names in self.displaced.items()},
            "runtime_fallbacks": list(self.runtime_fallbacks),
            "calls": dict(self.calls),
        }


def build_dispatcher(spec: AttentionSpec, registry: list[KernelDecl], priority: list[str],
                     choice: str = "auto") -> KernelDispatcher:
    """`priority` orders kernel names for this device. `choice` is "auto" or one kernel name (used for
    every phase it supports; the other phase still goes auto)."""
    by_name = {d.name: d for d in registry}
    if choice != "auto" and choice not in by_name:
        raise KernelUnavailable(f"unknown kernel {choice!r}; known kernels: {', '.join(sorted(by_name))}")
    ordered = [by_name[n] for n in priority if n in by_name]
    candidates: dict[str, list[KernelDecl]] = {}
    refusals: list[Refusal] = []
    displaced: dict[str, list[str]] = {}
    for phase in PHASES:
        valid = []
        displaced[phase] = []
        for decl in ordered:
            if phase not in decl.phases:
                continue
            reasons = decl.reasons_against(spec, phase)
            if reasons:
                refusals.append(Refusal(decl.name, phase, reasons))
                if not valid:
                    displaced[phase].append(decl.name)
            else:
                valid.append(decl)
        if choice != "auto" and phase in by_name[choice].phases:
            bad = by_name[choice].reasons_against(spec, phase)
            if bad:
                raise KernelUnavailable(f"kernel {choice!r} cannot run {phase} for this configuration: "
                                        f"{'; '.join(bad)}")
            valid = [by_name[choice]] + [d for d in valid if d.name != choice]
            displaced[phase] = []  # the user's choice displaces nothing
        if not valid:
            why = "; ".join(f"{r.kernel}: {', '.join(r.reasons)}" for r in refusals if r.phase == phase)
            raise KernelUnavailable(f"no attention kernel can run {phase} for {spec}: {why}")
        candidates[phase] = valid
    for r in refusals:
        log.info("kernel %s refused for %s: %s", r.kernel, r.phase, "; ".join(r.reasons))
    return KernelDispatcher(spec, candidates, refusals, displaced)
