"""Backends register themselves: each backend package declares one `BackendSpec` in its `spec` module, and
this registry finds them by name, importing lazily. `common` never imports a backend. A backend is found three
ways, all ending in the same `load_spec`: kvlab's own (BUILTIN), an installed package's entry point in the group
`kvlab.backends` (`name = "module"` declaring SPEC, or `"module:attribute"`), or a `register_backend(SPEC)` call."""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Protocol

from kvlab.common.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvlab.common.kv.types import KVShape
    from kvlab.common.sequence import Sequence

# common/kv/seam.py's KVCache and CacheConfig, named here as types only: the seam reaches the attention code, which
# asks this registry for the backends' kernels (common/attention/declarations.py), so importing the seam here, even
# for type checking, would close a loop
KVCache = CacheConfig = Any

ENTRY_POINTS = "kvlab.backends"    # the entry-point group through which installed packages offer backends
# The backends kvlab ships: name -> module declaring SPEC (spec modules import nothing heavy).
BUILTIN = {"paged": "kvlab.paged.spec", "vmm": "kvlab.vmm.spec", "reserve": "kvlab.reserve.spec",
           "elastic": "kvlab.elastic.spec"}


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
    build: Callable[[CacheConfig, KVShape, bool], KVCache]    # (config, shape, accounting_only) -> KVCache
    label: Callable[[Any], str]                # options -> a short label for reports ("paged-16", "vmm-64KiB")
    probe: str                                 # "module:attribute" of its BackendProbe (tests only)
    watermark: bool = True                     # whether the admission watermark applies to it
    window_trim: bool = False                  # frees units wholly below a sliding window (its probe: window_units)
    pool: bool = False                         # maps pages on demand, so may draw them from a machine-wide pool
                                               # (EngineConfig.kv_pool); its build reads kv_pool itself
    help: str = ""                             # one line for --help and the README
    unit_option: str = ""                      # the options field setting tokens per unit; "": <unit>_size if any
    unit_multiple: int = 1                     # that field's values are multiples of this (vmm: the host page)
    handoff: str = ""                          # "module:attribute" of its KV handoff factory (common/handoff/)
    kernels: str = ""                          # "module:function" declaring its own attention kernels (env -> list)

    def default_options(self) -> Any:
        return self.options()

    def unit_field(self) -> dataclasses.Field | None:
        """The options field that sets how many tokens a unit holds (`unit_option`, else the one named after the
        unit: block_size, page_size); None when the unit is fixed (reserve's token)."""
        name = self.unit_option or f"{self.unit.split()[0]}_size"
        return next((f for f in dataclasses.fields(self.options) if f.name == name), None)

    def unit_flag(self) -> str | None:
        """The CLI flag of `unit_field` (--block-size), as generated from the options dataclass."""
        field = self.unit_field()
        return None if field is None else "--" + field.name.replace("_", "-")

    def unit_value(self, tokens: int, token_bytes: int) -> int | None:
        """The unit field's value for units of `tokens` tokens, one token of one layer's K or V taking `token_bytes`
        as built (KV dtype, this rank's heads); a field in bytes rounds up to `unit_multiple`. None: fixed unit."""
        field = self.unit_field()
        if field is None:
            return None
        size = tokens * token_bytes if field.metadata.get("bytes") else tokens
        return -(-size // self.unit_multiple) * self.unit_multiple

    def unit_tokens(self, value: int, token_bytes: int) -> int:
        """Tokens one unit holds when its field is `value` (the inverse of unit_value, rounding down)."""
        field = self.unit_field()
        return value // token_bytes if field is not None and field.metadata.get("bytes") else value

    def load_probe(self) -> BackendProbe:
        module, attr = self.probe.split(":")
        return getattr(importlib.import_module(module), attr)


def fair_units(specs: Iterable[BackendSpec], tokens: int, token_bytes: int) -> dict[str, int]:
    """Unit field name -> value such that every spec's unit holds the same tokens: the least count >= `tokens`
    each of them holds exactly (4 KiB pages of 128 B tokens hold 32, so the blocks hold 32 too)."""
    sized = [s for s in specs if s.unit_field() is not None]
    held = lambda s, t: s.unit_tokens(s.unit_value(t, token_bytes), token_bytes)
    while any(held(s, tokens) != tokens for s in sized):
        tokens += 1
    return {s.unit_field().name: s.unit_value(tokens, token_bytes) for s in sized}


def load_spec(entry: EntryPoint) -> BackendSpec:
    """The spec an entry point names: a module declaring SPEC, or "module:attribute" (the spec itself)."""
    try:
        target = entry.load()
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"backend entry point {entry.name} = {entry.value!r} does not load: {e}") from None
    spec = target if isinstance(target, BackendSpec) else getattr(target, "SPEC", None)
    if not isinstance(spec, BackendSpec):
        raise ConfigError(f"backend entry point {entry.name} = {entry.value!r} names no BackendSpec")
    if spec.name != entry.name:
        raise ConfigError(f"backend entry point {entry.name} = {entry.value!r} declares a backend named {spec.name!r}")
    return spec


def installed_entry_points() -> Iterable[EntryPoint]:
    return entry_points(group=ENTRY_POINTS)


class Registry:
    """Name -> BackendSpec. Specs named by an entry point (kvlab's own, then the installed ones, looked up on
    first use) are imported on first use; a name already taken keeps its first owner."""

    def __init__(self, builtin: dict[str, str],
                 find_installed: Callable[[], Iterable[EntryPoint]] = installed_entry_points) -> None:
        self._entries = {name: EntryPoint(name, module, ENTRY_POINTS) for name, module in builtin.items()}
        self._find_installed: Callable[[], Iterable[EntryPoint]] | None = find_installed
        self._specs: dict[str, BackendSpec] = {}

    def discover(self, entries: Iterable[EntryPoint]) -> None:
        """Offer backends by entry point (the installed ones come this way); each loads when first asked for."""
        for entry in entries:
            self._entries.setdefault(entry.name, entry)

    def _entry_points(self) -> dict[str, EntryPoint]:
        if self._find_installed is not None:     # once, on first use: importing the registry reads no metadata
            find, self._find_installed = self._find_installed, None
            self.discover(find())
        return self._entries

    def register(self, spec: BackendSpec) -> BackendSpec:
        if spec.name in self.names() and self._specs.get(spec.name) is not spec:
            raise ConfigError(f"a backend named {spec.name!r} is already registered")
        self._specs[spec.name] = spec
        return spec

    def unregister(self, name: str) -> None:
        self._specs.pop(name, None)
        self._entry_points().pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*self._entry_points(), *self._specs]))

    def get(self, name: str) -> BackendSpec:
        if name not in self._specs:
            entries = self._entry_points()
            if name not in entries:
                raise ConfigError(f"unknown backend {name!r}; choose one of: {', '.join(self.names())}")
            self._specs[name] = load_spec(entries[name])
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
