"""The checks a driver makes of a request before the OS sees it: each raises a DriverError that names what is
wrong, and changes nothing."""
from __future__ import annotations

from kvlab.common.errors import DriverError
from kvlab.vmm.drivers.types import Mirror, Region


def va_page(region: Region, offset: int, num_pages: int, page_size: int) -> int:
    """The first VA page of [offset, + num_pages pages) inside a live range."""
    if region.released:
        raise DriverError(f"the range at {region.base:#x} was released")
    if offset % page_size or num_pages < 1 or offset < 0 or offset + num_pages * page_size > region.nbytes:
        raise DriverError(f"offset {offset} (+{num_pages} pages of {page_size} B) is not page-aligned "
                          f"inside the {region.nbytes}-byte range at {region.base:#x}")
    return offset // page_size


def mirror_offset(mirror: Mirror, offset: int, num_pages: int, page_size: int) -> None:
    if offset % page_size or num_pages < 1 or offset < 0 or offset + num_pages * page_size > mirror.span:
        raise DriverError(f"offset {offset} (+{num_pages} pages of {page_size} B) is not page-aligned "
                          f"inside a {mirror.span}-byte mirrored place")


def store_pages(page: int, num_pages: int, store_size: int) -> None:
    if page < 0 or page + num_pages > store_size:
        raise DriverError(f"store pages [{page}, {page + num_pages}) are outside the page store of {store_size} pages")


def unmapped(region: Region, first: int, num_pages: int) -> None:
    pages = region.mapped
    for i in range(first, first + num_pages):
        if i in pages:
            raise DriverError(f"VA page {i} of the range at {region.base:#x} is already mapped; unmap it first")


def mapped(region: Region, first: int, num_pages: int) -> None:
    pages = region.mapped
    for i in range(first, first + num_pages):
        if i not in pages:
            raise DriverError(f"VA page {i} of the range at {region.base:#x} is not mapped")
