"""What a pool user can get wrong, each a one-line KvlabError."""
from __future__ import annotations

from kvlab.common.errors import KvlabError


class PoolError(KvlabError):
    """A pool operation was refused or a pool is unusable."""


class UnknownPool(PoolError):
    """No live process serves a pool by that name."""


class PoolExists(PoolError):
    """A pool by that name is already served."""


class LimitError(PoolError, ValueError):
    """A size, page count or floor/ceiling that does not fit the pool."""
