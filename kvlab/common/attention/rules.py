"""The kernels' rules: what each kernel supports, transcribed from the library it wraps. Each rule returns the
reasons a spec breaks it (empty: it can run), phrased like vLLM's.

Rules and their sources (each library's own API and documentation; docs/fallbacks.md lists what the study found):
- flash-attn 2 upstream: CUDA, compute capability >= 8.0, fp16/bf16, head_dim <= 256 (80 -> 96 and
  112 -> 128 kernels, i.e. padded), H % H_kv == 0; paged KV needs page_block_size % 256 == 0 and, for the
  varlen (prefill) entry point, head_dim % 8 == 0 (`flash_attn_with_kvcache`, used for decode and for the
  contiguous cache, pads any head_dim instead).
- FlashInfer: head dims 64/128/256, fp16/bf16, compute capability 8.0-12.1, any page size. Its CUDA-core
  decode kernel supports GQA group sizes {1, 2, 3, 4, 6, 8} only ("Unsupported group_size"), but kvlab's
  adapter (paged/kernels/flashinfer.py) decodes other groups on tensor cores, as vLLM does: no refusal.
- kvlab's Triton kernel (paged/kernels/triton_paged.py, the design of vLLM's unified attention):
  fp32/fp16/bf16, any head_dim (padded to a power of two >= 16 and masked), any block size (keys are walked in
  tiles of 32 tokens, each key's block looked up in the table, so every `tl.dot` dimension stays >= 16
  whatever the block size). Compiled on CUDA it needs Triton's compute capability 8.0+; on CPU it runs only
  in the interpreter (TRITON_INTERPRET=1), correct but hundreds of times slower than compiled (docs/fallbacks.md),
  so it ranks below torch there. Compiled, its tiles must fit one thread block's shared memory (estimated in
  common/attention/triton_tiles.py against the device's opt-in limit): fp32 head_dim 512 prefill does not fit
  an H200's 232,448 B.
- torch FlexAttention paged (paged/kernels/flex.py): CUDA only, where it is torch.compile'd into a Triton
  kernel (eager flex on CPU materialises scores over the whole block pool), fp16/bf16/fp32, any head_dim, any
  block size: kvlab's mask_mod maps every pool slot back to (sequence, position) under a 128-token BlockMask,
  so it does not need torch's experimental PagedAttention rule (BlockMask KV block == page size).
- torch SDPA (contiguous) and the torch gather reference (paged): any device, fp32/fp16/bf16, any head_dim.
Every kernel needs num_q_heads % num_kv_heads == 0.

fp8 KV cache (`kv_cache_dtype` fp8_e4m3 / fp8_e5m2, docs/kv-dtype-and-windows.md; values stored as uint8 bytes
with per-layer k_scale/v_scale, common/attention/kv_quant.py):
- torch SDPA (contiguous) and the torch gather reference: both formats, any device (dequantised in torch after the
  read).
- kvlab's Triton kernel: both formats, dequantised via fp32 inside the kernel (vLLM TRITON_ATTN does the same).
- flash-attn 2 upstream: no fp8 KV (KV dtype = q dtype); fp8 e4m3 KV is FA3-only, compute capability 9.x, which
  kvlab does not wrap.
- FlashInfer: the library takes fp8 e4m3/e5m2 KV (`run(..., k_scale=, v_scale=)`), but kvlab's adapter does not
  pass scales or fp8-typed caches yet: refused, not silently wrong.
- FlexAttention: KV dtype = q dtype (vLLM FLEX_ATTENTION: auto/fp16/bf16 only).

Sliding window (Mistral, `sliding_window` W): the torch kernels and kvlab's Triton kernel mask keys outside
(i - W, i] and do not read below the window. flash-attn (`window_size`), FlashInfer (`window_left`) and Flex
(mask_mod) support windows as libraries, but kvlab's adapters pass none yet: refused, never silently full attention.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvlab.common.attention import triton_tiles
from kvlab.common.attention.spec import AttentionSpec, base_device

ALL_DTYPES = ("float32", "float16", "bfloat16")
HALF_DTYPES = ("float16", "bfloat16")
ALL_KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
FLASHINFER_HEAD_DIMS = (64, 128, 256)
FLASHINFER_CC = ((8, 0), (12, 1))
FA_PAGE_MULTIPLE = 256
MIN_CC = (8, 0)
# opt-in shared memory per thread block by compute capability (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"), for specs that do not carry the device's own value
SHARED_MEMORY_BY_CC = {(8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912, (8, 9): 101_376, (9, 0): 232_448,
                       (10, 0): 232_448, (12, 0): 101_376}


def package_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


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


def needs_kv_dtype(spec: AttentionSpec, allowed: tuple[str, ...], why: str) -> list[str]:
    if spec.kv_cache_dtype in allowed:
        return []
    return [f"kv_cache_dtype {spec.kv_cache_dtype} not supported ({why})"]


def no_window(spec: AttentionSpec, lib: str) -> list[str]:
    if spec.sliding_window is None:
        return []
    return [f"sliding window not supported (kvlab's {lib} adapter passes no window; the library has one)"]


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
            + needs_kv_dtype(spec, ALL_KV_DTYPES, "torch") + needs_gqa_divisor(spec))


def flash_attn_rules(spec: AttentionSpec) -> list[str]:
    """flash-attn 2 (`mha_fwd_kvcache`): the rules shared by the contiguous and paged paths."""
    reasons = needs_device(spec, ("cuda",), "flash-attn") + needs_cc(spec, MIN_CC)
    reasons += needs_dtype(spec, HALF_DTYPES, "flash-attn")
    if spec.head_dim > 256:
        reasons.append(f"head_size {spec.head_dim} not supported (flash-attn: head_dim <= 256)")
    reasons += needs_kv_dtype(spec, ("auto",), "flash-attn 2: KV = q dtype; fp8 e4m3 KV is FA3 on 9.x only")
    reasons += no_window(spec, "flash-attn")
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
    reasons += needs_kv_dtype(spec, ("auto",), "kvlab's flashinfer adapter passes no k_scale/v_scale; "
                                               "the library takes fp8 e4m3/e5m2")
    reasons += no_window(spec, "flashinfer")
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
        return (reasons + needs_dtype(spec, ALL_DTYPES, "triton") + needs_kv_dtype(spec, ALL_KV_DTYPES, "triton")
                + needs_gqa_divisor(spec))
    return check


def triton_phase_rules(spec: AttentionSpec, phase: str) -> list[str]:
    """Compiled Triton: the phase's tiles must fit one thread block's shared memory."""
    limit = spec.shared_memory_per_block or SHARED_MEMORY_BY_CC.get(tuple(spec.compute_capability or ()))
    if base_device(spec.device) != "cuda" or limit is None or needs_gqa_divisor(spec) or spec.dtype not in ALL_DTYPES:
        return []
    need = triton_tiles.shared_memory_bytes(spec.head_dim, spec.gqa_ratio, phase == "decode", spec.dtype)
    if need <= limit:
        return []
    return [f"shared memory: {phase} tiles need {need:,} B > {limit:,} B per block (head_dim {spec.head_dim}, "
            f"{spec.dtype}; Triton fails such a launch)"]


def flex_rules(spec: AttentionSpec) -> list[str]:
    reasons = needs_device(spec, ("cuda",), "flex_attention") + needs_cc(spec, MIN_CC)
    reasons += needs_kv_dtype(spec, ("auto",), "flex_attention: KV = q dtype") + no_window(spec, "flex")
    return reasons + needs_dtype(spec, ALL_DTYPES, "flex_attention") + needs_gqa_divisor(spec)
