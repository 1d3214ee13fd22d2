"""What a pool A/B was asked for: the configurations compared, the memory they share, the load, the repeats."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.experiments.loadgen.multi import MultiSpec


@dataclass(frozen=True, slots=True)
class Configuration:
    """One way to give N servers the same memory: one shared pool (vmm or elastic engines) or a static equal
    split."""
    key: str
    backend: str
    pooled: bool

    @property
    def label(self) -> str:
        return f"({self.key}) {self.backend} {'shared pool' if self.pooled else 'static split'}"

    def server_args(self, total_bytes: int, engines: int, pool: str) -> list[list[str]]:
        """Each server's `kvlab serve` flags. A pooled server may grow to the whole pool (its address space and
        its scheduler's capacity are the total; the pool decides what memory it holds); a static one owns 1/N."""
        if self.pooled:
            own = ["--kv-cache-bytes", str(total_bytes), "--kv-pool", pool, "--kv-pool-bytes", str(total_bytes)]
        else:
            own = ["--kv-cache-bytes", str(total_bytes // engines)]
        return [["--backend", self.backend, *own] for _ in range(engines)]


CONFIGURATIONS = {c.key: c for c in (Configuration("a", "vmm", True), Configuration("b", "paged", False),
                                     Configuration("c", "vmm", False), Configuration("d", "reserve", False),
                                     Configuration("e", "elastic", True))}
BASELINE = "a"


@dataclass(frozen=True, slots=True)
class PoolStudySettings:
    multi: MultiSpec                      # the phases (models = engines) and the prompts, SLOs and percentiles
    total_bytes: int                      # the KV memory every configuration shares out
    configurations: tuple[Configuration, ...]
    repeats: int = 3
    model: str = "tiny"
    server_args: tuple[str, ...] = ()     # extra `kvlab serve` flags for every server
    start_timeout_s: float = 120.0
    out: str | None = None
    progress: bool = True

    @property
    def engines(self) -> int:
        return self.multi.phases.models

    def order(self, repeat: int) -> tuple[Configuration, ...]:
        """Even repeats in the given order, odd ones reversed: a drift over time hits every configuration alike."""
        return self.configurations if repeat % 2 == 0 else self.configurations[::-1]
