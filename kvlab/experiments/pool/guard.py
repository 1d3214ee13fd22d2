"""The CLI's boundary for a pool whose books cannot be read: a name answered by something that is not a kvlab
pool (an empty, short or pipe descriptor where the books should be) is one line naming the pool, whatever the
mapping raised. The checks that make joining such a pool safe belong to vmm/pool (docs/pool.md)."""
from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

from kvlab.vmm.pool import PoolError

UNREADABLE = (ValueError, OSError, struct.error, IndexError, OverflowError, BufferError)


@contextlib.contextmanager
def readable_books(name: str | None) -> Iterator[None]:
    """Run a pool operation on `name` (None: no pool, nothing guarded)."""
    if name is None:
        yield
        return
    try:
        yield
    except PoolError:
        raise
    except UNREADABLE as e:
        why = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise PoolError(f"pool {name[:80]!r}: its books cannot be read ({why}); is the name answered by something "
                        "other than a kvlab pool?") from None
