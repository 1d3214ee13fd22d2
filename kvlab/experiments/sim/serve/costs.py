"""Driver costs on the simulated clock: per-operation latencies per device profile, charged in the step that
issues them, or hidden behind that step's compute when background mapping overlaps them (vAttention).

vmm: a step's cost is pages mapped x (cuMemMap) + access grants x (cuMemSetAccess) + pages unmapped x
(cuMemUnmap), from the counters the driver already keeps (kvlab's CUDA driver creates every physical page up front,
so cuMemCreate is a start-up cost, reported apart). Access grants are one per page mapped (`per-page`, the
default: vAttention's code calls cuMemSetAccess after each page's cuMemMap) or one per mapped run of pages
(`per-run`, what kvlab's own driver does: a labelled variant). Background mapping (vAttention's `step_async`:
maps ahead on a worker thread, reclaims lazily) hides driver time behind the step's compute; it is on by default
in `simulate serve`, and the no-overlap case is the labelled variant `--no-background-mapping`.
paged: one block-table upload per step (latency + table bytes over the host-to-device link) and the gather's extra
KV reads as a fraction of the step's KV read time. Published figures: kvcached, ovg-project/kvcached
benchmarks/bench_vmm/README.md (A100, 2 MiB pages): cuMemCreate 193 us, cuMemMap 1.45 us, cuMemSetAccess 36 us,
cuMemUnmap 25.6 us. They are figures for 2 MiB pages: stock CUDA creates no smaller page, so applied per page below
2 MiB they are an extrapolation, and every table that uses them there says so (`extrapolation_note`). See
docs/simulator-serving.md.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from kvlab.common.errors import ConfigError
from kvlab.common.validate import check_number, shown
from kvlab.experiments.sim.serve.measured_driver import at_size, is_measured, measured_figures

KVCACHED_SOURCE = "ovg-project/kvcached benchmarks/bench_vmm/README.md (A100, 2 MiB pages)"
DEFAULT_CALIBRATION = Path("results") / "calibrate" / "host.json"
SET_ACCESS = ("per-page", "per-run")      # cuMemSetAccess granularity: the first is the default
MEASURED_PAGE = 2 * 2**20                 # the page size the published per-call figures were measured at


@dataclass(frozen=True, slots=True)
class DriverProfile:
    name: str
    source: str = ""
    create_s: float = 0.0            # per physical page, at start-up
    map_s: float = 0.0               # per page mapped
    set_access_s: float = 0.0        # per access grant (one per page, or one per mapped run: CostLedger)
    unmap_s: float = 0.0             # per page unmapped
    table_latency_s: float = 0.0     # paged: per step, one block-table upload
    table_bytes_per_s: float = 0.0   # paged: host-to-device bandwidth for the table (0 = bytes are free)
    gather_fraction: float = 0.0     # paged: extra KV read time of the gather, as a fraction

    @property
    def is_zero(self) -> bool:
        return not any((self.map_s, self.set_access_s, self.unmap_s, self.table_latency_s, self.table_bytes_per_s,
                        self.gather_fraction))

    def to_json(self) -> dict:
        return asdict(self)


ZERO = DriverProfile("zero", "no driver costs (today's simulator)")
CUDA_A100 = DriverProfile("cuda-a100", KVCACHED_SOURCE, create_s=193e-6, map_s=1.45e-6, set_access_s=36e-6,
                          unmap_s=25.6e-6, table_latency_s=5e-6, table_bytes_per_s=25e9)
# Old names that warn and resolve: `cuda-h200` held the A100 figures (no H200 has been measured; docs/evidence.md).
ALIASES = {"cuda-h200": "cuda-a100"}
PROFILES = {p.name: p for p in (ZERO, CUDA_A100)}
PROFILES |= {old: PROFILES[new] for old, new in ALIASES.items()}


def profile(name: str, calibration: str | Path | None = None, page_size: int | None = None) -> DriverProfile:
    """zero | cuda-a100 | host (from `kvlab calibrate`'s JSON, the entry for `page_size`) | measured:FILE (the GPU
    check's per-call figures at `page_size`: sim/serve/measured_driver.py); an old name warns."""
    if name in ALIASES:
        warnings.warn(f"driver profile {name!r} is {ALIASES[name]!r}: it holds A100 figures", FutureWarning,
                      stacklevel=2)
    if name in PROFILES:
        return PROFILES[name]
    if is_measured(name):
        source, table = measured_figures(name)
        at = at_size(table, page_size)
        return DriverProfile("measured", source, create_s=at["create_s"], map_s=at["map_s"],
                             set_access_s=at["set_access_s"], unmap_s=at["unmap_s"])
    if name != "host":
        raise ConfigError(f"unknown driver profile {name!r}; choose one of: {', '.join([*PROFILES, 'host'])}, "
                          "measured:FILE")
    path = Path(calibration or DEFAULT_CALIBRATION)
    if not path.is_file():
        raise ConfigError(f"no host calibration at {path}: run `kvlab calibrate --out {path}` first")
    table = calibration_table(path)
    entry = table.get(str(page_size)) if page_size is not None else None
    if entry is None:
        raise ConfigError(f"{path} has no entry for page size {page_size}; calibrated: {', '.join(table)[:200]}")
    return DriverProfile("host", f"kvlab calibrate ({path})", map_s=entry["map_s"], unmap_s=entry["unmap_s"])


def known_profile(name: str) -> bool:
    """A name `profile` accepts (a measured:FILE is read when the profile is built)."""
    return name in PROFILES or name == "host" or is_measured(name)


def check_set_access(granularity: str) -> str:
    if granularity not in SET_ACCESS:
        raise ConfigError(f"unknown cuMemSetAccess granularity {granularity!r}; choose one of: {', '.join(SET_ACCESS)}")
    return granularity


def extrapolated(prof: DriverProfile, page_size: int | None) -> bool:
    """True when a published 2 MiB per-call figure is applied per page to pages smaller than 2 MiB."""
    return bool(page_size) and page_size < MEASURED_PAGE and prof.name != "host" and not prof.is_zero


def extrapolation_note(prof: DriverProfile, labels_and_pages: list[tuple[str, int | None]]) -> str:
    """The footnote for a table whose vmm rows use `prof` below 2 MiB pages ('' when none does)."""
    marked = [label for label, page in labels_and_pages if extrapolated(prof, page)]
    if not marked:
        return ""
    return (f"* {', '.join(marked)}: {prof.name}'s per-call latencies were measured at 2 MiB pages; applied per "
            "page here they are an extrapolation (stock CUDA has no page under 2 MiB)")


def calibration_table(path: Path) -> dict[str, dict[str, float]]:
    """`kvlab calibrate`'s page_sizes table: {page size: {"map_s": s, "unmap_s": s}}, each a finite time >= 0."""
    try:
        table = json.loads(path.read_bytes())["page_sizes"]
        entries = {str(size): {key: check_number(f"{key} of page size {size}", entry[key], high=1.0, unit=" s")
                               for key in ("map_s", "unmap_s")} for size, entry in table.items()}
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        detail = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {shown(e.args[0] if e.args else '')}"
        raise ConfigError(f"{shown(str(path))} is not `kvlab calibrate`'s JSON ({detail})") from None
    return entries


@dataclass(frozen=True, slots=True)
class StepOps:
    """What one step issued."""
    pages_mapped: int = 0
    map_calls: int = 0
    pages_unmapped: int = 0
    table_bytes: int = 0        # paged: block-table bytes uploaded (0 = no upload)
    kv_read_s: float = 0.0      # paged: the step's KV read time on the roofline


@dataclass(slots=True)
class CostLedger:
    """Accumulates driver time: `exposed` lengthens the step, `hidden` ran under compute (with `overlap`,
    background mapping). `set_access`: one cuMemSetAccess per page mapped, or one per mapped run."""
    profile: DriverProfile
    overlap: bool = False
    set_access: str = "per-page"
    driver_s: float = 0.0
    exposed_s: float = 0.0
    hidden_s: float = 0.0
    paged_s: float = 0.0

    def vmm_seconds(self, ops: StepOps) -> float:
        p = self.profile
        grants = ops.pages_mapped if self.set_access == "per-page" else ops.map_calls
        return ops.pages_mapped * p.map_s + grants * p.set_access_s + ops.pages_unmapped * p.unmap_s

    def paged_seconds(self, ops: StepOps) -> float:
        p = self.profile
        upload = 0.0
        if ops.table_bytes:
            upload = p.table_latency_s + (ops.table_bytes / p.table_bytes_per_s if p.table_bytes_per_s else 0.0)
        return upload + ops.kv_read_s * p.gather_fraction

    def charge(self, ops: StepOps, compute_s: float) -> float:
        """Seconds this step grows by. Mapping overlapped with compute costs only what exceeds the compute."""
        driver = self.vmm_seconds(ops)
        exposed = max(0.0, driver - compute_s) if self.overlap else driver
        paged = self.paged_seconds(ops)
        self.driver_s += driver
        self.exposed_s += exposed
        self.hidden_s += driver - exposed
        self.paged_s += paged
        return exposed + paged

    def to_json(self) -> dict:
        return {"driver_profile": self.profile.name, "driver_source": self.profile.source,
                "background_mapping": self.overlap, "set_access": self.set_access, "driver_seconds": self.driver_s,
                "driver_exposed_seconds": self.exposed_s, "driver_hidden_seconds": self.hidden_s,
                "paged_overhead_seconds": self.paged_s}
