"""A machine-wide physical page pool shared by engines in separate processes (docs/pool.md).

Fixed-size pages (one memfd on the host, a few exportable cuMemCreate chunks on a GPU) and one shared ledger of
who holds which page; engines join by name through an abstract Unix socket and map pages by offset. Nothing is
named in the filesystem, and the kernel (and the CUDA driver) frees all of it when the last member goes, kill -9
included.
"""
from kvlab.vmm.pool.admin import set_limits, status
from kvlab.vmm.pool.engines import EngineRecord
from kvlab.vmm.pool.enroll import DEFAULT_PAGE_SIZE, create, join, join_or_create
from kvlab.vmm.pool.errors import LimitError, PoolError, PoolExists, UnknownPool
from kvlab.vmm.pool.member import PoolMember
from kvlab.vmm.pool.status import PoolStatus

__all__ = ["DEFAULT_PAGE_SIZE", "EngineRecord", "LimitError", "PoolError", "PoolExists", "PoolMember", "PoolStatus",
           "UnknownPool", "create", "join", "join_or_create", "set_limits", "status"]
