"""The kernel registry against the libraries' rules; the auto order, explicit choices, run-time fallback."""
from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

import pytest
import torch

from kvlab.common.attention import declarations, triton_tiles
from kvlab.common.attention import priority as priority_module
from kvlab.common.attention.bounds import MetadataError, check_metadata
from kvlab.common.attention.declarations import REGISTRY, KernelDecl, registry
from kvlab.common.attention.dispatch import AttentionSpec, build_dispatcher, make_dispatcher, resolve
from kvlab.common.attention.priority import PRIORITY, priority
from kvlab.common.attention.rules import Environment
from kvlab.common.errors import KernelUnavailable
from kvlab.experiments.studies.fallbacks.decisions import CAUSES, decide, kernel_head_dim, reason_cause, simulated

ALL_PACKAGES = frozenset({"flash_attn", "flashinfer", "triton", "torch.nn.attention.flex_attention"})
EVERYTHING = Environment(ALL_PACKAGES, triton_interpret=False)   # rules only: every package, a GPU's Triton
INTERPRETED = Environment(ALL_PACKAGES, triton_interpret=True)   # the same on a CPU machine running the interpreter
H200 = (9, 0)


def spec(layout="paged", device="cuda", dtype="bfloat16", head_dim=128, q_heads=8, kv_heads=2, block=256,
         cc=H200) -> AttentionSpec:
    return AttentionSpec(layout, device, dtype, head_dim, q_heads, kv_heads,
                         block if layout == "paged" else None, cc if device.startswith("cuda") else None)


def reasons(kernel: str, s: AttentionSpec, phase: str = "decode", env: Environment | None = None) -> list[str]:
    env = env or (INTERPRETED if s.device == "cpu" else EVERYTHING)
    decl = next(d for d in registry(env) if d.name == kernel)
    return decl.reasons_against(s, phase)


# (kernel, spec overrides, phase, expected: None = accepted, else a substring of one reason)
RULES = [
    # upstream flash-attn 2, paged (docs/gpu-contracts.md §2)
    ("flash_attn_paged", {}, "decode", None),
    ("flash_attn_paged", {"block": 512}, "decode", None),
    ("flash_attn_paged", {"block": 16}, "decode",
     "block_size 16 not supported: page size must be a multiple of 256"),
    ("flash_attn_paged", {"block": 128}, "prefill", "block_size 128 not supported"),
    ("flash_attn_paged", {"head_dim": 80}, "decode", None),                   # padded to the d=96 kernel
    ("flash_attn_paged", {"head_dim": 80}, "prefill", None),                  # 80 % 8 == 0: varlen takes it
    ("flash_attn_paged", {"head_dim": 100}, "decode", None),                  # with_kvcache pads
    ("flash_attn_paged", {"head_dim": 100}, "prefill", "head_size 100 not supported in prefill"),
    ("flash_attn_paged", {"head_dim": 264}, "decode",
     "head_size 264 not supported (flash-attn: head_dim <= 256)"),
    ("flash_attn_paged", {"dtype": "float32"}, "decode", "dtype float32 not supported"),
    ("flash_attn_paged", {"dtype": "float16"}, "decode", None),
    ("flash_attn_paged", {"cc": (7, 5)}, "decode", "compute capability 7.5 < 8.0"),
    ("flash_attn_paged", {"device": "cpu"}, "decode", "device cpu not supported"),
    ("flash_attn_paged", {"q_heads": 10, "kv_heads": 4}, "decode", "not divisible by num_kv_heads 4"),
    ("flash_attn_paged", {"q_heads": 14, "kv_heads": 2}, "decode", None),      # any GQA ratio (7)
    ("flash_attn_paged", {"layout": "contiguous"}, "decode", "layout contiguous (kernel needs paged)"),
    # flash-attn 2, contiguous with_kvcache (vAttention's path)
    ("flash_attn_contiguous", {"layout": "contiguous", "head_dim": 80}, "prefill", None),
    ("flash_attn_contiguous", {"layout": "contiguous", "head_dim": 100}, "prefill", None),
    ("flash_attn_contiguous", {"layout": "contiguous", "dtype": "float32"}, "decode", "dtype float32"),
    ("flash_attn_contiguous", {"layout": "contiguous", "device": "cpu"}, "decode", "device cpu"),
    # FlashInfer (§5)
    ("flashinfer_paged", {"block": 16}, "decode", None),
    ("flashinfer_paged", {"block": 1}, "prefill", None),                      # any page size
    ("flashinfer_paged", {"head_dim": 64}, "decode", None),
    ("flashinfer_paged", {"head_dim": 256}, "decode", None),
    ("flashinfer_paged", {"head_dim": 80}, "decode",
     "head_size 80 not supported (flashinfer: head dims 64, 128, 256)"),
    ("flashinfer_paged", {"head_dim": 96}, "prefill", "head_size 96 not supported"),
    ("flashinfer_paged", {"dtype": "float32"}, "decode", "dtype float32 not supported"),
    # the CUDA-core decode kernel has groups {1, 2, 3, 4, 6, 8} only, but kvlab's adapter decodes groups
    # 5 and 7 on tensor cores (use_tensor_cores=True), as vLLM does: not a refusal
    ("flashinfer_paged", {"q_heads": 10, "kv_heads": 2}, "decode", None),
    ("flashinfer_paged", {"q_heads": 14, "kv_heads": 2}, "decode", None),
    ("flashinfer_paged", {"q_heads": 6, "kv_heads": 2}, "decode", None),       # group 3 (SmolLM2)
    ("flashinfer_paged", {"q_heads": 10, "kv_heads": 4}, "prefill", "not divisible by num_kv_heads 4"),
    ("flashinfer_paged", {"cc": (12, 2)}, "decode", "compute capability 12.2 > 12.1"),
    ("flashinfer_paged", {"cc": (7, 5)}, "decode", "compute capability 7.5 < 8.0"),
    ("flashinfer_paged", {"cc": (12, 0)}, "decode", None),
    # kvlab's Triton kernel
    ("triton_paged", {"dtype": "float32", "block": 1, "head_dim": 72}, "decode", None),
    ("triton_paged", {"block": 8, "head_dim": 100}, "prefill", None),
    ("triton_paged", {"q_heads": 10, "kv_heads": 2}, "decode", None),
    ("triton_paged", {"cc": (7, 5)}, "decode", "compute capability 7.5 < 8.0"),
    ("triton_paged", {"device": "cpu", "dtype": "float32"}, "decode", None),   # on cpu: INTERPRETED
    # torch FlexAttention paged
    ("flex_paged", {"block": 128, "dtype": "float32", "head_dim": 100}, "decode", None),
    ("flex_paged", {"block": 256}, "prefill", None),
    ("flex_paged", {"block": 16}, "decode", None),     # kvlab's mask_mod maps slots: any block size
    ("flex_paged", {"block": 1, "cc": (7, 5)}, "decode", "compute capability 7.5 < 8.0"),
    ("flex_paged", {"device": "cpu", "block": 128}, "decode", "device cpu not supported"),
    # torch kernels take everything
    ("torch_paged", {"device": "cpu", "dtype": "float32", "block": 1, "head_dim": 100}, "prefill", None),
    ("torch_paged", {"dtype": "float16", "block": 7, "head_dim": 20, "cc": (7, 0)}, "decode", None),
    ("torch_sdpa_contiguous", {"layout": "contiguous", "device": "cpu", "dtype": "float32", "head_dim": 72},
     "decode", None),
    ("torch_sdpa_contiguous", {"layout": "contiguous", "q_heads": 10, "kv_heads": 4}, "decode",
     "GQA: num_q_heads 10 not divisible by num_kv_heads 4"),
]


def rule_id(kernel: str, overrides: dict, phase: str) -> str:
    return "-".join([kernel, *(f"{a}={b}" for a, b in overrides.items()), phase])


@pytest.mark.parametrize("kernel,overrides,phase,expected", RULES, ids=[rule_id(*r[:3]) for r in RULES])
def test_rule(kernel, overrides, phase, expected):
    got = reasons(kernel, spec(**overrides), phase)
    if expected is None:
        assert got == []
    else:
        assert any(expected in r for r in got), got


def test_every_reason_belongs_to_a_known_cause():
    assert reason_cause("ImportError: package 'x' is not installed") == "package"
    seen = set()
    for kernel, overrides, phase, _ in RULES:
        for r in reasons(kernel, spec(**overrides), phase):
            seen.add(reason_cause(r))
    assert "other" not in seen and seen <= set(CAUSES)
    assert {"dtype", "head_dim", "block_size", "compute_capability", "device", "gqa", "layout"} <= seen


def test_missing_package_is_a_reason():
    bare = Environment(packages=frozenset(), triton_interpret=True)
    assert reasons("flash_attn_paged", spec(), env=bare) == [
        "ImportError: package 'flash_attn' is not installed"]
    assert "ImportError: package 'flashinfer' is not installed" in reasons("flashinfer_paged", spec(),
                                                                           env=bare)
    assert reasons("torch_paged", spec(), env=bare) == []


def test_triton_on_cpu_needs_the_interpreter():
    off = Environment(ALL_PACKAGES, triton_interpret=False)
    s = spec(device="cpu", dtype="float32")
    assert reasons("triton_paged", s, env=off) == [
        "device cpu needs TRITON_INTERPRET=1 (Triton has no CPU backend; the interpreter is slow)"]
    assert reasons("triton_paged", s, env=INTERPRETED) == []


def test_triton_on_cuda_refuses_the_interpreter():
    assert reasons("triton_paged", spec(), env=INTERPRETED) == [
        "device cuda with TRITON_INTERPRET=1 would run the interpreter, not a compiled kernel "
        "(unset it on GPU machines)"]
    assert reasons("triton_paged", spec(), env=EVERYTHING) == []


def test_live_environment_reads_this_process(monkeypatch):
    here = Environment()
    assert here.installed("torch") and not here.installed("surely_not_a_kvlab_package")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not here.interpreting_triton()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert here.interpreting_triton()
    assert simulated("flash_attn").installed("flash_attn")


@pytest.mark.parametrize("decl", REGISTRY, ids=[d.name for d in REGISTRY])
def test_every_implementation_path_resolves(decl):
    """The adapters import their library lazily, so their modules load even without flash-attn/FlashInfer."""
    assert callable(decl.load())


# -- the auto order ------------------------------------------------------------------------------------------
def test_priority_per_device():
    assert priority("cuda", "paged") == ["flash_attn_paged", "flashinfer_paged", "triton_paged", "flex_paged",
                                         "torch_paged"]
    assert priority("cuda:1", "contiguous") == ["flash_attn_contiguous", "torch_sdpa_contiguous"]
    assert priority("cpu", "paged") == ["torch_paged", "triton_paged"]
    assert priority("cpu", "contiguous") == ["torch_sdpa_contiguous"]
    names = {d.name for d in REGISTRY}
    assert all(set(order) <= names for order in PRIORITY.values())
    with pytest.raises(KernelUnavailable, match="no attention kernels for device 'mps'"):
        priority("mps", "paged")


@pytest.mark.parametrize("overrides,env,kernel,displaced", [
    ({}, EVERYTHING, "flash_attn_paged", []),
    ({"block": 16}, EVERYTHING, "flashinfer_paged", ["flash_attn_paged"]),
    ({"block": 16, "head_dim": 80}, EVERYTHING, "triton_paged", ["flash_attn_paged", "flashinfer_paged"]),
    ({"dtype": "float32"}, EVERYTHING, "triton_paged", ["flash_attn_paged", "flashinfer_paged"]),
    ({"cc": (7, 5)}, EVERYTHING, "torch_paged",
     ["flash_attn_paged", "flashinfer_paged", "triton_paged", "flex_paged"]),
    ({}, Environment(frozenset({"triton"}), False), "triton_paged", ["flash_attn_paged", "flashinfer_paged"]),
    ({"device": "cpu"}, EVERYTHING, "torch_paged", []),
    ({"device": "cpu", "dtype": "float32", "block": 1}, Environment(frozenset(), False), "torch_paged", []),
    ({"layout": "contiguous"}, EVERYTHING, "flash_attn_contiguous", []),
    ({"layout": "contiguous", "dtype": "float32"}, EVERYTHING, "torch_sdpa_contiguous",
     ["flash_attn_contiguous"]),
    ({"layout": "contiguous", "device": "cpu"}, EVERYTHING, "torch_sdpa_contiguous", []),
])
def test_auto_takes_the_first_valid_kernel(overrides, env, kernel, displaced):
    d = decide(spec(**overrides), env=env)
    assert d.phases["decode"].kernel == kernel
    assert [r.kernel for r in d.phases["decode"].displaced] == displaced
    assert all(r.reasons for r in d.phases["decode"].displaced)


def test_auto_candidates_keep_priority_order_for_runtime_fallback():
    d = decide(spec(), env=EVERYTHING)
    assert d.phases["prefill"].candidates == priority("cuda", "paged")
    cpu = decide(spec(device="cpu", dtype="float32"), env=INTERPRETED)
    assert cpu.phases["decode"].candidates == ["torch_paged", "triton_paged"]
    off = decide(spec(device="cpu", dtype="float32"), env=Environment(ALL_PACKAGES, False))
    assert off.phases["decode"].candidates == ["torch_paged"]
    assert [(r.kernel, r.phase) for r in off.refusals] == [("triton_paged", "prefill"),
                                                           ("triton_paged", "decode")]


def test_phases_can_differ():
    d = decide(spec(head_dim=100), env=EVERYTHING)
    assert d.phases["decode"].kernel == "flash_attn_paged"
    assert d.phases["prefill"].kernel == "triton_paged"


def test_device_index_and_capability_resolved():
    d = decide(spec(device="cuda:1"), env=EVERYTHING)
    assert d.spec.device == "cuda" and d.spec.compute_capability == H200


def test_decide_imports_no_kernel_implementation():
    code = ("import sys\n"
            "from kvlab.common.attention.dispatch import AttentionSpec\n"
            "from kvlab.experiments.studies.fallbacks.decisions import decide, simulated\n"
            "s = AttentionSpec('paged', 'cuda', 'bfloat16', 128, 8, 2, 16, (9, 0))\n"
            "print(decide(s, env=simulated('flash_attn', 'flashinfer')).phases['decode'].kernel)\n"
            "print(decide(AttentionSpec('contiguous', 'cpu', 'float32', 64, 4, 2)).phases['decode'].kernel)\n"
            "impls = ('kvlab.paged.kernels.', 'kvlab.vmm.', 'flash_attn', 'flashinfer')\n"
            "print([m for m in sys.modules if m.startswith(impls) and not m.endswith('.spec')])")   # specs declare
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out = done.stdout.split("\n")
    assert out[:3] == ["flashinfer_paged", "torch_sdpa_contiguous", "[]"]


# -- explicit choices ----------------------------------------------------------------------------------------
def test_explicit_kernel_that_cannot_run_lists_the_reasons():
    with pytest.raises(KernelUnavailable) as e:
        make_dispatcher(spec(dtype="float32", block=16), "flash_attn_paged", env=EVERYTHING)
    msg = str(e.value)
    assert "'flash_attn_paged' cannot run" in msg and "dtype float32 not supported" in msg
    assert "block_size 16 not supported" in msg and "\n" not in msg


def test_explicit_kernel_missing_package():
    with pytest.raises(KernelUnavailable, match="ImportError: package 'flashinfer' is not installed"):
        make_dispatcher(spec(), "flashinfer_paged", env=Environment(frozenset()))


def test_explicit_phase_rule_error_names_the_phase():
    with pytest.raises(KernelUnavailable, match="cannot run prefill .*head_size 100 not supported in"):
        make_dispatcher(spec(head_dim=100), "flash_attn_paged", env=EVERYTHING)


def test_unknown_kernel():
    with pytest.raises(KernelUnavailable, match="unknown kernel 'flash3'; known kernels: .*torch_paged"):
        make_dispatcher(spec(), "flash3")


def test_explicit_kernel_displaces_nothing_and_keeps_fallbacks():
    d = make_dispatcher(spec(), "torch_paged", env=EVERYTHING)
    assert d.chosen("decode") == "torch_paged" and d.displaced == {"prefill": [], "decode": []}
    assert [k.name for k in d.candidates["decode"]][1:] == ["flash_attn_paged", "flashinfer_paged",
                                                             "triton_paged", "flex_paged"]
    cpu = make_dispatcher(spec(device="cpu", dtype="float32"), "triton_paged", env=INTERPRETED)
    assert cpu.chosen("prefill") == "triton_paged"


def test_displacement_is_warned_once_with_reasons(caplog):
    with caplog.at_level(logging.WARNING, logger="kvlab.kernels"):
        d = make_dispatcher(spec(block=16, head_dim=80), env=EVERYTHING)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2   # one per phase
    assert all("uses triton_paged instead of flash_attn_paged" in w and "head_size 80 not supported" in w
               for w in warnings)
    assert d.report()["displaced"] == {"prefill": ["flash_attn_paged", "flashinfer_paged"],
                                       "decode": ["flash_attn_paged", "flashinfer_paged"]}


# -- run-time fallback and the report ------------------------------------------------------------------------
def raising_kernel(q, k_cache, v_cache, meta, scale):
    raise RuntimeError("Paged KV cache block size must be divisible by 256\nsecond line")


def paged_case():
    from kvlab.experiments.studies.fallbacks.timing import Shape, build_case
    s = AttentionSpec("paged", "cpu", "float32", 32, 4, 2, 4)
    return s, build_case(s, Shape(batch=3, context=10, query=1))


def test_runtime_failure_falls_back_logged_once_and_counted(caplog):
    s, case = paged_case()
    broken = KernelDecl("broken_paged", "paged", f"{__name__}:raising_kernel")
    torch_paged = next(d for d in REGISTRY if d.name == "torch_paged")
    d = build_dispatcher(s, [broken, torch_paged], ["broken_paged", "torch_paged"])
    assert d.chosen("decode") == "broken_paged"
    with caplog.at_level(logging.WARNING, logger="kvlab.kernels"):
        for _ in range(3):
            out = d.run("decode", case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out, case.expected, atol=1e-5, rtol=1e-5)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "broken_paged failed in decode" in warnings[0]
    report = d.report()
    assert report["runtime_fallbacks"] == [{
        "phase": "decode", "kernel": "broken_paged", "fallback": "torch_paged",
        "reason": "RuntimeError: Paged KV cache block size must be divisible by 256"}]
    assert report["calls"] == {"torch_paged": 3}
    assert report["kernels"] == {"prefill": "broken_paged", "decode": "torch_paged"}


def test_an_implementation_that_cannot_be_imported_falls_back():
    s, case = paged_case()
    missing = KernelDecl("missing_paged", "paged", "kvlab.paged.kernels.no_such_module:attention")
    torch_paged = next(d for d in REGISTRY if d.name == "torch_paged")
    d = build_dispatcher(s, [missing, torch_paged], ["missing_paged", "torch_paged"])
    out = d.run("decode", case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(out, case.expected, atol=1e-5, rtol=1e-5)
    [fallback] = d.report()["runtime_fallbacks"]
    assert fallback["kernel"] == "missing_paged" and fallback["reason"].startswith("ModuleNotFoundError")


def test_runtime_failure_with_nothing_left_is_a_clear_error():
    s, case = paged_case()
    broken = KernelDecl("broken_paged", "paged", f"{__name__}:raising_kernel")
    d = build_dispatcher(s, [broken], ["broken_paged"])
    with pytest.raises(KernelUnavailable, match="broken_paged failed in decode .*no other kernel"):
        d.run("decode", case.q, case.k_cache, case.v_cache, case.meta, case.scale)


def test_report_carries_the_decisions_and_is_json():
    d = make_dispatcher(spec(dtype="float32"), env=EVERYTHING)
    report = json.loads(json.dumps(d.report()))
    assert report["kernels"] == {"prefill": "triton_paged", "decode": "triton_paged"}
    refused = {(r["kernel"], r["phase"]): r["reasons"] for r in report["refused"]}
    assert any("dtype float32" in x for x in refused[("flash_attn_paged", "decode")])
    assert report["displaced"]["decode"] == ["flash_attn_paged", "flashinfer_paged"]
    assert report["runtime_fallbacks"] == [] and report["calls"] == {}


def test_backend_kernel_report_names_kernel_per_phase():
    """The paged backend builds its dispatcher from this registry; its kernel_report is what metrics carry."""
    from kvlab.common.config import make_config
    from kvlab.common.kv.types import KVShape
    from kvlab.paged import backend
    cache = backend.build_paged(make_config(block_size=16, kv_cache_bytes=1 << 20),
                                KVShape(num_layers=1, num_kv_heads=2, head_dim=32, num_q_heads=4))
    report = cache.kernel_report()
    assert report["kernels"] == {"prefill": "torch_paged", "decode": "torch_paged"}
    assert report["displaced"] == {"prefill": [], "decode": []}
    cache.close()


@pytest.mark.parametrize("kernel,head_dim,expected", [
    ("flash_attn_paged", 80, 96), ("flash_attn_paged", 112, 128), ("flash_attn_contiguous", 100, 128),
    ("flash_attn_paged", 128, 128), ("triton_paged", 80, 128), ("triton_paged", 8, 16),
    ("triton_paged", 64, 64),
    ("flex_paged", 72, 128), ("flashinfer_paged", 128, 128), ("torch_paged", 100, 100),
])
def test_kernel_head_dim_padding(kernel, head_dim, expected):
    assert kernel_head_dim(kernel, head_dim) == expected


# -- metrics of a real run carry the decisions ---------------------------------------------------------------
def generate_metrics(backend: str, **overrides):
    from kvlab.common import llm as llm_module
    from kvlab.common.sampling_params import SamplingParams
    llm = llm_module.LLM(model="tiny", backend=backend, **overrides)
    try:
        llm.generate([[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(max_tokens=3))
        return llm.metrics()
    finally:
        llm.close()


@pytest.mark.parametrize("backend,kernel", [("paged", "torch_paged"), ("vmm", "torch_sdpa_contiguous")])
def test_run_metrics_name_the_kernel_per_phase(backend, kernel):
    m = generate_metrics(backend)
    assert m.kernels == {"prefill": kernel, "decode": kernel}
    assert m.kernel_fallbacks == []
    json.dumps(m.to_dict())


def test_run_metrics_count_a_runtime_fallback(monkeypatch, caplog):
    broken = KernelDecl("broken_paged", "paged", f"{__name__}:raising_kernel")
    monkeypatch.setattr(declarations, "REGISTRY", [*declarations.REGISTRY, broken])
    monkeypatch.setitem(priority_module.PRIORITY, ("cpu", "paged"), ("broken_paged", "torch_paged"))
    with caplog.at_level(logging.WARNING, logger="kvlab.kernels"):
        m = generate_metrics("paged")
    assert m.kernels == {"prefill": "torch_paged", "decode": "torch_paged"}
    assert [(f["phase"], f["kernel"], f["fallback"]) for f in m.kernel_fallbacks] == [
        ("prefill", "broken_paged", "torch_paged"), ("decode", "broken_paged", "torch_paged")]
    warned = [r for r in caplog.records if "broken_paged failed" in r.getMessage()]
    assert len(warned) == 2   # once per phase, not once per layer or step


# -- shared memory: compiled Triton tiles must fit one thread block -----------------------------------------
def test_triton_tile_estimate_matches_the_measured_launch():
    """Compiled on an H200, fp32 head_dim 512 prefill (GQA 4) asked Triton for 270,848 B of shared memory."""
    assert triton_tiles.shared_memory_bytes(512, 4, decode=False, dtype="float32") == 270_848
    assert triton_tiles.shared_memory_bytes(512, 4, decode=True, dtype="float32") < 232_448


@pytest.mark.parametrize("overrides,phase,expected", [
    ({"dtype": "float32", "head_dim": 512}, "prefill",
     "shared memory: prefill tiles need 270,848 B > 232,448 B per block (head_dim 512, float32"),
    ({"dtype": "float32", "head_dim": 512}, "decode", None),           # one query token: 16 rows fit
    ({"dtype": "bfloat16", "head_dim": 512}, "prefill", None),
    ({"dtype": "float32", "head_dim": 256}, "prefill", None),
    ({"dtype": "float32", "head_dim": 256, "cc": (8, 6)}, "prefill", "> 101,376 B per block"),
    ({"dtype": "float32", "head_dim": 512, "cc": (7, 2)}, "prefill", "compute capability 7.2"),  # no table entry
])
def test_triton_refuses_tiles_that_exceed_shared_memory(overrides, phase, expected):
    got = reasons("triton_paged", spec(**overrides), phase)
    if expected is None:
        assert got == []
    else:
        assert any(expected in r for r in got) and len(got) == 1, got
        assert reason_cause(got[0]) in CAUSES


def test_shared_memory_limit_of_the_spec_wins_over_the_table():
    small = dataclasses.replace(spec(dtype="bfloat16", head_dim=512), shared_memory_per_block=100_000)
    assert any("> 100,000 B per block" in r for r in reasons("triton_paged", small, "prefill"))
    cpu = spec(device="cpu", dtype="float32", head_dim=512)      # the interpreter has no shared memory limit
    assert reasons("triton_paged", cpu, "prefill") == []


def test_h200_fp32_head_dim_512_prefill_is_refused_before_launch(caplog):
    """A simulated H200 with Triton and FlexAttention: prefill moves to flex_paged by rule (recorded and
    warned), decode keeps triton_paged; nothing is left to fail at launch."""
    env = Environment(frozenset({"triton", "torch.nn.attention.flex_attention"}), triton_interpret=False)
    with caplog.at_level(logging.WARNING, logger="kvlab.kernels"):
        d = make_dispatcher(spec(dtype="float32", head_dim=512), env=env)
    assert d.report()["kernels"] == {"prefill": "flex_paged", "decode": "triton_paged"}
    refused = {(r["kernel"], r["phase"]): r["reasons"] for r in d.report()["refused"]}
    assert refused[("triton_paged", "prefill")][0].startswith("shared memory: prefill tiles need 270,848 B")
    assert ("triton_paged", "decode") not in refused
    assert any("prefill attention uses flex_paged" in r.getMessage() and "shared memory" in r.getMessage()
               for r in caplog.records)


def test_resolve_reads_the_present_gpus_shared_memory(monkeypatch):
    """Simulated GPU: resolve fills the limit only for the GPU that is present (same compute capability)."""
    props = type("Props", (), {"shared_memory_per_block_optin": 101_376})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    here = resolve(spec(cc=None))
    assert here.compute_capability == (8, 9) and here.shared_memory_per_block == 101_376
    other = resolve(spec(cc=H200))
    assert other.compute_capability == H200 and other.shared_memory_per_block is None


# -- metadata bounds before a fallback -----------------------------------------------------------------------
class Recorder:
    """A kernel that must not run: it stands in for a fallback without bounds checks (the Triton kernel)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, q, k_cache, v_cache, meta, scale):
        self.calls += 1
        return torch.zeros_like(q)


def dispatcher_over(s: AttentionSpec, first: KernelDecl, recorder: Recorder):
    fallback = KernelDecl("unchecked", s.layout, recorder)
    return build_dispatcher(s, [first, fallback], [first.name, "unchecked"])


def test_bad_block_table_is_a_metadata_error_not_a_fallback():
    """torch_paged raises on a block id past the pool; the next kernel would read past it: no fallback."""
    s, case = paged_case()
    case.meta.block_tables[1, 0] = case.k_cache.shape[0] + 5
    recorder = Recorder()
    torch_paged = next(d for d in REGISTRY if d.name == "torch_paged")
    d = dispatcher_over(s, torch_paged, recorder)
    with pytest.raises(MetadataError, match="item 1's block table .* leaves the pool of"):
        d.run("decode", case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert recorder.calls == 0 and d.report()["runtime_fallbacks"] == []


def test_bad_slot_mapping_stops_the_fallback():
    s, case = paged_case()
    case.meta.slot_mapping[0] = -1
    recorder = Recorder()
    d = dispatcher_over(s, KernelDecl("broken_paged", "paged", f"{__name__}:raising_kernel"), recorder)
    with pytest.raises(MetadataError, match="token 0's slot -1 is outside the pool"):
        d.run("decode", case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert recorder.calls == 0 and d.runtime_fallbacks == []


def contiguous_case():
    from kvlab.experiments.studies.fallbacks.timing import Shape, build_case
    s = AttentionSpec("contiguous", "cpu", "float32", 32, 4, 2)
    return s, build_case(s, Shape(batch=3, context=10, query=1))


@pytest.mark.parametrize("corrupt,match", [
    (lambda meta, k: meta.slots.__setitem__(2, k.shape[0]), "item 2's slot .* outside the cache's"),
    (lambda meta, k: setattr(meta, "readable_lens", torch.full_like(meta.slots, k.shape[1] + 1)),
     "readable length .* in rows of"),
    (lambda meta, k: setattr(meta, "readable_lens", meta.context_lens.long() - 1), "item 0 has context 10"),
])
def test_bad_contiguous_metadata_stops_the_fallback(corrupt, match):
    s, case = contiguous_case()
    corrupt(case.meta, case.k_cache)
    recorder = Recorder()
    d = dispatcher_over(s, KernelDecl("broken", "contiguous", f"{__name__}:raising_kernel"), recorder)
    with pytest.raises(MetadataError, match=match):
        d.run("decode", case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert recorder.calls == 0 and d.runtime_fallbacks == []


def test_sound_metadata_still_falls_back():
    for s, case in (paged_case(), contiguous_case()):
        check_metadata(case.meta, case.q, case.k_cache)     # the cases themselves are sound
        recorder = Recorder()
        d = dispatcher_over(s, KernelDecl("broken", s.layout, f"{__name__}:raising_kernel"), recorder)
        d.run("decode", case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        assert recorder.calls == 1 and [f["fallback"] for f in d.runtime_fallbacks] == ["unchecked"]


def test_query_tokens_must_match_the_metadata():
    s, case = paged_case()
    with pytest.raises(MetadataError, match="does not cover the 2 query tokens of 3 items"):
        check_metadata(case.meta, case.q[:2], case.k_cache)
