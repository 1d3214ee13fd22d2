"""Where nothing is displaced, --measure still times the chosen kernel against every other that runs, in words."""
from kvlab.experiments.studies.fallbacks import timing
from kvlab.experiments.studies.fallbacks.grid import Row


def _row(kernel: str) -> Row:
    return Row(scenario="cpu", device="cpu", compute_capability=None, packages=[], backend="paged", layout="paged",
               phase="decode", head_dim=64, dtype="float32", block_size=16, gqa_ratio=4, num_q_heads=8,
               num_kv_heads=2, kernel=kernel, kernel_head_dim=64, preferred=kernel, fallback=False, displaced=[])


def _timing(kernel: str, ms: float) -> dict:
    return {"kernel": kernel, "layout": "paged", "phase": "decode", "head_dim": 64, "dtype": "float32",
            "batch": 1, "context": 40, "query": 1, "median_ms": ms}


def test_chosen_is_compared_with_every_kernel_that_ran():
    timings = [_timing("torch_paged", 0.2), _timing("triton_paged", 100.0), _timing("flex_paged", 0.21)]
    comparisons = timing.chosen_against_others(timings, [_row("torch_paged")], "cpu")
    lines = [timing.comparison_line(c) for c in comparisons]
    assert len(lines) == 2
    assert "the chosen torch_paged is faster, x500" in lines[0]
    assert "about as fast as each other" in lines[1]
    faster = timing.chosen_against_others([_timing("torch_paged", 2.0), _timing("flex_paged", 1.0)],
                                          [_row("torch_paged")], "cpu")
    assert "flex_paged is faster than the chosen torch_paged, x2.00" in timing.comparison_line(faster[0])


def test_no_instruction_to_set_what_kvlab_sets(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delitem(__import__("sys").modules, "kvlab.paged.kernels.triton_paged", raising=False)
    assert timing.enable_triton_interpreter("cpu") is None
