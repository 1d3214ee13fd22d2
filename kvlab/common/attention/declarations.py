"""The kernel declarations: one entry per attention kernel, naming its layout, its implementation, the package
it needs and its rules (common/attention/rules.py). Declaring imports no optional library."""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlab.common.attention import rules
from kvlab.common.attention.contiguous import contiguous_attention_sdpa
from kvlab.common.attention.rules import HERE, Environment, package_available
from kvlab.common.attention.spec import PHASES, AttentionSpec
from kvlab.common.kv.registry import REGISTRY as BACKENDS

Kernel = Callable[..., torch.Tensor]   # fn(q [T,H,D], k_cache, v_cache, meta, scale) -> out [T,H,D]


@dataclass(slots=True)
class KernelDecl:
    """A registry entry. `impl` is the kernel, or "module:function" imported only when the kernel is chosen."""
    name: str
    layout: str
    impl: Kernel | str
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

    def load(self) -> Kernel:
        if callable(self.impl):
            return self.impl
        module, func = self.impl.split(":")
        return getattr(importlib.import_module(module), func)


def registry(env: Environment = HERE) -> list[KernelDecl]:
    """One declaration per kernel: the contiguous layout's, declared here, then each registered backend's own
    (`BackendSpec.kernels`: the paged kernels live in the paged package, which common does not import); `env`
    says which packages count as installed (None: this process).

    Implementations named by string are imported only when chosen: those that wrap an optional library
    (flash-attn, FlashInfer, Triton, FlexAttention) must cost nothing, and fall back, where it is missing or
    broken."""
    installed = env.installed
    own = [
        KernelDecl("torch_sdpa_contiguous", "contiguous", contiguous_attention_sdpa, check=rules.torch_rules,
                   description="torch SDPA over per-slot views of the contiguous cache"),
        KernelDecl("flash_attn_contiguous", "contiguous",
                   "kvlab.common.attention.flash_attn_contiguous:contiguous_attention_flash_attn",
                   package="flash_attn", installed=installed, check=rules.flash_attn_rules,
                   description="flash_attn_with_kvcache(cache_batch_idx=..., block_table=None)"),
    ]
    return own + [decl for spec in BACKENDS.specs() if spec.kernels for decl in _load(spec.kernels)(env)]


def _load(entry: str) -> Callable[[Environment], list[KernelDecl]]:
    module, function = entry.split(":")
    return getattr(importlib.import_module(module), function)


@functools.cache
def _here() -> list[KernelDecl]:
    return registry()


def kernels_for(layout: str) -> list[str]:
    """The names of the kernels declared for a layout (whether they can run here is the dispatcher's call)."""
    return [d.name for d in _here() if d.layout == layout]


def __getattr__(name: str) -> list[KernelDecl]:
    """REGISTRY: this process's declarations, made on first use (after the backends registered, since the
    backends' specs declare their own kernels)."""
    if name == "REGISTRY":
        return _here()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
