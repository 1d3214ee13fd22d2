"""The docs' bench sample is replaced between its markers only, and says how it was made."""
import pytest

from kvlab.experiments.cli import regenerate_docs as rd


def test_only_the_marked_block_is_replaced():
    text = f"before\n{rd.BEGIN}\nold sample\n{rd.END}\nafter\n"
    block = rd.sample_block("kvlab bench: ...\nrow\nresults in results/x/ (...)\n", 61.0)
    out = rd.replace_between_markers(text, block, "README.md")
    assert out.startswith("before\n") and out.endswith("\nafter\n") and "old sample" not in out
    assert "kvlab bench: ..." in out and "results in" not in out and "`make docs`" in out
    assert rd.replace_between_markers(out, block, "README.md") == out      # idempotent


def test_missing_markers_fail_with_one_line():
    with pytest.raises(SystemExit, match="markers"):
        rd.replace_between_markers("no markers here", "x", "README.md")


def test_docs_carry_the_markers_and_every_image_exists():
    for doc in rd.DOCS:
        text = doc.read_text()
        assert text.count(rd.BEGIN) == 1 and text.count(rd.END) == 1, doc
    for _, _, image in rd.IMAGES:
        assert (rd.IMG / image).is_file(), image
