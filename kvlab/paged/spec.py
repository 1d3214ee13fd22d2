"""The paged backend's registration: its options and how to build it."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.common.kv.options import check_positive, check_types
from kvlab.common.kv.registry import BackendSpec


@dataclass(slots=True)
class PagedOptions:
    block_size: int = field(default=16, metadata={"help": "tokens per block (paged)"})

    def validate(self) -> None:
        check_positive(self, "block_size")
        check_types(self)


def build(config, shape, accounting_only):
    from kvlab.paged.backend import build_paged
    return build_paged(config, shape, accounting_only)


SPEC = BackendSpec(name="paged", unit="block", layout="paged", options=PagedOptions, build=build,
                   label=lambda o: f"paged-{o.block_size}",
                   handoff="kvlab.paged.handoff:make", probe="kvlab.paged.probe:PROBE", window_trim=True,
                   kernels="kvlab.paged.kernel_declarations:declare",
                   help="PagedAttention: a block pool, per-sequence block tables, copy-on-write")
