"""vLLM's kv_cache_dtype names, without torch: the config checks them, so `kvlab ... --help` and flag errors come
back without importing torch (common/kv/types.py maps the fp8 names to the torch dtypes stored)."""
FP8_NAMES = ("fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", *FP8_NAMES)
