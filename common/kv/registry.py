"""Backends register themselves: each backend package declares one `BackendSpec` in its `spec` module, and
this registry finds them by name, importing lazily. `common` never imports a backend; adding one means one
package and one `register_backend` call (or a line in BUILTIN for the ones kvlab ships)."""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.common.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvlab.common.config import EngineConfig
    from kvlab.common.kv.seam import KVCache
    from kvlab.common.kv.types import KVShape
    from kvlab.common.sequence import Sequence

# The backends kvlab ships: name -> module declaring SPEC (spec modules import nothing heavy).
BUILTIN = {"paged": "kvlab.paged.spec", "vmm": "kvlab.vmm.spec", "reserve": "kvlab.common.reserve.spec"}


class BackendProbe(Protocol):
    """What the invariant tests need to look inside a backend, through public state only."""

    test_options: dict[str, Any]          # flat config keys giving a tiny cache for the state machines

    def read(self, cache: KVCache, seq: Sequence, n: int) -> torch.Tensor:
        """K/V of the first n positions as stored, [L, 2, n, H_kv, D], by a second read path."""

    def check_structure(self, cache: KVCache, live: dict[int, Sequence], swapped: set[int],
                        may_share: Callable[[int, int, int], bool]) -> None:
        """Backend-specific structural invariants; may_share(seq_a, seq_b, unit_index) says whether two
        sequences may legitimately share a unit."""

    def check_drained(self, cache: KVCache) -> None: ...

    def window_units(self, cache: KVCache) -> dict[int, tuple[int, list[int]]]:
        """(window_trim backends) per live sequence: how many leading units the sliding window dropped, and the
        ids of the units it still holds."""

    def check_closed(self, cache: KVCache) -> None: ...


@dataclass(frozen=True)
class BackendSpec:
    name: str                                  # `backend` in config, and the name of its TOML table
    unit: str                                  # the allocation unit in reports: block, page group, token
    layout: str                                # the attention layout its storage hands kernels: paged | contiguous
    options: type                              # dataclass of its options: [name] table, flat keys, CLI flags
    build: Callable[[EngineConfig, KVShape, bool], KVCache]   # (config, shape, accounting_only) -> KVCache
    label: Callable[[Any], str]                # options -> a short label for reports ("paged-16", "vmm-64KiB")
    probe: str                                 # "module:attribute" of its BackendProbe (tests only)
    watermark: bool = True                     # whether the admission watermark applies to it
    window_trim: bool = False                  # frees units wholly below a sliding window (its probe: window_units)
    help: str = ""                             # one line for --help and the README

    def default_options(self) -> Any:
        return self.options()

    def load_probe(self) -> BackendProbe:
        module, attr = self.probe.split(":")
        return getattr(importlib.import_module(module), attr)

    def kernels(self) -> list[str]:
        """The attention kernels declared for its layout (whether they can run here is the dispatcher's call)."""
        from kvlab.common.attention.declarations import REGISTRY
        return [d.name for d in REGISTRY if d.layout == self.layout]


class Registry:
    """Name -> BackendSpec; built-in specs are imported on first use."""

    def __init__(self, builtin: dict[str, str]) -> None:
        self._modules = dict(builtin)
        self._specs: dict[str, BackendSpec] = {}

    def register(self, spec: BackendSpec) -> BackendSpec:
        if spec.name in self.names() and self._specs.get(spec.name) is not spec:
            raise ConfigError(f"a backend named {spec.name!r} is already registered")
        self._specs[spec.name] = spec
        return spec

    def unregister(self, name: str) -> None:
        self._specs.pop(name, None)
        self._modules.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*self._modules, *self._specs]))

    def get(self, name: str) -> BackendSpec:
        if name not in self._specs:
            if name not in self._modules:
                raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(self.names())}")
            self._specs[name] = importlib.import_module(self._modules[name]).SPEC
        return self._specs[name]

    def specs(self) -> list[BackendSpec]:
        return [self.get(name) for name in self.names()]

    def option_owner(self) -> dict[str, str]:
        """Flat option key -> the backend whose options declare it (keys are unique across backends)."""
        owner: dict[str, str] = {}
        for spec in self.specs():
            for f in dataclasses.fields(spec.options):
                owner.setdefault(f.name, spec.name)
        return owner


REGISTRY = Registry(BUILTIN)     # filled at import, as the habits allow: one registry per process

register_backend = REGISTRY.register
get_backend = REGISTRY.get
backend_names = REGISTRY.names
