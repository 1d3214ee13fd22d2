"""The C library's memory calls (mmap, munmap, fallocate), typed once for the process, and their flags (Linux).
The library is the running process's own symbols (dlopen(NULL)): no `ctypes.util.find_library`, which runs
`ldconfig -p` in a child process at every lookup."""
from __future__ import annotations

import ctypes

PROT_NONE, PROT_READ, PROT_WRITE = 0x0, 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x1, 0x2, 0x10, 0x20
MAP_NORESERVE, MAP_POPULATE = 0x4000, 0x8000
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x1, 0x2
MAP_FAILED = ctypes.c_void_p(-1).value
PROT_RW = PROT_READ | PROT_WRITE
RESERVED = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE       # address space only: no memory, faults if touched
PUNCH_HOLE = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE       # fallocate mode: give the range's memory back


def _typed(libc: ctypes.CDLL) -> ctypes.CDLL:
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


LIBC = _typed(ctypes.CDLL(None, use_errno=True))
