"""Bad input, table-driven: every case is one clear line and exit code 2 on the CLI, or one specific KvlabError
subclass from the Python API, with the message's key phrases asserted. In a running engine a bad request fails
alone and every other request completes."""
from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from fakes.fake_cuda import FakeCudaDriver
from helpers.invariants import one_torch_thread  # noqa: F401 - module fixture
from safetensors.torch import save_file

from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError, DriverError, KernelUnavailable, ModelLoadError, RequestError
from kvlab.common.kv.seam import create_cache
from kvlab.common.kv.types import KVShape
from kvlab.common.llm import LLM
from kvlab.common.loader import load_model
from kvlab.common.sampling_params import SamplingParams
from kvlab.experiments.cli.main import main
from kvlab.experiments.workloads.requests import load_trace

ROOT = Path(__file__).resolve().parents[1]
TINY_TOKEN_BYTES = 2 * 4 * 2 * 64 * 4          # the tiny preset: 4 layers, 2 KV heads, head_dim 64, fp32


# -- model files -------------------------------------------------------------------------------------------------
def write_small_gguf(path: Path) -> None:
    """A valid GGUF with one llama tensor (64 KiB of data), to cut short."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-input")
    rng = random.Random(8)
    (root / "corrupt.gguf").write_bytes(bytes(rng.randrange(256) for _ in range(3000)))
    whole = root / "whole.gguf"
    write_small_gguf(whole)
    data = whole.read_bytes()
    (root / "truncated.gguf").write_bytes(data[:len(data) // 2])   # cut in the middle of the tensor data
    tiny = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    for name, weights in {"hf_corrupt": None, "hf_wrong_shape": {"model.embed_tokens.weight": torch.zeros(10, 32)},
                          "hf_missing_tensor": {"model.norm.weight": torch.ones(32)}}.items():
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(tiny))
        if weights is None:
            (d / "model.safetensors").write_bytes(bytes(rng.randrange(256) for _ in range(2000)))
        else:
            save_file(weights, str(d / "model.safetensors"))
    (root / "hf_no_config").mkdir()
    (root / "unknown_key.toml").write_text('[engine]\nbackend = "paged"\nblok_size = 16\n')
    (root / "invalid.toml").write_text('[engine\nbackend = paged\n')
    (root / "conflict.toml").write_text("[engine]\nmax_num_seqs = 64\nmax_num_batched_tokens = 16\n")
    return {p.name: p for p in root.iterdir()}


# -- the CLI -----------------------------------------------------------------------------------------------------
# (case, argv after `kvlab generate hi` unless it starts with "!", key phrases of the one stderr line)
CLI_CASES = [
    ("zero KV budget", ["--kv-cache-bytes", "0"], ["kv_cache_bytes must be a positive integer, got 0"]),
    ("negative block size", ["--block-size", "-4"], ["block_size must be a positive integer, got -4"]),
    ("zero max_num_seqs", ["--max-num-seqs", "0"], ["max_num_seqs must be a positive integer, got 0"]),
    ("page not a multiple of the OS page", ["--backend", "vmm", "--page-size", "5000"],
     ["page_size 5000 is not a multiple of the host page size 4096"]),
    ("unknown backend", ["--backend", "fast"], ["unknown backend 'fast'", "paged, vmm, reserve"]),
    ("unknown kernel", ["--kernel", "warp9"], ["unknown kernel 'warp9'", "known kernels:", "torch_paged"]),
    ("unknown preset", ["--model", "llama-70b"], ["model 'llama-70b' is neither a preset", "tiny, smollm2-135m"]),
    ("missing model file", ["--model", "{missing.gguf}"], ["model file '", "missing.gguf' does not exist"]),
    ("missing model directory", ["--model", "{no_such_dir}"], ["model directory '", "no_such_dir' does not exist"]),
    ("corrupt GGUF", ["--model", "{corrupt.gguf}"], ["corrupt.gguf: not a readable GGUF file", "magic"]),
    ("truncated GGUF", ["--model", "{truncated.gguf}"], ["truncated.gguf: not a readable GGUF file"]),
    ("corrupt safetensors", ["--model", "{hf_corrupt}"],
     ["model.safetensors: unreadable safetensors file", "header"]),
    ("HF dir without config.json", ["--model", "{hf_no_config}"], ["config.json not found"]),
    ("KV budget below one block", ["--kv-cache-bytes", "4KiB"],
     ["kv_cache_bytes 4096 is smaller than one block (65536 bytes)", "raise kv_cache_bytes"]),
    ("KV budget below one vmm page group", ["--backend", "vmm", "--kv-cache-bytes", "64KiB"],
     ["kv_cache_bytes 65536 holds no page group", "raise kv_cache_bytes or lower page_size"]),
    ("KV budget too small for the request", ["--kv-cache-bytes", "64KiB", "--max-tokens", "40", "--ignore-eos",
                                             "--max-model-len", "64"],   # unset, it is capped to the 16 tokens held
     ["needs 43 tokens of KV cache but the paged cache holds at most 16 per sequence", "raise kv_cache_bytes"]),
    ("prompt longer than max_model_len", ["!generate", "x" * 40, "--max-model-len", "32"],
     ["prompt (41 tokens) + max_tokens (32) exceeds max_model_len (32)"]),
    ("NaN temperature", ["--temperature", "nan"], ["temperature must be a finite number >= 0", "got nan"]),
    ("n < 1", ["--n", "0"], ["n must be an integer >= 1, got 0"]),
    ("max_tokens < 1", ["--max-tokens", "0"], ["max_tokens must be an integer >= 1, got 0"]),
    ("top_p out of range", ["--top-p", "1.5"], ["top_p must be in (0, 1], got 1.5"]),
    ("beam_width < 1", ["--beam-width", "0"], ["beam_width must be an integer >= 1"]),
    ("unknown config key", ["--config", "{unknown_key.toml}"], ["unknown config key(s): blok_size"]),
    ("invalid TOML", ["--config", "{invalid.toml}"], ["invalid.toml is not valid TOML"]),
    ("missing config file", ["--config", "{nope.toml}"], ["nope.toml does not exist"]),
    ("conflicting config keys", ["--config", "{conflict.toml}"],
     ["max_num_batched_tokens (16) must be >= max_num_seqs (64)"]),
    ("watermark out of range", ["--watermark", "1.5"], ["watermark must be a fraction in [0, 1), got 1.5"]),
    ("unparsable size", ["--kv-cache-bytes", "lots"], ["argument --kv-cache-bytes: bad size 'lots'"]),
    ("unknown dtype", ["--dtype", "int8"], ["unknown dtype 'int8'", "float32, float16, bfloat16"]),
    ("unknown device", ["--device", "tpu"], ["unknown device 'tpu'; use cpu or cuda[:N]"]),
    ("unknown preemption mode", ["--preemption-mode", "pray"], ["unknown preemption_mode 'pray'"]),
    ("negative threads", ["--threads", "-1"], ["threads must be >= 0"]),
    ("no subcommand", ["!"], ["the following arguments are required: COMMAND"]),
    ("unknown subcommand", ["!frobnicate"], ["invalid choice: 'frobnicate'"]),
]


def cli_argv(argv: list[str], files: dict[str, Path]) -> list[str]:
    def path_of(m: re.Match) -> str:
        name = m.group(1)
        return str(files[name]) if name in files else str(next(iter(files.values())).parent / name)

    def fill(arg: str) -> str:      # {name} anywhere in an argument: a fixture file (or a missing one beside them)
        return re.sub(r"\{([^{}]+)\}", path_of, arg)
    if argv and argv[0].startswith("!"):
        head = [argv[0][1:]] if argv[0] != "!" else []
        return head + [fill(a) for a in argv[1:]]
    return ["generate", "hi"] + [fill(a) for a in argv]


def one_error_line(stderr: str) -> str:
    """The single line a failing command prints; log lines of subcommands disabled because another engineer's
    module is not there yet are the only other lines tolerated."""
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("subcommand ")
             and "disabled:" not in ln]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("kvlab") and ": error: " in lines[0], lines[0]
    return lines[0]


def run_cli(argv: list[str]) -> int:
    """main() in this process, logging to stderr exactly as in a fresh one: pytest's log handlers are set aside so
    the CLI's logging.basicConfig installs its own stderr handler, which is removed again afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []
    try:
        return main(argv)
    finally:
        root.handlers, root.level = handlers, level


@pytest.mark.parametrize("case,argv,phrases", CLI_CASES,
                         ids=[c.values[0] if hasattr(c, "marks") else c[0] for c in CLI_CASES])
def test_cli_rejects_bad_input_with_one_line(case, argv, phrases, files, capsys):
    rc = run_cli(cli_argv(argv, files))
    out = capsys.readouterr()
    line = one_error_line(out.err)
    assert rc == 2, f"exit code {rc} for {case}: {line}"
    assert out.out == "", f"{case} printed to stdout: {out.out!r}"
    for phrase in phrases:
        assert phrase in line, f"{case}: {phrase!r} not in {line!r}"


# The same path end to end in a fresh process: the console script and `python -m`, exit code and stderr.
SUBPROCESS_CASES = [
    ([str(Path(sys.executable).with_name("kvlab")), "generate", "hi", "--kv-cache-bytes", "0"],
     "kv_cache_bytes must be a positive"),
    ([sys.executable, "-m", "kvlab.experiments.cli.main", "generate", "hi", "--model", "{corrupt.gguf}"],
     "not a readable GGUF file"),
]


@pytest.mark.parametrize("argv,phrase", SUBPROCESS_CASES, ids=["console-script", "python-m"])
def test_cli_process_exits_2_without_a_traceback(argv, phrase, files):
    argv = [str(files[a[1:-1]]) if a.startswith("{") else a for a in argv]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert phrase in one_error_line(proc.stderr)
    assert proc.stdout == ""


# -- the Python API ----------------------------------------------------------------------------------------------
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=32, num_q_heads=4)
BIG_TOKEN_SHAPE = KVShape(num_layers=1, num_kv_heads=8, head_dim=256, num_q_heads=8)   # 8 KiB per token-layer


def nan_watermark():
    make_config(watermark=math.nan)


API_CASES = [
    ("zero KV budget", lambda f: make_config(kv_cache_bytes=0), ConfigError, ["kv_cache_bytes must be a positive"]),
    ("negative max_num_seqs", lambda f: make_config(max_num_seqs=-2), ConfigError,
     ["max_num_seqs must be a positive integer, got -2"]),
    ("bool as a size", lambda f: make_config(block_size=True), ConfigError, ["block_size must be a positive"]),
    ("page not a multiple of the OS page", lambda f: make_config(page_size=5000), ConfigError,
     ["not a multiple of the host page size"]),
    ("NaN watermark", lambda f: nan_watermark(), ConfigError, ["watermark must be a fraction in [0, 1)"]),
    ("unknown config key", lambda f: make_config(blocksize=16), ConfigError, ["unknown config key(s): blocksize"]),
    ("unknown key in replace", lambda f: make_config().replace(pagesize=4096), ConfigError,
     ["unknown config key(s): pagesize"]),
    ("conflicting keys", lambda f: make_config(max_num_seqs=64, max_num_batched_tokens=32), ConfigError,
     ["must be >= max_num_seqs"]),
    ("unknown backend", lambda f: make_config(backend="vllm"), ConfigError, ["unknown backend 'vllm'"]),
    ("host driver page not a multiple of the OS page", lambda f: _host_driver(5000), DriverError,
     ["page_size 5000 is not a positive multiple of the OS page"]),
    ("vmm page smaller than one token", lambda f: create_cache(
        make_config(backend="vmm", page_size=4096), BIG_TOKEN_SHAPE, accounting_only=True), ConfigError,
     ["page_size 4096 B is smaller than one token's K for one layer (8192 B)"]),
    ("paged budget below one block", lambda f: create_cache(
        make_config(backend="paged", kv_cache_bytes=4096, block_size=16), SHAPE, accounting_only=True),
     ConfigError, ["smaller than one block"]),
    ("vmm budget below one page group", lambda f: create_cache(
        make_config(backend="vmm", kv_cache_bytes=4096, page_size=4096), SHAPE, accounting_only=True),
     ConfigError, ["holds no page group"]),
    ("unknown preset", lambda f: load_model("gpt-5"), ModelLoadError, ["neither a preset"]),
    ("missing GGUF", lambda f: load_model(f["corrupt.gguf"].with_name("missing.gguf")), ModelLoadError,
     ["model file '", "missing.gguf' does not exist"]),
    ("corrupt GGUF", lambda f: load_model(f["corrupt.gguf"]), ModelLoadError, ["not a readable GGUF file"]),
    ("corrupt safetensors", lambda f: load_model(f["hf_corrupt"]), ModelLoadError, ["unreadable safetensors file"]),
    ("tensor of the wrong shape", lambda f: load_model(f["hf_wrong_shape"]), ModelLoadError,
     ["'model.embed_tokens.weight' has shape (10, 32)"]),
    ("missing tensor", lambda f: load_model(f["hf_missing_tensor"]), ModelLoadError, ["missing tensor"]),
    ("unknown dtype", lambda f: load_model("tiny", dtype="int4"), ConfigError, ["unknown dtype 'int4'"]),
    ("NaN temperature", lambda f: SamplingParams(temperature=math.nan), RequestError,
     ["temperature must be a finite number", "nan"]),
    ("infinite temperature", lambda f: SamplingParams(temperature=math.inf), RequestError, ["finite"]),
    ("n < 1", lambda f: SamplingParams(n=0), RequestError, ["n must be an integer >= 1, got 0"]),
    ("float n", lambda f: SamplingParams(n=2.0), RequestError, ["n must be an integer >= 1, got 2.0"]),
    ("negative max_tokens", lambda f: SamplingParams(max_tokens=-1), RequestError, ["max_tokens must be"]),
    ("negative stop token", lambda f: SamplingParams(stop_token_ids=[-1]), RequestError, ["stop_token_ids"]),
    ("beam with n > width", lambda f: SamplingParams(beam_width=2, n=3), RequestError, ["n=3 > beam_width=2"]),
]


def _host_driver(page_size: int):
    from kvlab.vmm.drivers.host import HostVirtualMemory
    return HostVirtualMemory(page_size)


@pytest.mark.parametrize("case,make,exc,phrases", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_raises_a_specific_error(case, make, exc, phrases, files):
    with pytest.raises(exc) as info:
        make(files)
    message = str(info.value)
    assert "\n" not in message, f"{case}: the message spans several lines: {message!r}"
    for phrase in phrases:
        assert phrase in message, f"{case}: {phrase!r} not in {message!r}"


def test_cuda_page_size_off_the_granularity_is_rounded_up_and_logged(caplog):
    """Via the recording fake: 3 MiB on a 2 MiB-granularity device becomes 4 MiB, with a warning saying so
    (a logged fallback, not an error: the config layer cannot know the device's granularity)."""
    from kvlab.vmm.drivers.cuda import CudaVirtualMemory
    fake = FakeCudaDriver(granularity=2 * 1024**2)
    with caplog.at_level(logging.WARNING, logger="kvlab.vmm"):
        driver = CudaVirtualMemory(0, page_size=3 * 1024**2, driver=fake)
    assert driver.page_size == 4 * 1024**2
    assert "page_size 3145728 is not a multiple of device 0's allocation granularity 2097152; using 4194304" \
        in caplog.text
    driver.close()
    assert fake.leaks() == {}


# -- requests to a built LLM ------------------------------------------------------------------------------------
BUDGET = {"kv_cache_bytes": 64 * TINY_TOKEN_BYTES, "block_size": 16, "page_size": 4096, "reserve_mode": "oracle",
              "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def llms():
    built = {b: LLM(model="tiny", backend=b, **BUDGET) for b in ("paged", "vmm", "reserve")}
    yield built
    for llm in built.values():
        llm.close()


REQUEST_CASES = [
    ("empty prompt list", lambda llm: llm.generate([]), ["the prompt list is empty"]),
    ("empty prompt", lambda llm: llm.generate([[]]), ["the prompt is empty"]),
    ("prompt longer than max_model_len", lambda llm: llm.generate([[5] * 300]),
     ["prompt (300 tokens) + max_tokens (16) exceeds max_model_len (256)"]),
    ("token outside the vocabulary", lambda llm: llm.generate([[5, 99999]]),
     ["token id 99999 is outside the model's vocabulary [0, 1024)"]),
    ("one bad prompt among good ones", lambda llm: llm.generate([[5, 6], [7, -1]]),
     ["prompt 1:", "token id -1 is outside"]),
    ("params count mismatch", lambda llm: llm.generate([[5], [6]], [SamplingParams(), SamplingParams(),
                                                                  SamplingParams()]),
     ["got 3 SamplingParams for 2 prompts"]),
    ("params of the wrong type", lambda llm: llm.generate([[5]], {"temperature": 0}), ["SamplingParams"]),
    ("wider than max_num_seqs", lambda llm: llm.generate([[5]], SamplingParams(n=9)),
     ["needs 9 sequences at once but max_num_seqs is 8"]),
]


@pytest.mark.parametrize("case,call,phrases", REQUEST_CASES, ids=[c[0] for c in REQUEST_CASES])
def test_bad_requests_raise_request_error_and_leave_the_engine_empty(case, call, phrases, llms):
    llm = llms["paged"]
    with pytest.raises(RequestError) as info:
        call(llm)
    for phrase in phrases:
        assert phrase in str(info.value), f"{case}: {phrase!r} not in {info.value}"
    assert not llm.engine.has_unfinished() and llm.cache_stats().used_units == 0


def test_unknown_kernel_is_refused_at_construction():
    with pytest.raises(KernelUnavailable, match="unknown kernel 'warp9'; known kernels:"):
        LLM(model="tiny", kernel="warp9", **BUDGET)


GOOD = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("backend", ["paged", "vmm", "reserve"])
def test_an_impossible_request_fails_alone(backend, llms):
    """64 tokens of KV: one request needs 80 (fits max_model_len, never the cache); the other three finish."""
    llm = llms[backend]
    prompts = [[5, 6, 7], [8] * 20, [9, 10], [11] * 6]
    params = [GOOD, SamplingParams(max_tokens=60, ignore_eos=True), GOOD, GOOD]
    outputs = llm.generate(prompts, params)
    bad = outputs[1]
    assert bad.error and "needs 80 tokens of KV cache" in bad.error and "holds at most 64" in bad.error
    assert [c.finish_reason for c in bad.outputs] == ["error"] and bad.outputs[0].token_ids == []
    for i in (0, 2, 3):
        assert outputs[i].error is None
        assert [len(c.token_ids) for c in outputs[i].outputs] == [8]
        assert outputs[i].outputs[0].finish_reason == "length"
    assert llm.cache_stats().used_units == 0


@pytest.mark.parametrize("backend", ["paged", "vmm", "reserve"])
def test_bad_requests_added_mid_run_fail_alone(backend, llms):
    """A running engine: an invalid request raises at add, an impossible one fails alone, the rest finish."""
    engine = llms[backend].engine
    good = [engine.add_request([5 + i, 6, 7], GOOD) for i in range(3)]
    engine.step()
    with pytest.raises(RequestError, match="temperature must be a finite number"):
        engine.add_request([5], SamplingParams(max_tokens=4, temperature=float("nan")))
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([5], GOOD, request_id=good[0])
    impossible = engine.add_request([12] * 30, SamplingParams(max_tokens=50, ignore_eos=True))
    done = {}
    while engine.has_unfinished():
        for out in engine.step().finished:
            done[out.request_id] = out
    assert set(done) == set(good) | {impossible}
    assert done[impossible].error and "holds at most 64" in done[impossible].error
    assert all(done[r].error is None and len(done[r].outputs[0].token_ids) == 8 for r in good)
    assert engine.cache.stats().used_units == 0


# == round 2 (issue 20): hangs, unbounded sizes, config types, tracebacks, late validation, smaller items ========
def write_llama_gguf(path: Path, blocks: int = 1, heads: int = 2, context: int = 64, merges: list[str] | None = None
                     ) -> None:
    """A complete one-layer llama GGUF (hidden 8, 2 heads, 1 KV head, vocab 6) with a gpt2 tokenizer; the header
    may lie (blocks, heads, context) or the merges may be broken."""
    writer = gguf.GGUFWriter(str(path), "llama")
    hidden, ff, kv, tokens = 8, 16, 1, ["a", "b", "ab", "c", "<s>", "</s>"]
    writer.add_block_count(blocks)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_context_length(context)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["a b"] if merges is None else merges)
    writer.add_token_types([1, 1, 1, 1, 3, 3])
    hd = hidden // max(heads, 1)
    full = lambda *shape: np.full(shape, 0.01, dtype=np.float32)   # noqa: E731
    writer.add_tensor("token_embd.weight", full(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", full(hidden))
    for name, shape in (("attn_norm", (hidden,)), ("attn_q", (heads * hd, hidden)), ("attn_k", (kv * hd, hidden)),
                        ("attn_v", (kv * hd, hidden)), ("attn_output", (hidden, heads * hd)), ("ffn_norm", (hidden,)),
                        ("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden)), ("ffn_down", (hidden, ff))):
        writer.add_tensor(f"blk.0.{name}.weight", full(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


HF_TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
HF_BROKEN = {
    "hf_string_size": {"hidden_size": "32"}, "hf_zero_heads": {"num_attention_heads": 0},
    "hf_string_rope_scaling": {"rope_scaling": "llama3"}, "hf_string_rope_theta": {"rope_theta": "10000"},
    "hf_float_vocab": {"vocab_size": 1e12}, "hf_huge_vocab": {"vocab_size": 10**12},
    "hf_million_layers": {"num_hidden_layers": 10**6}, "hf_nan_eps": {"rms_norm_eps": math.nan},
    "hf_bool_heads": {"num_attention_heads": True},
    "hf_llama3_string_factor": {"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1,
                                                 "high_freq_factor": 4, "original_max_position_embeddings": 64}},
    "hf_beyond_ram": {"hidden_size": 65536, "intermediate_size": 2**20, "num_hidden_layers": 1000,
                      "num_attention_heads": 512, "num_key_value_heads": 8},
}
TRACES = {
    "nan_arrival.jsonl": '{"prompt_len": 8, "output_len": 4, "arrival_s": NaN}\n',
    "inf_arrival.jsonl": '{"prompt_len": 8, "output_len": 4, "arrival_s": Infinity}\n',
    "late_arrival.jsonl": '{"prompt_len": 8, "output_len": 4, "arrival_s": 1e12}\n',
    "negative_length.jsonl": '{"prompt_len": -5, "output_len": 4}\n',
    "zero_output.jsonl": '{"prompt_len": 5, "output_len": 0}\n',
    "huge_length.jsonl": '{"prompt_len": 1000000000000, "output_len": 4}\n',
    "inf_length.jsonl": '{"prompt_len": Infinity, "output_len": 4}\n',
}
TOMLS = {
    "string_bool.toml": 'check_invariants = "false"\n', "vmm_string_bool.toml": '[vmm]\nbackground_mapping = "no"\n',
    "int_bool.toml": "enable_prefix_caching = 1\n", "int_device.toml": "device = 1\n",
    "int_engine.toml": "engine = 5\n", "int_backend_table.toml": "paged = 5\n", "int_dtype.toml": "dtype = 32\n",
    "huge_seed.toml": "seed = 1180591620717411303424\n", "string_budget.toml": 'kv_cache_bytes = "64MiB"\n',
}


@pytest.fixture(scope="module")
def files2(files) -> dict[str, Path]:
    root = next(iter(files.values())).parent / "round2"
    root.mkdir()
    for name, override in HF_BROKEN.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({**HF_TINY, **override}))
    for name, shards in {"hf_shard_escape": "../outside.safetensors", "hf_shard_absolute": "/etc/passwd"}.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(HF_TINY))
        index = {"weight_map": {"lm_head.weight": shards}}
        (root / name / "model.safetensors.index.json").write_text(json.dumps(index))
    for name, kw in {"gguf_zero_heads": {"heads": 0}, "gguf_huge_context": {"context": 300_000_000},
                     "gguf_million_blocks": {"blocks": 10**6}, "gguf_bad_merges": {"merges": ["zz qq"]},
                     "gguf_empty_merge": {"merges": [""]}}.items():
        write_llama_gguf(root / f"{name}.gguf", **kw)
    for name, text in {**TRACES, **TOMLS}.items():
        (root / name).write_text(text)
    (root / "latin1.toml").write_bytes(b"seed = 0 # caf\xe9\n")
    (root / "latin1.jsonl").write_bytes(b'{"prompt_len": 8, "output_len": 4} \xe9\n')
    (root / "a_file").write_text("x")
    return {**files, **{p.name: p for p in root.iterdir()}}


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
SIM = ["!simulate", "--no-progress", "--num-requests", "20"]
BENCH = ["!bench", "--no-progress", "--num-requests", "2"]
# (category, case, argv as in CLI_CASES, key phrases of the one stderr line)
ROUND2_CLI_CASES = [
    ("hang", "simulate NaN rate", [*SIM, "--rate", "nan"], ["rate (requests per second) must be a finite number"]),
    ("hang", "simulate infinite rate", [*SIM, "--rate", "inf"], ["rate (requests per second) must be a finite"]),
    ("hang", "simulate negative rate", [*SIM, "--rate", "-3"], ["must be a finite number >= 0, got -3"]),
    ("hang", "simulate absurdly low rate", [*SIM, "--rate", "1e-9"], ["more than the maximum 604800 s", "--rate"]),
    ("hang", "bench NaN rate", [*BENCH, "--rate", "nan"], ["rate (requests per second) must be a finite"]),
    ("hang", "bench absurdly low rate", [*BENCH, "--rate", "1e-12"], ["more than the maximum 604800 s"]),
    ("hang", "trace arrival NaN", [*SIM, "--workload", "trace:{nan_arrival.jsonl}"],
     ["nan_arrival.jsonl:1: arrival_s must be a finite number", "got nan"]),
    ("hang", "trace arrival Infinity", [*SIM, "--workload", "trace:{inf_arrival.jsonl}"],
     ["inf_arrival.jsonl:1: arrival_s must be a finite number", "got inf"]),
    ("hang", "trace arrival a million years away", [*BENCH, "--workload", "trace:{late_arrival.jsonl}"],
     ["late_arrival.jsonl:1: arrival_s must be a finite number in [0, 604800] s"]),
    ("hang", "sharing --widths 1000", ["!sharing", "--widths", "1000"], ["--widths must all be <= 64", "1000"]),
    ("size", "simulate --budget-gb 1e6", [*SIM, "--budget-gb", "1e6"],
     ["--budget-gb must be a finite number > 0 and <= 100000, got 1000000.0"]),
    ("size", "simulate paged books beyond RAM",
     [*SIM, "--model", "tiny", "--policies", "paged", "--block-size", "1", "--budget-gb", "9e4"],
     ["paged blocks", "more than this machine's RAM"]),
    ("size", "bench --num-requests 1e11", [*BENCH[:2], "--num-requests", "100000000000"],
     ["num_requests must be an integer in [1, 1,000,000]"]),
    ("size", "simulate 10 million requests", [*SIM[:2], "--num-requests", "10000000"], ["num_requests must be"]),
    ("size", "bench --scale 1e6", [*BENCH, "--scale", "1e6"], ["more than the maximum 4,194,304; lower --scale"]),
    ("size", "simulate --scale 1e6", [*SIM, "--scale", "1e6"], ["more than the maximum 4,194,304"]),
    ("size", "--max-model-len 1e8", ["--max-model-len", "100000000"],
     ["max_model_len must be an integer in [1, 4,194,304]"]),
    ("size", "paged KV budget above RAM", ["--kv-cache-bytes", "100TiB"],
     ["kv_cache_bytes 109,951,162,777,600 needs 100.0 TiB, more than this machine's RAM"]),
    ("size", "vmm physical pool above RAM", ["--backend", "vmm", "--kv-cache-bytes", "100TiB"],
     ["more than this machine's RAM", "lower --kv-cache-bytes"]),
    ("size", "--threads 100000", ["--threads", "100000"], ["threads must be an integer in [0, ", "got 100000"]),
    ("size", "simulate --jobs 100000", [*SIM, "--jobs", "100000"], ["--jobs must be an integer in [1, "]),
    ("size", "bench --warmup 1e9", [*BENCH, "--warmup", "1000000000"], ["--warmup must be an integer in [0, "]),
    ("size", "GGUF declaring 10^6 blocks", ["--model", "{gguf_million_blocks.gguf}"],
     ["GGUF block_count is 1,000,000 but the file holds tensors for 1 block(s)"]),
    ("size", "HF config with 10^6 layers", ["--model", "{hf_million_layers}"],
     ["num_layers 1,000,000 exceeds the sane maximum 1,024"]),
    ("size", "HF config with vocab_size 10^12", ["--model", "{hf_huge_vocab}"],
     ["vocab_size 1,000,000,000,000 exceeds the sane maximum"]),
    ("size", "HF model larger than RAM", ["--model", "{hf_beyond_ram}"], ["more than this machine's RAM"]),
    ("size", "trace length 10^12", [*SIM, "--workload", "trace:{huge_length.jsonl}"],
     ["huge_length.jsonl:1: lengths must be in [1, 4,194,304]"]),
    ("type", 'TOML check_invariants = "false"', ["--config", "{string_bool.toml}"],
     ["check_invariants must be true or false, got 'false'"]),
    ("type", 'TOML [vmm] background_mapping = "no"', ["--config", "{vmm_string_bool.toml}"],
     ["background_mapping must be true or false, got 'no'"]),
    ("type", "TOML enable_prefix_caching = 1", ["--config", "{int_bool.toml}"],
     ["enable_prefix_caching must be true or false, got 1"]),
    ("type", "TOML paged = 5", ["--config", "{int_backend_table.toml}"], ["paged must be a table of paged options"]),
    ("type", "TOML dtype = 32", ["--config", "{int_dtype.toml}"], ["dtype must be a string, got 32"]),
    ("type", 'TOML kv_cache_bytes = "64MiB"', ["--config", "{string_budget.toml}"],
     ["kv_cache_bytes must be a positive integer, got '64MiB'"]),
    ("type", "flag --background-mapping maybe", ["--background-mapping", "maybe"], ["expected true or false"]),
    ("line", "--seed 2**70", ["--seed", str(2**70)], ["seed must be an integer in [0, 9,223,372,036,854,775,807]"]),
    ("line", "negative seed", ["--seed", "-1"], ["seed must be an integer in [0, "]),
    ("line", "simulate --seed 2**70", [*SIM, "--seed", str(2**70)], ["seed must be an integer in [0, "]),
    ("line", "bench --seed 2**70", [*BENCH, "--seed", str(2**70)], ["seed must be an integer in [0, "]),
    pytest.param("line", "--device cuda without a GPU", ["--device", "cuda"],
                 ["device 'cuda': no CUDA GPU is available here"], marks=NO_GPU),
    ("line", "--device cpu1", ["--device", "cpu1"], ["unknown device 'cpu1'; use cpu or cuda[:N]"]),
    ("line", "--device cuda:x", ["--device", "cuda:x"], ["unknown device 'cuda:x'"]),
    ("line", "TOML device = 1", ["--config", "{int_device.toml}"], ["device must be a string, got 1"]),
    ("line", "TOML engine = 5", ["--config", "{int_engine.toml}"], ["engine must be a table ([engine]), got 5"]),
    ("line", "TOML seed = 2**70", ["--config", "{huge_seed.toml}"], ["seed must be an integer in [0, "]),
    ("line", "non-UTF-8 TOML", ["--config", "{latin1.toml}"], ["latin1.toml is not UTF-8 text"]),
    ("line", "HF string size", ["--model", "{hf_string_size}"], ["hidden_size must be a positive integer, got '32'"]),
    ("line", "HF 0 heads", ["--model", "{hf_zero_heads}"], ["num_attention_heads must be a positive integer, got 0"]),
    ("line", "HF boolean heads", ["--model", "{hf_bool_heads}"], ["num_attention_heads must be a positive"]),
    ("line", "HF string rope_scaling", ["--model", "{hf_string_rope_scaling}"],
     ["rope_scaling must be an object (or null), got 'llama3'"]),
    ("line", "HF string rope_theta", ["--model", "{hf_string_rope_theta}"],
     ["rope_theta must be a positive finite number, got '10000'"]),
    ("line", "HF string llama3 factor", ["--model", "{hf_llama3_string_factor}"],
     ["rope_scaling factor must be a positive finite number, got '8'"]),
    ("line", "HF vocab_size 1e12", ["--model", "{hf_float_vocab}"], ["vocab_size must be a positive integer"]),
    ("line", "HF NaN rms_norm_eps", ["--model", "{hf_nan_eps}"], ["rms_norm_eps must be a positive finite"]),
    ("line", "GGUF head_count 0", ["--model", "{gguf_zero_heads.gguf}"],
     ["GGUF llama.attention.head_count must be a positive integer, got 0"]),
    ("line", "GGUF context_length 3e8", ["--model", "{gguf_huge_context.gguf}"],
     ["max_position_embeddings 300,000,000 exceeds the sane maximum"]),
    ("line", "GGUF bad merges", ["--model", "{gguf_bad_merges.gguf}"],
     ["the embedded GGUF tokenizer is malformed", "out of vocabulary"]),
    ("line", "GGUF empty merge", ["--model", "{gguf_empty_merge.gguf}"], ["the embedded GGUF tokenizer is malformed"]),
    ("line", "bench --scale nan", [*BENCH, "--scale", "nan"], ["length scale must be positive, got nan"]),
    ("line", "simulate --scale nan", [*SIM, "--scale", "nan"], ["length scale must be positive, got nan"]),
    ("line", "simulate --budget-gb nan", [*SIM, "--budget-gb", "nan"], ["--budget-gb must be a finite number"]),
    ("line", "simulate --mfu 0", [*SIM, "--mfu", "0"], ["--mfu must be a finite number > 0 and <= 1"]),
    ("line", "trace length Infinity", [*SIM, "--workload", "trace:{inf_length.jsonl}"], ["inf_length.jsonl:1: need"]),
    ("line", "non-UTF-8 trace", [*SIM, "--workload", "trace:{latin1.jsonl}"], ["latin1.jsonl is not UTF-8 text"]),
    ("line", "non-UTF-8 argument", ["!generate", "caf\udce9"], ["argument 'caf\\udce9' is not valid UTF-8 text"]),
    ("line", "non-UTF-8 option value", ["--model", "\udcff.gguf"], ["is not valid UTF-8 text"]),
    ("late", "simulate --json into a missing directory", [*SIM, "--json", "{no_dir}/rows.json"],
     ["--json ", "no_dir does not exist"]),
    ("late", "simulate --json under a file", [*SIM, "--json", "{a_file}/rows.json"], ["does not exist"]),
    ("late", "simulate --plot is a directory", [*SIM, "--plot", "{hf_zero_heads}"], ["is a directory; give a file"]),
    ("late", "bench --out is a file", [*BENCH, "--out", "{a_file}"], ["--out ", "exists and is not a directory"]),
    ("late", "bench --out under a file", [*BENCH, "--out", "{a_file}/results"], ["--out ", "cannot write there"]),
    ("late", "sharing --json into a missing directory", ["!sharing", "--json", "{no_dir}/rows.json"],
     ["does not exist"]),
    ("small", "negative trace length", [*SIM, "--workload", "trace:{negative_length.jsonl}"],
     ["negative_length.jsonl:1: lengths must be in [1, ", "prompt_len -5"]),
    ("small", "zero trace output length", [*SIM, "--workload", "trace:{zero_output.jsonl}"], ["output_len 0"]),
    ("small", "max_model_len above max_position_embeddings", ["--max-model-len", "8192"],
     ["max_model_len 8192 exceeds the model's max_position_embeddings 4096"]),
    ("small", "sharded index pointing outside", ["--model", "{hf_shard_escape}"],
     ["shard '../outside.safetensors' lies outside the model directory"]),
    ("small", "sharded index with an absolute path", ["--model", "{hf_shard_absolute}"],
     ["shard '/etc/passwd' lies outside the model directory"]),
]


def _ids(cases: list) -> list[str]:
    return [c.values[1] if hasattr(c, "marks") else c[1] for c in cases]


@pytest.mark.parametrize("category,case,argv,phrases", ROUND2_CLI_CASES, ids=_ids(ROUND2_CLI_CASES))
def test_round2_cli_rejects_with_one_line_before_any_work(category, case, argv, phrases, files2, capsys):
    rc = run_cli(cli_argv(argv, files2))
    out = capsys.readouterr()
    line = one_error_line(out.err)
    assert rc == 2, f"exit code {rc} for {case}: {line}"
    assert out.out == "", f"{case} printed to stdout: {out.out[:300]!r}"
    for phrase in phrases:
        assert phrase in line, f"{case}: {phrase!r} not in {line!r}"


def nan_weight_step():
    from kvlab.common.engine import Engine
    model, tokenizer = load_model("tiny")
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.fill_(math.nan) if hasattr(model.layers[0], "mlp") else None
        model.lm_head.weight.fill_(math.nan)
    engine = Engine.from_model(make_config(backend="paged", **BUDGET), model, tokenizer)
    try:
        engine.add_request([5, 6, 7], GOOD)
        engine.step()
    finally:
        engine.close()


ROUND2_API_CASES = [
    ("type", "keyword check_invariants='false'", lambda f: make_config(check_invariants="false"), ConfigError,
     ["check_invariants must be true or false, got 'false'"]),
    ("type", "keyword background_mapping='no'", lambda f: make_config(background_mapping="no"), ConfigError,
     ["background_mapping must be true or false, got 'no'"]),
    ("type", "keyword enable_prefix_caching=1", lambda f: make_config(enable_prefix_caching=1), ConfigError,
     ["enable_prefix_caching must be true or false, got 1"]),
    ("type", "table vmm_single_range='yes'", lambda f: make_config(vmm={"vmm_single_range": "yes"}), ConfigError,
     ["vmm_single_range must be true or false"]),
    ("type", "reserve_mode=3", lambda f: make_config(reserve_mode=3), ConfigError, ["reserve_mode must be a string"]),
    ("type", "threads=2.0", lambda f: make_config(threads=2.0), ConfigError, ["threads must be an integer, got 2.0"]),
    ("type", "watermark='0.1'", lambda f: make_config(watermark="0.1"), ConfigError, ["watermark must be a number"]),
    ("type", "replace(enable_prefix_caching='yes')", lambda f: make_config().replace(enable_prefix_caching="yes"),
     ConfigError, ["enable_prefix_caching must be true or false"]),
    ("line", "seed=2**70", lambda f: make_config(seed=2**70), ConfigError, ["seed must be an integer in [0, "]),
    ("line", "device='cpu1'", lambda f: make_config(device="cpu1"), ConfigError, ["unknown device 'cpu1'"]),
    ("size", "max_model_len=10**8", lambda f: make_config(max_model_len=10**8), ConfigError,
     ["max_model_len must be an integer in [1, 4,194,304]"]),
    ("size", "threads=100000", lambda f: make_config(threads=100000), ConfigError, ["threads must be an integer in"]),
    ("small", "sharded index pointing outside", lambda f: load_model(f["hf_shard_escape"]), ModelLoadError,
     ["lies outside the model directory"]),
    ("small", "NaN weights fail loudly", lambda f: nan_weight_step(), ModelLoadError,
     ["the model produced non-finite logits (NaN or Inf)"]),
    ("small", "negative trace length", lambda f: load_trace(f["negative_length.jsonl"]), ConfigError,
     ["lengths must be in [1, 4,194,304], got prompt_len -5"]),
]


@pytest.mark.parametrize("category,case,make,exc,phrases", ROUND2_API_CASES, ids=[c[1] for c in ROUND2_API_CASES])
def test_round2_api_raises_a_specific_error(category, case, make, exc, phrases, files2):
    with pytest.raises(exc) as info:
        make(files2)
    message = str(info.value)
    assert "\n" not in message, f"{case}: the message spans several lines: {message!r}"
    for phrase in phrases:
        assert phrase in message, f"{case}: {phrase!r} not in {message!r}"


def test_bench_reports_the_agreement_rate_below_fp32():
    from kvlab.experiments.bench.plan import BenchPlan
    from kvlab.experiments.bench.report import agreement_note
    runs = [{"backend": "vmm", "outputs_match_first": 48, "num_requests": 48},
            {"backend": "paged", "outputs_match_first": 40, "num_requests": 48}]
    plan = BenchPlan(["vmm", "paged"], {"vmm": make_config(dtype="bfloat16"), "paged": make_config(dtype="bfloat16")},
                     [], [], 0, Path("."), [])
    assert agreement_note(plan, runs).startswith("bfloat16: greedy outputs equal to vmm's: paged 40/48 (83%)")
    plan.configs = {"vmm": make_config(), "paged": make_config()}
    assert agreement_note(plan, runs) == ""


# Round 3 (issue 28, the command line): simulate serve and the older surfaces, each case a reproduction from the
# issue. (category, case, argv as in CLI_CASES, key phrases of the one stderr line); nothing on stdout.
SERVE = ["!simulate", "serve", "--no-progress", "--no-save", "--num-prompts", "20", "--jobs", "1"]
SERVE_SAVING = ["!simulate", "serve", "--no-progress", "--num-prompts", "20", "--jobs", "1"]
ROUND3_CLI_CASES = [
    ("hang", "serve --num-prompts 10000000", [*SERVE, "--num-prompts", "10000000"],
     ["--num-prompts must be an integer in [1, 1,000,000], got 10000000"]),
    ("hang", "serve rate 1e-300", [*SERVE, "--request-rates", "1e-300"], ["more than the maximum 604800 s"]),
    ("traceback", "serve --seeds 1000000000", [*SERVE, "--seeds", "1000000000"],
     ["--seeds must be an integer in [1, "]),
    ("traceback", "serve --budget-gb nan", [*SERVE, "--budget-gb", "nan"], ["--budget-gb must be a finite number"]),
    ("traceback", "serve garbage calibration", [*SERVE, "--driver-costs", "host", "--calibration",
                                                "{garbage_calibration.json}"], ["is not `kvlab calibrate`'s JSON"]),
    ("traceback", "serve {} calibration", [*SERVE, "--driver-costs", "host", "--calibration",
                                           "{empty_calibration.json}"],
     ["is not `kvlab calibrate`'s JSON", "KeyError"]),
    ("traceback", "serve NaN in a calibration", [*SERVE, "--driver-costs", "host", "--calibration",
                                                 "{nan_calibration.json}"], ["map_s of page size 2097152 must be"]),
    ("accepted", "serve --jobs 0", [*SERVE, "--jobs", "0"], ["--jobs must be an integer in [1, "]),
    ("accepted", "serve --jobs -1", [*SERVE, "--jobs=-1"], ["--jobs must be an integer in [1, "]),
    ("accepted", "serve --jobs 1000", [*SERVE, "--jobs", "1000"], ["--jobs must be an integer in [1, ", "per CPU"]),
    ("accepted", "serve --slo-tolerance 0", [*SERVE, "--slo-tolerance", "0"], ["--slo-tolerance must be a finite"]),
    ("accepted", "serve --slo-tolerance nan", [*SERVE, "--slo-tolerance", "nan"], ["--slo-tolerance must be a finite"]),
    ("accepted", "serve --slo-tolerance -1", [*SERVE, "--slo-tolerance=-1"], ["--slo-tolerance must be a finite"]),
    ("accepted", "serve --slo p101_ttft_ms<=5", [*SERVE, "--slo", "p101_ttft_ms<=5"],
     ["--slo p101_ttft_ms is not a latency result key"]),
    ("accepted", "serve duplicate SLO keys", [*SERVE, "--slo", "p99_ttft_ms<=5,p99_ttft_ms<=6"],
     ["names p99_ttft_ms twice"]),
    ("accepted", "serve --slo 400 digits", [*SERVE, "--slo", "p99_ttft_ms<=" + "9" * 400], ["must be a finite number"]),
    ("accepted", "serve --input-len -5", [*SERVE, "--dataset", "random", "--input-len=-5"],
     ["--input-len must be an integer in [1, "]),
    ("accepted", "serve --goodput ttft:nan", [*SERVE, "--goodput", "ttft:nan"], ["must be a finite number of ms > 0"]),
    ("output", "serve --out /proc/x", [*SERVE_SAVING, "--out", "/proc/x"], ["--out /proc/x: cannot write there"]),
    ("output", "simulate --out /proc/x", [*SIM, "--out", "/proc/x"], ["--out /proc/x: cannot write there"]),
    ("output", "simulate unknown policy", [*SIM, "--policies", "reserve,nope"], ["nope"]),
    ("output", "simulate --max-num-seqs 0", [*SIM, "--max-num-seqs", "0"], ["--max-num-seqs must be an integer"]),
    ("output", "sharing --kv-cache-dtype nope", ["!sharing", "--kv-cache-dtype", "nope"], ["kv_cache_dtype"]),
    ("output", "fallbacks --out /proc/x", ["!fallbacks", "--out", "/proc/x"], ["--out /proc/x: cannot write there"]),
    ("output", "calibrate --page-sizes nan", ["!calibrate", "--page-sizes", "nan"], ["bad size 'nan'"]),
    ("output", "calibrate --out /proc/x", ["!calibrate", "--out", "/proc/x/host.json"], ["--out /proc/x/host.json"]),
    ("usage", "bench --suite perf --threads -3", [*BENCH, "--suite", "perf", "--threads=-3"],
     ["kvlab bench: error: --threads must be an integer in [1, "]),
    ("accepted", "bench --kv-cache-bytes 64KiB", [*BENCH, "--kv-cache-bytes", "64KiB"],
     ["holds at most", "every request would fail; raise --kv-cache-bytes"]),
    ("accepted", "kv_cache_scale 1e-45 with fp8", ["--kv-cache-dtype", "fp8_e4m3", "--kv-cache-scale", "1e-45"],
     ["kv_cache_scale must be a finite number in [1e-06, 1000000] (or 0: from the first prefill), got 1e-45"]),
    ("line", "kv_cache_scale 1e300 with fp8", ["--kv-cache-dtype", "fp8_e4m3", "--kv-cache-scale", "1e300"],
     ["kv_cache_scale must be a finite number in [1e-06, 1000000]"]),
    ("accepted", "kv_cache_scale with dtype auto", ["--kv-cache-scale", "0.5"],
     ["kv_cache_scale 0.5 applies only to an fp8 kv_cache_dtype"]),
    ("accepted", "HF sliding_window true", ["--model", "{hf_bool_window}"],
     ["sliding_window must be a positive integer or None, got True"]),
]


@pytest.fixture(scope="module")
def files3(files2) -> dict[str, Path]:
    root = next(iter(files2.values())).parent / "round3"
    root.mkdir()
    (root / "garbage_calibration.json").write_bytes(b"\x00\xffnot json")
    (root / "empty_calibration.json").write_text("{}")
    (root / "nan_calibration.json").write_text('{"page_sizes": {"2097152": {"map_s": NaN, "unmap_s": 1e-6}}}')
    (root / "hf_bool_window").mkdir()
    (root / "hf_bool_window" / "config.json").write_text(json.dumps({**HF_TINY, "model_type": "mistral",
                                                                     "sliding_window": True}))
    return {**files2, **{p.name: p for p in root.iterdir()}}


@pytest.mark.parametrize("category,case,argv,phrases", ROUND3_CLI_CASES, ids=_ids(ROUND3_CLI_CASES))
def test_round3_cli_rejects_with_one_line_before_any_work(category, case, argv, phrases, files3, capsys):
    rc = run_cli(cli_argv(argv, files3))
    out = capsys.readouterr()
    line = one_error_line(out.err)
    assert rc == 2, f"exit code {rc} for {case}: {line}"
    assert out.out == "", f"{case} printed to stdout: {out.out[:300]!r}"
    for phrase in phrases:
        assert phrase in line, f"{case}: {phrase!r} not in {line!r}"


ROUND3_API_CASES = [
    ("seed 2**70", lambda: SamplingParams(seed=2**70), RequestError, ["seed must be an integer in [0, "]),
    ("kv_cache_scale 1e-45 with fp8", lambda: make_config(kv_cache_dtype="fp8_e4m3", kv_cache_scale=1e-45),
     ConfigError, ["kv_cache_scale must be a finite number in [1e-06, 1000000]"]),
    ("kv_cache_scale nan with fp8", lambda: make_config(kv_cache_dtype="fp8_e5m2", kv_cache_scale=math.nan),
     ConfigError, ["kv_cache_scale must be a finite number", "got nan"]),
    ("kv_cache_scale with dtype auto", lambda: make_config(kv_cache_scale=0.25), ConfigError,
     ["applies only to an fp8 kv_cache_dtype"]),
]


@pytest.mark.parametrize("case,make,exc,phrases", ROUND3_API_CASES, ids=[c[0] for c in ROUND3_API_CASES])
def test_round3_api_raises_a_specific_error(case, make, exc, phrases):
    with pytest.raises(exc) as info:
        make()
    assert "\n" not in str(info.value)
    for phrase in phrases:
        assert phrase in str(info.value), f"{case}: {phrase!r} not in {str(info.value)!r}"


def test_round3_generate_with_an_int_for_sampling_params_is_a_request_error():
    llm = LLM(model="tiny", backend="paged", kv_cache_bytes=4 * 2**20)
    try:
        with pytest.raises(RequestError, match="sampling_params must be a SamplingParams, a list of them"):
            llm.generate("hi", 5)
        assert llm.generate("hi", SamplingParams(max_tokens=2))[0].outputs   # still usable
    finally:
        llm.close()


def test_round3_fp8_scale_in_range_is_accepted():
    assert make_config(kv_cache_dtype="fp8_e4m3", kv_cache_scale=0.05).kv_cache_scale == 0.05


def _limit_address_space() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))


@pytest.mark.parametrize("backend", ["paged", "reserve"])
def test_round3_kv_pool_beyond_ulimit_v_is_one_line(backend):
    """12 GiB under `ulimit -v 8G`: refused before torch allocates (it used to fail with an allocation traceback)."""
    proc = subprocess.run([sys.executable, "-m", "kvlab.experiments.cli.main", "generate", "--backend", backend,
                           "--kv-cache-bytes", "12GiB", "hi"], capture_output=True, text=True, timeout=300,
                          preexec_fn=_limit_address_space)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "under its address-space limit, ulimit -v" in one_error_line(proc.stderr)
