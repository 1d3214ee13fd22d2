"""Stand-ins for GPU-only libraries (flash-attn, FlashInfer) that enforce the real call contracts and compute
reference attention on any device; tests install them with `install_fake(monkeypatch, name)`."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FAKES = {"flash_attn": "flash_attn.py", "flashinfer": "flashinfer.py"}


def install_fake(monkeypatch, name: str) -> ModuleType:
    """Load a fresh copy of the fake (empty `calls`) and make `import name` return it for this test."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(FAKES[name]))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, name, module)
    return module
