"""The attention-kernel registry: what each kernel supports, transcribed from the library it wraps, and the
per-device priority that `kernel="auto"` follows.

Rules and their sources (../shared/reference/gpu-apis.md):
- flash-attn 2 upstream (§3): CUDA, compute capability >= 8.0, fp16/bf16, head_dim <= 256 (80 -> 96 and
  112 -> 128 kernels, i.e. padded), H % H_kv == 0; paged KV needs page_block_size % 256 == 0 and, for the
  varlen (prefill) entry point, head_dim % 8 == 0 (`flash_attn_with_kvcache`, used for decode and for the
  contiguous cache, pads any head_dim instead).
- FlashInfer (§5): head dims 64/128/256, fp16/bf16, compute capability 8.0-12.1, any page size. Its CUDA-core
  decode kernel supports GQA group sizes {1, 2, 3, 4, 6, 8} only ("Unsupported group_size"), but kvlab's
  adapter (paged/kernels/flashinfer.py) decodes other groups on tensor cores, as vLLM does: no refusal.
- kvlab's Triton kernel (paged/kernels/triton_paged.py, the vLLM unified-attention design of §6):
  fp32/fp16/bf16, any head_dim (padded to a power of two >= 16 and masked), any block size (keys are walked in
  tiles of 32 tokens, each key's block looked up in the table, so every `tl.dot` dimension stays >= 16
  whatever the block size). Compiled on CUDA it needs Triton's compute capability 8.0+; on CPU it runs only
  in the interpreter (TRITON_INTERPRET=1), correct but about 5 ms per program and loop step (cpu-facts.md §3),
  so it ranks below torch there.
- torch FlexAttention paged (§7; paged/kernels/flex.py): CUDA only, where it is torch.compile'd into a Triton
  kernel (eager flex on CPU materialises scores over the whole block pool), fp16/bf16/fp32, any head_dim, any
  block size: kvlab's mask_mod maps every pool slot back to (sequence, position) under a 128-token BlockMask,
  so it does not need torch's experimental PagedAttention rule (BlockMask KV block == page size).
- torch SDPA (contiguous) and the torch gather reference (paged): any device, fp32/fp16/bf16, any head_dim.
Every kernel needs num_q_heads % num_kv_heads == 0.

Priority (first valid wins; every refusal is recorded with its reason, and a displaced higher-priority kernel
is logged as a warning):
- cuda, paged: flash_attn_paged, flashinfer_paged, triton_paged, flex_paged, torch_paged (vLLM's order for
  cc 8.x-9.x, then kvlab's gather reference).
- cuda, contiguous: flash_attn_contiguous, torch_sdpa_contiguous.
- cpu, paged: torch_paged, then triton_paged (interpreter only). cpu, contiguous: torch_sdpa_contiguous.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvlab.common.attention.dispatch import (
    PHASES,
    AttentionSpec,
    KernelDecl,
    KernelDispatcher,
    Refusal,
    build_dispatcher,
    package_available,
)
from kvlab.common.errors import KernelUnavailable

log = logging.getLogger("kvlab.kernels")

ALL_DTYPES = ("float32", "float16", "bfloat16")
HALF_DTYPES = ("float16", "bfloat16")
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_CC = ((8, 0), (12, 1))
FA_PAGE_MULTIPLE = 256
TRITON_MIN_HEAD_DIM = 16   # triton_paged pads head_dim to max(16, next power of two)
MIN_CC = (8, 0)

PRIORITY: dict[tuple[str, str], tuple[str, ...]] = {
    ("cuda", "paged"): ("flash_attn_paged", "flashinfer_paged", "triton_paged", "flex_paged", "torch_paged"),
    ("cuda", "contiguous"): ("flash_attn_contiguous", "torch_sdpa_contiguous"),
    ("cpu", "paged"): ("torch_paged", "triton_paged"),
    ("cpu", "contiguous"): ("torch_sdpa_contiguous",),
}


# -- the machine a decision is made for --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Environment:
    """What the host offers. None means "look at this process" (importlib, os.environ) when a rule runs;
    the fallback study sets both to show what another machine would get."""
    packages: frozenset[str] | None = None   # importable packages (only those kernels need are asked about)
    triton_interpret: bool | None = None     # TRITON_INTERPRET=1

    def installed(self, package: str) -> bool:
        return package_available(package) if self.packages is None else package in self.packages

    def interpreting_triton(self) -> bool:
        if self.triton_interpret is None:
            return os.environ.get("TRITON_INTERPRET", "0") == "1"
        return self.triton_interpret


HERE = Environment()


# -- rule helpers: each returns the reasons a spec breaks one rule (vLLM's phrasing) -------------------------
def base_device(device: str) -> str:
    return device.split(":")[0]


def cc_text(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def needs_device(spec: AttentionSpec, allowed: tuple[str, ...], lib: str) -> list[str]:
    device = base_device(spec.device)
    return [] if device in allowed else [f"device {device} not supported ({lib}: {', '.join(allowed)} only)"]


def needs_cc(spec: AttentionSpec, low: tuple[int, int], high: tuple[int, int] | None = None) -> list[str]:
    """Compute-capability range; an unknown capability (None) is not refused here."""
    cc = spec.compute_capability
    if base_device(spec.device) != "cuda" or cc is None:
        return []
    if tuple(cc) < low:
        return [f"compute capability {cc_text(cc)} < {cc_text(low)}"]
    if high is not None and tuple(cc) > high:
        return [f"compute capability {cc_text(cc)} > {cc_text(high)}"]
    return []


def needs_dtype(spec: AttentionSpec, allowed: tuple[str, ...], lib: str) -> list[str]:
    if spec.dtype in allowed:
        return []
    return [f"dtype {spec.dtype} not supported ({lib}: {', '.join(allowed)})"]


def needs_gqa_divisor(spec: AttentionSpec) -> list[str]:
    if spec.num_kv_heads > 0 and spec.num_q_heads % spec.num_kv_heads == 0:
        return []
    return [f"GQA: num_q_heads {spec.num_q_heads} not divisible by num_kv_heads {spec.num_kv_heads}"]


def needs_block_multiple(spec: AttentionSpec, multiple: int, why: str) -> list[str]:
    if spec.block_size is None or spec.block_size % multiple == 0:
        return []
    return [f"block_size {spec.block_size} not supported: {why}"]


# -- the kernels' rules --------------------------------------------------------------------------------------
def torch_rules(spec: AttentionSpec) -> list[str]:
    return (needs_device(spec, ("cpu", "cuda"), "torch") + needs_dtype(spec, ALL_DTYPES, "torch")
            + needs_gqa_divisor(spec))


def flash_attn_rules(spec: AttentionSpec) -> list[str]:
    """flash-attn 2 (`mha_fwd_kvcache`): the rules shared by the contiguous and paged paths."""
    reasons = needs_device(spec, ("cuda",), "flash-attn") + needs_cc(spec, MIN_CC)
    reasons += needs_dtype(spec, HALF_DTYPES, "flash-attn")
    if spec.head_dim > 256:
        reasons.append(f"head_size {spec.head_dim} not supported (flash-attn: head_dim <= 256)")
    return reasons + needs_gqa_divisor(spec)


def flash_attn_paged_rules(spec: AttentionSpec) -> list[str]:
    why = f"page size must be a multiple of {FA_PAGE_MULTIPLE} (upstream flash-attn paged KV; vLLM fork: 16)"
    return flash_attn_rules(spec) + needs_block_multiple(spec, FA_PAGE_MULTIPLE, why)


def flash_attn_paged_phase_rules(spec: AttentionSpec, phase: str) -> list[str]:
    # prefill goes through flash_attn_varlen_func(block_table=...), which has no padded head-dim path
    if phase == "prefill" and spec.head_dim % 8:
        rule = "flash-attn varlen paged: head_dim % 8 == 0"
        return [f"head_size {spec.head_dim} not supported in prefill ({rule})"]
    return []


def flashinfer_rules(spec: AttentionSpec) -> list[str]:
    reasons = needs_device(spec, ("cuda",), "flashinfer") + needs_cc(spec, *FLASHINFER_CC)
    reasons += needs_dtype(spec, HALF_DTYPES, "flashinfer")
    if spec.head_dim not in FLASHINFER_HEAD_DIMS:
        dims = ", ".join(map(str, FLASHINFER_HEAD_DIMS))
        reasons.append(f"head_size {spec.head_dim} not supported (flashinfer: head dims {dims})")
    return reasons + needs_gqa_divisor(spec)


def triton_rules(env: Environment) -> Callable[[AttentionSpec], list[str]]:
    def check(spec: AttentionSpec) -> list[str]:
        device = base_device(spec.device)
        reasons = needs_device(spec, ("cpu", "cuda"), "triton")
        if device == "cpu" and not env.interpreting_triton():
            reasons.append("device cpu needs TRITON_INTERPRET=1 "
                           "(Triton has no CPU backend; the interpreter is slow)")
        if device == "cuda":
            reasons += needs_cc(spec, MIN_CC)
            if env.interpreting_triton():
                reasons.append("device cuda with TRITON_INTERPRET=1 would run the interpreter, not a compiled "
                               "kernel (unset it on GPU machines)")
        return reasons + needs_dtype(spec, ALL_DTYPES, "triton") + needs_gqa_divisor(spec)
    return check


def flex_rules(spec: AttentionSpec) -> list[str]:
    reasons = needs_device(spec, ("cuda",), "flex_attention") + needs_cc(spec, MIN_CC)
    return reasons + needs_dtype(spec, ALL_DTYPES, "flex_attention") + needs_gqa_divisor(spec)


# -- the registry --------------------------------------------------------------------------------------------
def registry(env: Environment = HERE) -> list[KernelDecl]:
    """One declaration per kernel; `env` says which packages count as installed (None: this process)."""
    installed = env.installed
    return [
        KernelDecl("torch_sdpa_contiguous", "contiguous", "kvlab.common.attention.contiguous:contiguous_attention_sdpa",
                   description="torch SDPA over per-slot views of the contiguous cache", check=torch_rules),
        KernelDecl("flash_attn_contiguous", "contiguous",
                   "kvlab.common.attention.flash_attn_contiguous:contiguous_attention_flash_attn",
                   package="flash_attn", installed=installed, check=flash_attn_rules,
                   description="flash_attn_with_kvcache(cache_batch_idx=..., block_table=None)"),
        KernelDecl("torch_paged", "paged", "kvlab.paged.kernels.torch_ref:paged_attention_torch",
                   description="gather by block table into a buffer, then SDPA", check=torch_rules),
        KernelDecl("triton_paged", "paged", "kvlab.paged.kernels.triton_paged:paged_attention_triton",
                   package="triton", installed=installed, check=triton_rules(env),
                   description="kvlab's Triton paged attention (decode and prefill with past context)"),
        KernelDecl("flash_attn_paged", "paged", "kvlab.paged.kernels.flash_attn:paged_attention_flash_attn",
                   package="flash_attn", installed=installed, check=flash_attn_paged_rules,
                   phase_check=flash_attn_paged_phase_rules,
                   description="flash_attn_with_kvcache / flash_attn_varlen_func with block_table"),
        KernelDecl("flashinfer_paged", "paged", "kvlab.paged.kernels.flashinfer:paged_attention_flashinfer",
                   package="flashinfer", installed=installed, check=flashinfer_rules,
                   description="FlashInfer BatchPrefill/BatchDecodeWithPagedKVCacheWrapper"),
        KernelDecl("flex_paged", "paged", "kvlab.paged.kernels.flex:paged_attention_flex",
                   package="torch.nn.attention.flex_attention", installed=installed, check=flex_rules,
                   description="torch FlexAttention with a paged BlockMask"),
    ]


REGISTRY: list[KernelDecl] = registry()
KERNEL_NAMES: tuple[str, ...] = tuple(d.name for d in REGISTRY)


def packages_here() -> frozenset[str]:
    """The kernel packages importable in this process."""
    return frozenset(d.package for d in REGISTRY if d.package and package_available(d.package))


def simulated(*extra_packages: str, triton_interpret: bool | None = None) -> Environment:
    """This machine's packages plus `extra_packages` (e.g. "flash_attn", "flashinfer")."""
    return Environment(packages_here() | frozenset(extra_packages), triton_interpret)


def priority(device: str, layout: str) -> list[str]:
    try:
        return list(PRIORITY[(base_device(device), layout)])
    except KeyError:
        raise KernelUnavailable(f"no attention kernels for device {device!r} and layout {layout!r}; "
                                "use device cpu or cuda") from None


# -- selection -----------------------------------------------------------------------------------------------
def resolve(spec: AttentionSpec) -> AttentionSpec:
    """Normalise "cuda:N" to "cuda" and fill in the compute capability of a present GPU."""
    device = base_device(spec.device)
    cc = spec.compute_capability
    if device == "cuda" and cc is None and torch.cuda.is_available():
        index = int(spec.device.split(":")[1]) if ":" in spec.device else torch.cuda.current_device()
        cc = tuple(torch.cuda.get_device_capability(index))
    return dataclasses.replace(spec, device=device, compute_capability=cc)


def _dispatcher(spec: AttentionSpec, choice: str, env: Environment | None) -> KernelDispatcher:
    spec = resolve(spec)
    decls = REGISTRY if env is None else registry(env)
    return build_dispatcher(spec, decls, priority(spec.device, spec.layout), choice)


def make_dispatcher(spec: AttentionSpec, choice: str = "auto",
                    env: Environment | None = None) -> KernelDispatcher:
    """The backend's dispatcher. A higher-priority kernel displaced by a rule is a fallback: logged as a
    warning with every reason (once, here) and listed in `report()["displaced"]`."""
    dispatcher = _dispatcher(spec, choice, env)
    reasons = {(r.kernel, r.phase): r.reasons for r in dispatcher.refusals}
    for phase, names in dispatcher.displaced.items():
        if names:
            why = "; ".join(f"{n}: {', '.join(reasons[(n, phase)])}" for n in names)
            log.warning("%s %s attention uses %s instead of %s (%s)", spec.layout, phase,
                        dispatcher.chosen(phase), names[0], why)
    return dispatcher


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
    d = _dispatcher(spec, choice, env)
    by_key = {(r.kernel, r.phase): r for r in d.refusals}
    phases = {phase: PhaseDecision(d.chosen(phase), [by_key[(n, phase)] for n in d.displaced.get(phase, [])],
                                   [k.name for k in d.candidates[phase]])
              for phase in PHASES}
    return Decision(d.spec, choice, phases, d.refusals)


# -- silent costs of a kernel that does run -----------------------------------------------------------------
FA_HEAD_DIMS = (32, 64, 96, 128, 192, 256)   # flash-attn's compiled head dims (static_switch.h)


def kernel_head_dim(kernel: str, head_dim: int) -> int:
    """The head dim a kernel computes with: flash-attn rounds up to its next compiled size, Triton and
    FlexAttention to a power of two (>= 16 for Triton's tl.dot); the others compute exactly `head_dim`."""
    if kernel.startswith("flash_attn"):
        return next((d for d in FA_HEAD_DIMS if d >= head_dim), head_dim)
    if kernel in ("triton_paged", "flex_paged"):
        floor = TRITON_MIN_HEAD_DIM if kernel == "triton_paged" else 1
        return max(floor, 1 << (head_dim - 1).bit_length())
    return head_dim


# -- reading reasons -----------------------------------------------------------------------------------------
CAUSES = ("package", "device", "compute_capability", "dtype", "head_dim", "block_size", "gqa", "layout")
_CAUSE_PREFIXES = (
    ("ImportError", "package"), ("device", "device"), ("compute capability", "compute_capability"),
    ("dtype", "dtype"), ("head_size", "head_dim"), ("block_size", "block_size"), ("GQA", "gqa"),
    ("layout", "layout"),
)


def reason_cause(reason: str) -> str:
    """The rule family a refusal reason belongs to (one of CAUSES, or "other")."""
    for prefix, cause in _CAUSE_PREFIXES:
        if reason.startswith(prefix):
            return cause
    return "other"
