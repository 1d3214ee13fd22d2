"""The README's documentation index lists every file in docs/, and each link resolves."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def index_block() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("<!-- docs-index", 1)[1].split("<!-- /docs-index -->", 1)[0]


def test_the_index_lists_every_doc_and_only_docs_that_exist():
    linked = set(re.findall(r"\]\((docs/[^)]+\.md)\)", index_block()))
    present = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert linked == present, (sorted(present - linked), sorted(linked - present))


def test_the_answer_comes_first():
    readme = (ROOT / "README.md").read_text()
    head = "\n".join(readme.splitlines()[:40])
    assert "## What kvlab concludes today" in head and "<!-- verdict -->" in head
    assert "No GPU run yet" in readme.split("## Set up", 1)[0]
    assert readme.index("## Set up: two commands") < readme.index("## The first hour: four commands") < \
        readme.index("## Documentation")
