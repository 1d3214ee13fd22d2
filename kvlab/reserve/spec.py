"""The reserve baseline's registration: its options and how to build it."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.common.kv.options import check_choice, check_types
from kvlab.common.kv.registry import BackendSpec

RESERVE_MODES = ("max", "oracle")


@dataclass(slots=True)
class ReserveOptions:
    reserve_mode: str = field(default="max", metadata={"help": "reserve: max (max_model_len per sequence) | "
                                                               "oracle (its exact final length)"})

    def validate(self) -> None:
        check_types(self)
        check_choice("reserve_mode", self.reserve_mode, RESERVE_MODES)


def build(config, shape, accounting_only):
    from kvlab.reserve.backend import build_reserve
    return build_reserve(config, shape, accounting_only)


# The baseline reserves each sequence's whole region at admission, so a growth watermark means nothing to it.
SPEC = BackendSpec(name="reserve", unit="token", layout="contiguous", options=ReserveOptions, build=build,
                   label=lambda o: "reserve" if o.reserve_mode == "max" else "oracle",
                   handoff="kvlab.reserve.handoff:make", probe="kvlab.reserve.probe:PROBE",
                   watermark=False,
                   help="the pre-2023 baseline: one contiguous region per sequence, reserved at admission")
