"""Settings that cap the batch or waste most of the cache are named, with the fix, by one function."""
from kvlab.common.capacity import capacity_warnings, warn_capacity
from kvlab.common.config import make_config
from kvlab.common.kv.types import CacheStats


def stats(unit: str, tpu: int, units: int) -> CacheStats:
    return CacheStats(backend="x", unit_name=unit, tokens_per_unit=tpu, total_units=units, used_units=0,
                      free_units=units)


def test_one_huge_page_group_is_two_warnings_with_fixes():
    config = make_config(backend="vmm", page_size=2 << 20, max_model_len=512, max_num_seqs=256,
                         kv_cache_bytes=16 << 20)
    lines = capacity_warnings(config, stats("page", 4096, 1))
    assert len(lines) == 2
    assert "at most 1 sequence(s) run at once" in lines[0] and "smaller --page-size" in lines[0]
    assert "88% of every page stays empty" in lines[1] and "--page-size of at most 262,144 bytes" in lines[1]


def test_a_sensible_cache_is_silent():
    config = make_config(backend="paged", max_model_len=512, max_num_seqs=256, kv_cache_bytes=16 << 20)
    assert capacity_warnings(config, stats("block", 16, 256)) == []


def test_reservations_count_whole_lengths_and_short_budgets_are_named():
    config = make_config(backend="reserve", max_model_len=1024, max_num_seqs=64, kv_cache_bytes=4 << 20)
    lines = capacity_warnings(config, stats("token", 1, 2048), holds_final_length=True)
    assert any("at most 2 sequence(s)" in x and "--kv-cache-bytes" in x for x in lines)
    small = capacity_warnings(config, stats("block", 16, 32))
    assert any("less than max_model_len 1,024" in x for x in small)


def test_llm_construction_warns(caplog):
    from kvlab.common.llm import LLM
    llm = LLM(model="tiny", backend="paged", block_size=16, kv_cache_bytes=1 << 20, max_model_len=1024)
    try:
        assert any("at most" in r.getMessage() or "less than" in r.getMessage() for r in caplog.records)
        assert warn_capacity(llm.config, llm.engine.cache)
    finally:
        llm.close()
