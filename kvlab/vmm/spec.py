"""The vmm backend's registration: its options and how to build it."""
from __future__ import annotations

import mmap
from dataclasses import dataclass, field

from kvlab.common.errors import ConfigError
from kvlab.common.kv.options import check_positive, check_types
from kvlab.common.kv.registry import BackendSpec

HOST_PAGE = mmap.PAGESIZE


@dataclass(slots=True)
class VMMOptions:
    page_size: int = field(default=64 * 1024, metadata={"help": "bytes per physical page (vmm), e.g. 64KiB",
                                                         "bytes": True})
    background_mapping: bool = field(default=False, metadata={"help": "vmm: map ahead of need on a worker thread"})
    vmm_single_range: bool = field(default=False, metadata={
        "help": "vmm: one reserved range for all 2L tensors instead of one each"})

    def validate(self) -> None:
        check_positive(self, "page_size")
        check_types(self)
        if self.page_size % HOST_PAGE:
            raise ConfigError(f"page_size {self.page_size} is not a multiple of the host page size {HOST_PAGE}")


def build(config, shape, accounting_only):
    from kvlab.vmm.build import build_vmm
    return build_vmm(config, shape, accounting_only)


def label(o: VMMOptions) -> str:
    size = o.page_size
    return f"vmm-{size // 2**20}MiB" if size % 2**20 == 0 else f"vmm-{size // 1024}KiB"


SPEC = BackendSpec(name="vmm", unit="page group", layout="contiguous", options=VMMOptions, build=build,
                   label=label, handoff="kvlab.vmm.handoff:make", probe="kvlab.vmm.probe:PROBE", window_trim=True,
                   unit_multiple=HOST_PAGE, pool=True,
                   help="vAttention-style: contiguous virtual K/V ranges, physical pages mapped on demand")
