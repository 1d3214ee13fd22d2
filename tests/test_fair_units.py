"""Fair units by construction: by default every backend's unit holds as many tokens as a paged block in the bytes
one rank's cache is built with (KV dtype and tensor parallelism included), and bench's header states the caches
as built, for the backends that run."""
from __future__ import annotations

import json
import re

import pytest

from kvlab.common.kv.registry import fair_units, get_backend
from kvlab.experiments.cli.main import main

SPECS = [get_backend("paged"), get_backend("vmm")]


@pytest.mark.parametrize("token_bytes, block, page", [
    (512, 16, 8192),        # tiny, fp32: a 16-token block is two host pages
    (256, 16, 4096),        # tiny, fp32, TP 2: half the heads per rank
    (128, 32, 4096),        # tiny, fp8: a host page holds 32 tokens, so the block follows it to 32
    (3000, 16, 49152),      # a page rounded up to host pages still holds exactly 16 tokens
])
def test_fair_units_hold_the_same_tokens(token_bytes, block, page):
    units = fair_units(SPECS, 16, token_bytes)
    assert units == {"block_size": block, "page_size": page}
    assert units["page_size"] // token_bytes == units["block_size"]


BUILT = re.compile(r"^  (\w+): ([\d,]+) tokens.*? = ([\d,]+) \w+s x (\d+) tokens", re.M)


def header_units(text: str) -> dict[str, tuple[int, int, int]]:
    """backend -> (capacity tokens, units, tokens per unit) from bench's header."""
    n = lambda s: int(s.replace(",", ""))
    return {m[1]: (n(m[2]), n(m[3]), int(m[4])) for m in BUILT.finditer(text)}


# tp2 is slow (two ranks in processes, ~23 CPU s); fp8 keeps the header-equals-the-built-cache check in the default
# suite, and test_fair_units_hold_the_same_tokens the per-rank sizing with tensor parallelism.
@pytest.mark.parametrize("extra", [pytest.param(["--kv-cache-dtype", "fp8_e4m3"], id="fp8"),
                                   pytest.param(["--tensor-parallel-size", "2"], id="tp2", marks=pytest.mark.slow)])
def test_fp8_and_tp_ab_hold_equal_tokens_per_unit_and_the_header_is_the_built_cache(extra, tmp_path, capsys):
    rc = main(["bench", "--model", "tiny", "--backends", "vmm,paged", "--num-requests", "4", "--scale", "0.05",
               "--repeats", "1", "--warmup", "0", "--out", str(tmp_path), "--no-progress", *extra])
    assert rc == 0
    out = capsys.readouterr().out
    header = header_units(out)
    assert set(header) == {"vmm", "paged"} and "reserve" not in out.split("\n\n")[0]
    runs = {r["backend"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    for backend, (capacity, units, per_unit) in header.items():      # the engine's own cache, as it ran
        assert (units, per_unit) == (runs[backend]["total_units"], runs[backend]["tokens_per_unit"])
        assert capacity == units * per_unit
    assert header["vmm"] == header["paged"]
    assert runs["vmm"]["tokens_per_unit"] == runs["paged"]["tokens_per_unit"]
