import json

import pytest

from kvlab.common.config import make_config
from kvlab.common.errors import ConfigError
from kvlab.common.kv.registry import get_backend
from kvlab.common.kv.seam import create_cache
from kvlab.common.metrics import RunMetrics
from kvlab.common.sequence import Sequence
from kvlab.experiments.cli.main import main
from kvlab.experiments.sim.core import OLD_KEYS, SimCase, SimSettings, held_capacity, run_cases
from kvlab.experiments.sim.roofline import model_spec
from kvlab.experiments.sim.worked_example import worked_example
from kvlab.experiments.workloads.requests import WorkloadSpec

# A reduced seed run: 300 requests in a 6 GB budget (reserve holds 11 sequences, paging ~40).
SMALL = SimSettings(workload=WorkloadSpec(num_requests=300, seed=0))


@pytest.fixture(scope="module")
def small_rows():
    cases = [SimCase("reserve", 6.0), SimCase("oracle", 6.0), SimCase("paged", 6.0, 16, watermark=0.05),
             SimCase("paged", 6.0, 128), SimCase("paged", 6.0, 16)]
    return dict(zip(["reserve", "oracle", "paged", "paged128", "paged16wm0"], run_cases(cases, SMALL, progress=False)))


def test_paging_doubles_the_batch_but_not_the_throughput(small_rows):
    r, o, p = small_rows["reserve"], small_rows["oracle"], small_rows["paged"]
    assert r.output_tokens == p.output_tokens == o.output_tokens and r.num_failed == 0
    assert r.mean_batch < o.mean_batch < p.mean_batch
    batch_gain = p.mean_batch / r.mean_batch
    tput_gain = p.output_tokens_per_s / r.output_tokens_per_s
    assert batch_gain > 1.5
    assert 1.0 < tput_gain < batch_gain          # the KV term of the step grows with the batch
    assert r.kv_utilization < 0.5
    assert p.kv_utilization > 0.95
    assert r.max_batch <= 11                      # 6e9 / (4096 x 131,072) = 11.2 reservations


def test_old_attribute_names_read_the_record(small_rows):
    r = small_rows["paged16wm0"]
    assert (r.steps, r.utilization, r.recompute_tokens, r.failed_requests) == \
        (r.num_steps, r.kv_utilization, r.recomputed_tokens, r.num_failed)
    assert not hasattr(r, "no_such_figure")


def test_the_case_asks_the_registered_spec_for_its_label():
    slab = get_backend("slab")                     # registered by tests/conftest.py only
    assert SimCase("slab", 1.0).label == slab.label(slab.default_options()) != "oracle"
    assert SimCase("vmm", 1.0, page_size=64 * 1024).label == "vmm-64KiB"
    assert SimCase("oracle", 1.0).label == "oracle" and SimCase("reserve", 1.0).label == "reserve-max"
    with pytest.raises(ConfigError, match="no option block_size"):
        SimCase("reserve", 1.0, 16).backend_options()


def test_end_of_sequence_waste_is_about_half_a_block(small_rows):
    for key, b in (("paged16wm0", 16), ("paged128", 128)):
        assert small_rows[key].mean_waste_tokens == pytest.approx((b - 1) / 2, rel=0.2)
    assert small_rows["oracle"].mean_waste_tokens == pytest.approx(1.0)   # the last sampled token is never cached
    assert small_rows["reserve"].mean_waste_tokens > 2000


def test_watermark_trades_preemptions_for_batch(small_rows):
    none, five = small_rows["paged16wm0"], small_rows["paged"]
    assert none.preemptions > five.preemptions
    assert none.recomputed_tokens > 0 and none.recompute_seconds > 0
    assert five.mean_batch <= none.mean_batch


def test_worked_example_matches_the_article_exactly():
    figures = {f.name: f for f in worked_example()}
    assert all(f.matches for f in figures.values()), [f for f in figures.values() if not f.matches]
    assert figures["paged b=16: blocks"].ours == 108
    assert figures["paged b=16: slots"].ours == 1728
    assert figures["reserve: slots for 3 sequences"].ours == 12288
    assert figures["reserve: sequences in 60 GB"].ours == 111
    assert round(figures["paged b=16: utilisation"].ours, 3) == 0.978
    assert round(figures["reserve: utilisation (1,690 live tokens)"].ours, 3) == 0.138


@pytest.mark.parametrize("backend, extra, expect", [
    ("paged", {"block_size": 16}, 48), ("reserve", {}, 4096), ("vmm", {"page_size": 64 * 1024}, 64)])
def test_held_capacity_uses_the_backend_accounting(backend, extra, expect):
    config = make_config(backend=backend, kv_cache_bytes=10**9, max_model_len=4096, dtype="bfloat16", **extra)
    cache = create_cache(config, model_spec("llama3-8b").kv_shape(), accounting_only=True).allocator
    seq = Sequence(0, "a", [1] * 40, max_tokens=4)
    cache.allocate(seq, 40)
    assert held_capacity(cache, seq, 40, 4096) == expect


def test_cli_writes_json_rows_with_the_required_keys(tmp_path, capsys):
    path = tmp_path / "rows.json"
    rc = main(["simulate", "--policies", "reserve,paged,vmm", "--num-requests", "60", "--budget-gb", "2",
               "--jobs", "1", "--no-progress", "--json", str(path)])
    assert rc == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["reserve", "paged", "vmm"]
    from helpers.provenance_check import check_provenance
    assert check_provenance(json.loads(path.read_text())["provenance"], "simulate")["budget_gb"] == 2
    for r in rows:
        for key in ("policy", "budget_gb", "block_size", "page_size", "watermark", "mean_batch", "utilization",
                    "output_tokens_per_s", "preemptions", "recompute_tokens", "mean_waste_tokens"):
            assert key in r
        assert 0 < r["utilization"] <= 1
        assert {k for k in RunMetrics.__dataclass_fields__ if k != "timeline"} <= set(r)   # the run record's names
        assert all(r[old] == r[new] for old, new in OLD_KEYS.items())                     # old keys as aliases
    assert rows[1]["block_size"] == 16 and rows[2]["page_size"] == 2 * 2**20
    assert "paged-16" in capsys.readouterr().out


def test_plain_simulate_runs_vmm_in_each_layout_and_charges_the_penalty_when_asked(tmp_path, capsys):
    """--vmm-layout per-layer,cross-layer: two vmm rows; the cross-layer one strands L times less at the end of a
    sequence; --layout-penalty kvcached slows only the cross-layer row's attention."""
    def rows(*extra):
        path = tmp_path / "rows.json"
        rc = main(["simulate", "--policies", "paged,vmm", "--vmm-layout", "per-layer,cross-layer",
                   "--num-requests", "60", "--budget-gb", "2", "--kernel-costs", "central", "--jobs", "1",
                   "--no-progress", "--json", str(path), *extra])
        assert rc == 0
        return {r["label"]: r for r in json.loads(path.read_text())["rows"]}
    plain, penalised = rows(), rows("--layout-penalty", "kvcached")
    assert list(plain) == ["paged-16", "vmm-2MiB", "vmm-2MiB-crosslayer"]
    assert plain["vmm-2MiB-crosslayer"]["mean_waste_tokens"] < plain["vmm-2MiB"]["mean_waste_tokens"] / 4
    assert penalised["vmm-2MiB"]["output_tokens_per_s"] == plain["vmm-2MiB"]["output_tokens_per_s"]
    assert penalised["vmm-2MiB-crosslayer"]["output_tokens_per_s"] < plain["vmm-2MiB-crosslayer"]["output_tokens_per_s"]
    assert "cross-layer attention penalty kvcached" in capsys.readouterr().out
    assert main(["simulate", "--vmm-layout", "diagonal", "--no-save"]) != 0
    assert capsys.readouterr().err.strip() == ("kvlab simulate: error: unknown vmm layout 'diagonal'; choose one of: "
                                               "per-layer, cross-layer")


@pytest.mark.slow
def test_seed_preset_reproduces_the_article_headlines(tmp_path):
    from kvlab.experiments.sim import seed_article
    settings = SimSettings(workload=WorkloadSpec(num_requests=2000, seed=0))
    cases = seed_article.cases()
    rows = run_cases(cases, settings, jobs=2, progress=False)
    by_key = {c.key: r for c, r in zip(cases, rows)}
    ratios = seed_article.ratios(by_key)
    assert ratios["batch_60"] == pytest.approx(1.88, rel=0.05)
    assert ratios["tput_60"] == pytest.approx(1.36, rel=0.05)
    assert ratios["tput_20"] == pytest.approx(1.81, rel=0.05)
    assert by_key[seed_article.key("paged", 60.0, 512)].kv_utilization == pytest.approx(0.87, abs=0.02)
    for b in seed_article.BLOCK_SIZES:
        assert by_key[seed_article.key("paged", 60.0, b)].mean_waste_tokens == pytest.approx((b - 1) / 2, rel=0.1)
    pre = [by_key[seed_article.key("paged", 60.0, 16, watermark=w)].preemptions for w in seed_article.WATERMARKS]
    assert 150 < pre[0] < 350 and 5 < pre[1] < 40 and pre[2] == 0


def test_fp8_preset_writes_rows_plot_and_provenance_of_each_variant(tmp_path):
    rc = main(["simulate", "--preset", "fp8", "--num-requests", "12", "--jobs", "1", "--no-progress",
               "--out", str(tmp_path)])
    assert rc == 0
    assert {p.name for p in tmp_path.iterdir()} == {"report.txt", "rows.json", "batch.png", "provenance.json"}
    written = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["variant"], r["policy"]) for r in written["rows"]][:2] == [("auto", "reserve"), ("auto", "oracle")]
    assert {r["variant"] for r in written["rows"]} == {"auto", "fp8_e4m3"}
    variants = written["provenance"]["config"]["variants"]
    assert variants["fp8_e4m3"]["engine"]["kv_cache_dtype"] == "fp8_e4m3"


def test_window_preset_names_its_own_workload_and_cuts_nothing():
    from kvlab.experiments.sim import kv_presets
    from kvlab.experiments.workloads.requests import build_workload
    workload = kv_presets.window_variants(SimSettings(workload=WorkloadSpec()))["mistral-7b"].workload
    requests = build_workload(workload)
    assert len(requests) == kv_presets.WINDOW_REQUESTS and workload.max_len == kv_presets.WINDOW_MAX_LEN
    assert max(r.prompt_len + r.output_len for r in requests) <= kv_presets.WINDOW_MAX_LEN
    assert min(r.prompt_len for r in requests) >= 16384                # drawn from 16K-28K, never cut below it
    assert kv_presets.WINDOW_CHANGES.startswith("workload changes: none") and "cut" not in kv_presets.WINDOW_CHANGES
