"""A request that failed alone -> the HTTP status its client gets, by the type of the exception behind it, as
vLLM's disaggregated proxy answers: the prefill engine refused the pull (the KV was taken already, expired or never
offered: a replay, a wrong id) is a 409 conflict; a prefill engine that cannot be reached, died, or answered
something malformed is a 502 bad gateway; anything else is the server's own 500 (docs/disaggregation.md)."""
from __future__ import annotations

from kvlab.common.handoff.seam import HandoffError, HandoffRefused
from kvlab.experiments.serve.protocol import ApiError

STATUS_BY_TYPE = ((HandoffRefused, 409, "conflict"), (HandoffError, 502, "bad_gateway"))   # most specific first


def failure_error(message: str, error_type: type | None) -> ApiError:
    """The one-line error answering a request that failed with `message`."""
    for kind, status, name in STATUS_BY_TYPE:
        if error_type is not None and issubclass(error_type, kind):
            return ApiError(status, f"the KV handoff failed: {message}", kind=name)
    return ApiError(500, f"the request failed: {message}", kind="internal_server_error")
