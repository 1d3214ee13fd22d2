"""The GPU figures of the multi-engine simulations (`simulate pool`, `simulate pd`) that are not in roofline.py's
HARDWARE (bandwidth, FLOP/s, memory) or serve/costs.py's driver profiles (per-call cuMemMap, cuMemSetAccess and
cuMemUnmap costs, kvcached's A100 measurements): each with its source.

Links (a KV handoff copied between GPUs uses one direction of the link, at the vendor's peak: a floor on the copy
time; measured copies reach less):
- NVLink 4 on H100 SXM: 900 GB/s total per GPU, 450 GB/s each way. NVIDIA H100 datasheet and product page,
  https://www.nvidia.com/en-us/data-center/h100/ (specifications: "NVIDIA NVLink: 900GB/s").
- PCIe Gen5 x16: 128 GB/s total, 64 GB/s each way. The same page ("PCIe Gen5: 128GB/s").

Memory after weights: the KV budget of E engines on one GPU is the GPU's memory x MEMORY_UTILIZATION less E copies
of the weights. 0.95 is the share that gives one Llama-3-8B on an H100 the 60 GB every existing preset uses
(80 x 0.95 - 16.06 = 59.9 GB); the rest is left to activations and the CUDA context."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.common.errors import ConfigError
from kvlab.experiments.sim.roofline import hardware, model_spec

MEMORY_UTILIZATION = 0.95
H100_PAGE = "https://www.nvidia.com/en-us/data-center/h100/"


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    bytes_per_s: float         # one direction
    source: str


LINKS = {
    "nvlink": Link("nvlink", 450e9, f"NVLink 4, H100 SXM: 900 GB/s total, 450 GB/s each way ({H100_PAGE})"),
    "pcie": Link("pcie", 64e9, f"PCIe Gen5 x16: 128 GB/s total, 64 GB/s each way ({H100_PAGE})"),
}


def link(name: str) -> Link:
    if name not in LINKS:
        raise ConfigError(f"unknown link {name!r}; choose one of: {', '.join(LINKS)}")
    return LINKS[name]


def kv_budget_gb(hardware_name: str, model: str, engines: int) -> float:
    """GB (1e9 bytes) of KV left on one GPU holding `engines` copies of `model`'s weights."""
    left = hardware(hardware_name).memory_bytes * MEMORY_UTILIZATION - engines * model_spec(model).weight_bytes
    if left <= 0:
        raise ConfigError(f"{engines} x {model} do not fit on one {hardware_name}: the weights alone take "
                          f"{engines * model_spec(model).weight_bytes / 1e9:.1f} GB of "
                          f"{hardware(hardware_name).memory_bytes * MEMORY_UTILIZATION / 1e9:.1f} GB")
    return left / 1e9
