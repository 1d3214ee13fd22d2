"""The sane maxima of what the commands take beyond the engine's own settings (common/limits.py): workloads,
traces and simulated budgets, and what one HTTP request to `kvlab serve` may ask for. Each is checked before
anything is allocated, with a one-line error that names the limit."""
from __future__ import annotations

from kvlab.common.limits import MAX_MODEL_LEN

MAX_REQUESTS = 1_000_000         # requests in one workload
MAX_SPAN_S = 7 * 24 * 3600.0     # a workload's arrivals span at most a week
MAX_BUDGET_GB = 100_000.0        # simulated KV budget: 100 TB, far beyond one node's GPU memory
MAX_PROMPT_TOKENS = 2**26        # prompt tokens a trace synthesises in all (as Python ints: ~2.4 GB)
MAX_HASH_ID = 2**64 - 1          # a trace's block hash id (numpy seeds a block from it)
MAX_VOCAB = 2**24                # token ids a model or a synthetic trace draws from (as common/model.py's maxima)
MAX_LINE_BYTES = 2**22           # one line of a JSONL trace (4 MiB holds 400k hash ids); read no further

# -- kvlab serve: what one HTTP request may ask for (docs/reliability.md, "Server limits") --------------------------
MAX_BODY_BYTES = 32 * 2**20      # a request body: 413 beyond it (a 4M-token prompt as ids fits; RSS stays bounded)
MAX_STOP_CHARS = 1024            # one stop string: longer ones are refused (the hold-back scans this window)
MAX_PROMPT_CHARS = 8 * 2**20     # a prompt or all chat contents together, before tokenizing
MAX_N = 128                      # completions per request
MAX_TOKENS = MAX_MODEL_LEN       # max_tokens per completion
KEEP_ALIVE_S = 5                 # an idle keep-alive connection is closed after this (uvicorn timeout_keep_alive)
MAX_PORT = 65535
MAX_HEADER_BYTES = 64 * 2**10    # request line and headers (uvicorn h11_max_incomplete_event_size)
