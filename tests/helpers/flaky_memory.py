"""A host driver's OS calls with failures injected (`FlakyMemory`), and the kernel's own view of a range's mappings
(`kernel_pages`): what the vmm tests compare the driver's books with after a failure."""
from __future__ import annotations

from pathlib import Path

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.host import POOL_NAME, HostMemory


class FlakyMemory(HostMemory):
    """The host's OS calls with injected failures: `fail_next("unmap", 1)` makes the second unmap call from now
    raise instead of reaching the kernel."""

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self.calls = {"map": 0, "unmap": 0}
        self.failing: dict[str, set[int]] = {"map": set(), "unmap": set()}

    def fail_next(self, call: str, *nth: int) -> None:
        self.failing[call].update(self.calls[call] + n for n in nth)

    def _injected(self, call: str) -> None:
        n, self.calls[call] = self.calls[call], self.calls[call] + 1
        if n in self.failing[call]:
            raise DriverError(f"injected {call} failure")

    def map(self, addr: int, first_page: int, num_pages: int) -> int:
        self._injected("map")
        return super().map(addr, first_page, num_pages)

    def unmap(self, addr: int, num_pages: int) -> int:
        self._injected("unmap")
        return super().unmap(addr, num_pages)


def kernel_pages(region, page_size: int) -> dict[int, int]:
    """VA page -> pool page as the kernel maps the range (memfd mappings in /proc/self/maps)."""
    pages = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if POOL_NAME not in line or hi <= region.base or lo >= region.base + region.nbytes:
            continue
        for addr in range(max(lo, region.base), min(hi, region.base + region.nbytes), page_size):
            pages[(addr - region.base) // page_size] = (int(fields[2], 16) + addr - lo) // page_size
    return pages
