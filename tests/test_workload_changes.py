"""A user's workload is never transformed unless asked, and every transformation is named in the header."""
from kvlab.experiments.bench.plan import DEFAULT_SCALE, default_scale
from kvlab.experiments.reporting.tables import workload_changes
from kvlab.experiments.workloads.requests import WorkloadSpec, parse_workload


def test_scale_defaults_only_for_the_builtin_seed_distribution(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 300, "output_len": 40}\n')
    assert default_scale(parse_workload("seed"), None) == DEFAULT_SCALE
    assert default_scale(parse_workload(f"trace:{trace}"), None) == 1.0
    assert default_scale(parse_workload("fixed:100:20"), None) == 1.0
    assert default_scale(parse_workload(f"trace:{trace}"), 0.5) == 0.5


def test_trace_as_given_reports_no_change(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 300, "output_len": 40}\n' * 3)
    spec = WorkloadSpec(kind="trace", trace=str(trace), num_requests=3)
    assert workload_changes(spec, scale_given=False) == []


def test_every_transformation_is_named(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 300, "output_len": 40}\n' * 5)
    spec = WorkloadSpec(kind="trace", trace=str(trace), num_requests=2, scale=0.5)
    changes = workload_changes(spec, scale_given=True)
    assert any("x0.5 (--scale)" in c for c in changes)
    assert any("first 2 of the trace's 5" in c for c in changes)
    seed = workload_changes(WorkloadSpec(kind="seed", scale=0.125, max_len=4096), scale_given=False)
    assert any("default for seed" in c for c in seed) and any("<= 512" in c for c in seed)


def test_metrics_to_dict_leaves_the_timeline_out_unless_asked():
    from kvlab.common.metrics import RunMetrics
    m = RunMetrics(backend="paged", timeline={"time": [0.0, 1.0], "running": [1, 2]})
    assert "timeline" not in m.to_dict()
    assert m.to_dict(timeline=True)["timeline"]["running"] == [1, 2]
