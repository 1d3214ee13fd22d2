"""What a pool user can get wrong, each a one-line KvlabError."""
from __future__ import annotations

from kvlab.common.errors import ConfigError, KvlabError


class PoolError(KvlabError):
    """A pool operation was refused or a pool is unusable."""


class UnknownPool(PoolError):
    """No live process serves a pool by that name."""


class PoolExists(PoolError):
    """A pool by that name is already served."""


class LimitError(PoolError, ValueError):
    """A size, page count or floor/ceiling that does not fit the pool."""


class PageSizeMismatch(ConfigError):
    """The engine maps pages of another size than the pool's; `pool_page` is the pool's (the engine's own error
    names its page-size option)."""

    def __init__(self, message: str, pool_page: int) -> None:
        super().__init__(message)
        self.pool_page = pool_page
