"""`kvlab compare RUN_A RUN_B`: the configuration that differs first, then figure by figure with its spread."""
from __future__ import annotations

import pytest

from kvlab.experiments.cli.main import main
from kvlab.experiments.compare.diff import differences, figure


def bench(out, page_size: str) -> None:
    assert main(["bench", "--model", "tiny", "--backends", "vmm,paged", "--num-requests", "4", "--scale", "0.05",
                 "--repeats", "1", "--warmup", "0", "--page-size", page_size, "--out", str(out),
                 "--no-progress"]) == 0


def test_compare_names_the_page_size_first(tmp_path, capsys):
    bench(tmp_path / "a", "8KiB")
    bench(tmp_path / "b", "16KiB")
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b" / "results.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    start, machine = lines.index("configuration differs (A -> B):"), lines.index("software and machine: the same")
    assert lines[start + 1] == "  engine.vmm.vmm.page_size: 8,192 -> 16,384", lines
    consequences = lines[start + 2:machine]          # the vmm cache as built from it, nothing else
    assert consequences and all(ln.startswith("  built.vmm.") for ln in consequences), consequences
    assert lines.index("figures (A -> B):") > machine


def test_compare_refuses_what_it_cannot_read(tmp_path, capsys):
    (tmp_path / "old.json").write_text('{"rows": []}')
    assert main(["compare", str(tmp_path / "none"), str(tmp_path / "old.json")]) == 2
    assert "no such results directory or file" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "old.json"), str(tmp_path / "old.json")]) == 2
    assert "records no provenance" in capsys.readouterr().err


@pytest.mark.parametrize("a, b, expect", [
    ([10.0, 12.0, 11.0], [11.5, 13.0, 12.5], "no significant difference"),
    ([10.0, 11.0, 10.5], [20.0, 21.0, 22.0], "10.500 -> 21.000 (+100.0%"),
    ([5], [6], "5 -> 6 (+20.0%; one value each, no spread)"),
])
def test_a_figure_is_called_different_only_when_the_repeats_are_disjoint(a, b, expect):
    assert expect in figure("x", a, b, show_equal=False)


def test_differences_name_nested_settings_by_path_and_a_missing_table_once():
    a = {"engine": {"vmm": {"page_size": 1, "seed": 0}, "reserve": {"x": 1, "y": 2}}, "seed": 0}
    b = {"engine": {"vmm": {"page_size": 2, "seed": 0}}, "seed": 0}
    assert [(path, va) for path, va, _ in differences(a, b)] == [("engine.vmm.page_size", 1),
                                                                ("engine.reserve", {"x": 1, "y": 2})]
