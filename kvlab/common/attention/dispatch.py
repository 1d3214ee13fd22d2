"""The dispatcher: per phase, the kernels that can run a spec in priority order; it runs the first and falls
back to the next if it raises. Backends build one with `make_dispatcher(AttentionSpec(...), config.kernel)`.

Every refusal is recorded with its reasons (logged at INFO, listed in `report()["refused"]`); a higher-priority
kernel displaced by a rule is warned about once; a run-time fallback is warned about once and counted.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.common.attention import declarations
from kvlab.common.attention.bounds import check_metadata
from kvlab.common.attention.declarations import KernelDecl
from kvlab.common.attention.priority import priority
from kvlab.common.attention.rules import Environment
from kvlab.common.attention.spec import PHASES, AttentionSpec, base_device
from kvlab.common.errors import KernelUnavailable

log = logging.getLogger("kvlab.kernels")

__all__ = ["AttentionSpec", "KernelDispatcher", "Refusal", "build_dispatcher", "dispatcher_for",
           "make_dispatcher", "resolve"]


@dataclass(slots=True)
class Refusal:
    kernel: str
    phase: str
    reasons: list[str]


@dataclass(slots=True)
class KernelDispatcher:
    """Holds, per phase, the ordered list of kernels that can run the spec; runs the first and falls back
    to the next one if it raises (logged once, counted), after checking the metadata's bounds."""
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
                check_metadata(meta, q, k_cache)   # bad metadata raises here: the backend's error, no fallback
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


def resolve(spec: AttentionSpec) -> AttentionSpec:
    """Normalise "cuda:N" to "cuda"; for a present GPU fill in its compute capability and, when the spec is
    about that GPU, its opt-in shared memory per block."""
    device = base_device(spec.device)
    cc, shared = spec.compute_capability, spec.shared_memory_per_block
    if device == "cuda" and torch.cuda.is_available():
        index = int(spec.device.split(":")[1]) if ":" in spec.device else torch.cuda.current_device()
        present = tuple(torch.cuda.get_device_capability(index))
        cc = present if cc is None else cc
        if shared is None and tuple(cc) == present:
            shared = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", None)
    return dataclasses.replace(spec, device=device, compute_capability=cc, shared_memory_per_block=shared)


def dispatcher_for(spec: AttentionSpec, choice: str = "auto", env: Environment | None = None) -> KernelDispatcher:
    """The dispatcher `make_dispatcher` builds, without its warnings; `env` simulates another machine's
    packages (None: this process, through the module's REGISTRY)."""
    spec = resolve(spec)
    decls = declarations.REGISTRY if env is None else declarations.registry(env)
    return build_dispatcher(spec, decls, priority(spec.device, spec.layout), choice)


def make_dispatcher(spec: AttentionSpec, choice: str = "auto",
                    env: Environment | None = None) -> KernelDispatcher:
    """The backend's dispatcher. A higher-priority kernel displaced by a rule is a fallback: logged as a
    warning with every reason (once, here) and listed in `report()["displaced"]`."""
    dispatcher = dispatcher_for(spec, choice, env)
    reasons = {(r.kernel, r.phase): r.reasons for r in dispatcher.refusals}
    for phase, names in dispatcher.displaced.items():
        if names:
            why = "; ".join(f"{n}: {', '.join(reasons[(n, phase)])}" for n in names)
            log.warning("%s %s attention uses %s instead of %s (%s)", spec.layout, phase,
                        dispatcher.chosen(phase), names[0], why)
    return dispatcher
