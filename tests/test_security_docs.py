"""docs/security.md's claims each name a test: every test it names exists in tests/test_security_*.py, and each of
those files' tests is named there (a claim without a test, or a test without its claim, fails here)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_claim_names_an_existing_test_and_every_test_backs_a_claim():
    named = set(re.findall(r"`(test_[a-z0-9_]+)`", (ROOT / "docs/security.md").read_text()))
    defined = {name for path in ROOT.glob("tests/test_security_*.py") if path.name != Path(__file__).name
               for name in re.findall(r"^def (test_[a-z0-9_]+)", path.read_text(), re.M)}
    assert named and named <= defined, sorted(named - defined)
    assert defined <= named, sorted(defined - named)
