"""The elastic backend's registration: its options and how to build it."""
from __future__ import annotations

import mmap
from dataclasses import dataclass, field

from kvlab.common.errors import ConfigError
from kvlab.common.kv.options import check_choice, check_positive, check_types
from kvlab.common.kv.registry import BackendSpec

PLACEMENTS = ("page-aware", "naive")   # elastic/block_pool.py


@dataclass(slots=True)
class ElasticOptions:
    elastic_block_size: int = field(default=16, metadata={"help": "tokens per block (elastic)"})
    elastic_page_size: int = field(default=64 * 1024, metadata={
        "help": "bytes per physical page (elastic), e.g. 64KiB; CUDA rounds it up to its granularity", "bytes": True})
    elastic_placement: str = field(default="page-aware", metadata={
        "help": "elastic: page-aware (fill mapped pages first, evict cached blocks page by page) or naive"})
    elastic_cached_blocks: int = field(default=-1, metadata={
        "help": "elastic: most free prefix-cached blocks kept mapped (-1: no cap, as paged)"})
    elastic_compact: int = field(default=-1, metadata={
        "help": "elastic: after frees, move held blocks (a copy each) out of sparse pages so at most N pages per "
                "layer and K/V past what the held blocks need stay mapped (-1: never move blocks)"})

    def validate(self) -> None:
        check_positive(self, "elastic_block_size", "elastic_page_size")
        check_types(self)
        check_choice("elastic_placement", self.elastic_placement, PLACEMENTS)
        if self.elastic_page_size % mmap.PAGESIZE:
            raise ConfigError(f"elastic_page_size {self.elastic_page_size} is not a multiple of the host page size "
                              f"{mmap.PAGESIZE}")
        if self.elastic_compact < -1:
            raise ConfigError(f"elastic_compact must be -1 (off) or >= 0, got {self.elastic_compact}")
        if self.elastic_cached_blocks < -1:
            raise ConfigError(f"elastic_cached_blocks must be -1 (no cap) or >= 0, got {self.elastic_cached_blocks}")


def build(config, shape, accounting_only):
    from kvlab.elastic.backend import build_elastic
    return build_elastic(config, shape, accounting_only)


def label(o: ElasticOptions) -> str:
    size = o.elastic_page_size
    page = f"{size // 2**20}MiB" if size % 2**20 == 0 else f"{size // 1024}KiB"
    return f"elastic-{o.elastic_block_size}-{page}"


SPEC = BackendSpec(name="elastic", unit="block", layout="paged", options=ElasticOptions, build=build, label=label,
                   handoff="kvlab.paged.handoff:make", probe="kvlab.elastic.probe:PROBE", window_trim=True,
                   unit_option="elastic_block_size", pool=True,
                   help="kvcached-style: paged block tables and kernels over pages mapped on demand")
