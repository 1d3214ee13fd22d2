"""The walk of one `VMMAllocator.allocate` through the vmm backend's three rooms (kvlab/vmm/allocator.py's docstring):
the Python calls it makes, in order, by room; a stay is a run of calls in one room and a return is a stay in a room
the walk had already left. Three cases on a host cache whose free list is empty and whose pages sit parked in freed
slots (`make run`'s steady state): a new request's admission, a decode step that crosses into a new page, and one
that does not.

    PYTHONPATH=.:tests python tests/helpers/vmm_walk.py [--files]
"""
from __future__ import annotations

import sys
from collections.abc import Callable

from kvlab.common.config import make_config
from kvlab.common.kv.types import KVShape
from kvlab.common.sequence import Sequence
from kvlab.vmm.build import build_vmm

# vmm/geometry.py is no room: the layout's constants and arithmetic (pages_for), read by all three like KVShape.
ROOMS = {"allocator": ("vmm/allocator.py", "vmm/growth.py", "vmm/swap.py", "vmm/sharing.py"),
         "pages": ("vmm/pages.py", "vmm/page_calls.py", "vmm/reclaim.py", "vmm/free_pages.py", "vmm/slots.py",
                   "vmm/prefix.py"),
         "memory": ("vmm/drivers/",)}
PAGE, TPP = 4096, 32
SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=16, num_q_heads=4)   # 128 B per token per layer: 32 a page


def room_of(path: str) -> str | None:
    return next((name for name, parts in ROOMS.items() if any(p in path for p in parts)), None)


def file_of(path: str) -> str | None:
    return path.split("kvlab/")[-1] if "kvlab/vmm/" in path else None


def walk(call: Callable[[], object], place: Callable[[str], str | None] = room_of) -> list[str]:
    """The stays of `call`'s Python calls inside the vmm backend, each named by `place`."""
    stays: list[str] = []

    def on_event(frame, event, arg) -> None:
        where = place(frame.f_code.co_filename) if event == "call" else None
        if where is not None and (not stays or stays[-1] != where):
            stays.append(where)
    sys.setprofile(on_event)
    try:
        call()
    finally:
        sys.setprofile(None)
    return stays


def returns(stays: list[str]) -> int:
    return len(stays) - len(set(stays))


def walks(place: Callable[[str], str | None] = room_of) -> dict[str, list[str]]:
    config = make_config(backend="vmm", page_size=PAGE, kv_cache_bytes=8 * 4 * PAGE, max_num_seqs=4,
                         max_model_len=4 * TPP, max_num_batched_tokens=256)
    cache = build_vmm(config, SHAPE)
    try:
        alloc = cache.allocator
        olds = [Sequence(i, str(i), list(range(2 * TPP)), max_tokens=64) for i in range(4)]
        for s in olds:
            alloc.allocate(s, 2 * TPP)
        for s in olds:
            alloc.free(s)                                   # all 8 groups parked in 4 freed slots
        new = Sequence(9, "9", list(range(3 * TPP)), max_tokens=64)
        out = {"admission": walk(lambda: alloc.allocate(new, 3 * TPP), place)}
        new.num_computed_tokens = 3 * TPP
        out["decode, new page"] = walk(lambda: alloc.allocate(new, 3 * TPP + 1), place)
        out["decode, same page"] = walk(lambda: alloc.allocate(new, 3 * TPP + 2), place)
        return out
    finally:
        cache.close()


if __name__ == "__main__":
    place = file_of if "--files" in sys.argv else room_of
    for case, stays in walks(place).items():
        print(f"{case}: {len(stays)} stays in {len(set(stays))} places, {returns(stays)} returns: "
              + " > ".join(stays))
