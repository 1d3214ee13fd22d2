"""Exceptions a user can act on. The CLI turns any KvlabError into one line and exit code 2."""


class KvlabError(Exception):
    """Base class: every message is one line that says what to change."""


class ConfigError(KvlabError, ValueError):
    """A configuration value is invalid or inconsistent."""


class ModelLoadError(KvlabError):
    """A model file or preset is missing, unreadable or malformed."""


class RequestError(KvlabError, ValueError):
    """One request is invalid (fails alone; other requests continue)."""


class OutOfKVCache(KvlabError, MemoryError):
    """The KV cache cannot hold what was asked; the scheduler preempts or waits."""


class KernelUnavailable(KvlabError):
    """An explicitly chosen attention kernel cannot run this configuration."""


class DriverError(KvlabError, RuntimeError):
    """A virtual-memory driver call failed (host mmap/memfd or CUDA VMM)."""


class HandoffError(KvlabError):
    """A KV handoff between a prefill and a decode engine failed: the request that needed it fails alone, with this
    one-line reason."""
