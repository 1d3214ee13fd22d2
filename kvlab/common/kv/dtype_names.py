"""vLLM's kv_cache_dtype names, without torch: the config checks them, so `kvlab ... --help` and flag errors come
back without importing torch, and the simulator sizes its caches without it (common/kv/torch_dtypes.py maps the
names to torch dtypes)."""
COMPUTE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}   # the model's dtype -> bytes per element
FP8_NAMES = ("fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPES = ("auto", *FP8_NAMES)
