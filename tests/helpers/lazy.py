"""A dev dependency imported at its first use in a test, not when pytest collects the module: transformers and
openai take seconds to import and most test modules that name them use them in a few tests only. Missing, the
first use skips that test, as pytest.importorskip at module level would have skipped the module's tests."""
from __future__ import annotations

from typing import Any

import pytest


class LazyImport:
    """Stands for a module; `obj.attr` imports it (pytest.importorskip) and returns the module's attribute.
    Names starting with an underscore are not forwarded: pytest looks for its own markers on every module global
    while collecting, and that look must neither import the module nor skip anything."""

    def __init__(self, name: str, reason: str | None = None) -> None:
        self._name, self._reason = name, reason

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(pytest.importorskip(self._name, reason=self._reason), attr)
