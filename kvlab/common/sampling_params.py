"""How one request is decoded: vLLM-shaped SamplingParams, validated with one clear line per mistake."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvlab.common.errors import RequestError
from kvlab.common.limits import check_seed

GREEDY_EPS = 1e-5   # temperatures below this decode greedily (as vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20    # the most top candidates a token reports (OpenAI's top_logprobs bound)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    """n independent samples (sharing the prompt's KV via fork), or beam search when beam_width > 1.

    Beam search ranks hypotheses by the model's cumulative log-probability (no length penalty) and returns the
    best `n` of `beam_width`; it is deterministic, so top_k, top_p and seed must stay unset and temperature
    must be 0 or 1 (it is not applied)."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 disables top-k
    seed: int | None = None              # per-request generator: same seed, same samples on any backend
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    beam_width: int = 1                  # > 1: beam search
    logprobs: int | None = None          # per output token its log-probability and this many top candidates'
    presence_penalty: float = 0.0        # vLLM's: subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0       # vLLM's: subtracted once per time the token was generated
    repetition_penalty: float = 1.0      # vLLM's: a prompt or output token's logit divided (> 0) or multiplied by it

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def width(self) -> int:
        """Sequences this request may run at once."""
        return self.beam_width if self.use_beam_search else self.n

    def validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or math.isnan(self.temperature) or math.isinf(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), "
                               f"got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1):
            raise RequestError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None:
            check_seed("seed", self.seed, RequestError)      # the range the CLI's --sample-seed takes
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) \
                or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be a list of non-negative integers, "
                               f"got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise RequestError(f"beam_width must be an integer >= 1 (1 = no beam search), "
                               f"got {self.beam_width!r}")
        self._validate_logprobs_and_penalties()
        if self.use_beam_search:
            self._validate_beam()

    def _validate_logprobs_and_penalties(self) -> None:
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                raise RequestError(f"{name} must be a number in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or math.isinf(v) or v <= 0:
            raise RequestError(f"repetition_penalty must be a finite number > 0 (1 = off), got {v!r}")

    def _validate_beam(self) -> None:
        if self.n > self.beam_width:
            raise RequestError(f"beam search returns at most beam_width hypotheses: n={self.n} > "
                               f"beam_width={self.beam_width}")
        if self.top_k != -1 or self.top_p != 1.0 or self.seed is not None:
            raise RequestError("beam search is deterministic: leave top_k, top_p and seed unset")
        if self.logprobs is not None or self.penalized:
            raise RequestError("beam search returns no per-token logprobs and applies no penalties: leave "
                               "logprobs and the penalties unset")
        if self.temperature not in (0, 1):
            raise RequestError(f"beam search ranks by the model's log-probabilities and does not apply "
                               f"temperature: leave it at 1.0 or 0, got {self.temperature!r}")
