"""The kernel declarations: one entry per attention kernel, naming its layout, its implementation, the package
it needs and its rules (common/attention/rules.py). Declaring imports no optional library."""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvlab.common.attention import rules
from kvlab.common.attention.contiguous import contiguous_attention_sdpa
from kvlab.common.attention.rules import HERE, Environment, package_available
from kvlab.common.attention.spec import PHASES, AttentionSpec

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
    """One declaration per kernel; `env` says which packages count as installed (None: this process).

    Implementations named by string are imported only when chosen: those that wrap an optional library
    (flash-attn, FlashInfer, Triton, FlexAttention) must cost nothing, and fall back, where it is missing or
    broken; the paged kernels live in the paged package, which common does not import."""
    installed = env.installed
    return [
        KernelDecl("torch_sdpa_contiguous", "contiguous", contiguous_attention_sdpa, check=rules.torch_rules,
                   description="torch SDPA over per-slot views of the contiguous cache"),
        KernelDecl("flash_attn_contiguous", "contiguous",
                   "kvlab.common.attention.flash_attn_contiguous:contiguous_attention_flash_attn",
                   package="flash_attn", installed=installed, check=rules.flash_attn_rules,
                   description="flash_attn_with_kvcache(cache_batch_idx=..., block_table=None)"),
        KernelDecl("torch_paged", "paged", "kvlab.paged.kernels.torch_ref:paged_attention_torch",
                   description="gather by block table into a buffer, then SDPA", check=rules.torch_rules),
        KernelDecl("triton_paged", "paged", "kvlab.paged.kernels.triton_paged:paged_attention_triton",
                   package="triton", installed=installed, check=rules.triton_rules(env),
                   phase_check=rules.triton_phase_rules,
                   description="kvlab's Triton paged attention (decode and prefill with past context)"),
        KernelDecl("flash_attn_paged", "paged", "kvlab.paged.kernels.flash_attn:paged_attention_flash_attn",
                   package="flash_attn", installed=installed, check=rules.flash_attn_paged_rules,
                   phase_check=rules.flash_attn_paged_phase_rules,
                   description="flash_attn_with_kvcache / flash_attn_varlen_func with block_table"),
        KernelDecl("flashinfer_paged", "paged", "kvlab.paged.kernels.flashinfer:paged_attention_flashinfer",
                   package="flashinfer", installed=installed, check=rules.flashinfer_rules,
                   description="FlashInfer BatchPrefill/BatchDecodeWithPagedKVCacheWrapper"),
        KernelDecl("flex_paged", "paged", "kvlab.paged.kernels.flex:paged_attention_flex",
                   package="torch.nn.attention.flex_attention", installed=installed, check=rules.flex_rules,
                   description="torch FlexAttention with a paged BlockMask"),
    ]


REGISTRY: list[KernelDecl] = registry()
KERNEL_NAMES: tuple[str, ...] = tuple(d.name for d in REGISTRY)
