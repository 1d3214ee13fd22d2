"""The dtype names of common/kv/dtype_names.py as torch dtypes (the one place that needs torch for them)."""
import torch

from kvlab.common.kv.dtype_names import FP8_NAMES

# the names of dtype_names.COMPUTE_DTYPE_BYTES, whose sizes tests/test_kv_dtype_names.py checks against these
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# vLLM's kv_cache_dtype names -> the fp8 format stored (1 byte; kept in uint8 tensors, CPU torch lacks fp8 ops)
FP8_DTYPES = dict(zip(FP8_NAMES, (torch.float8_e4m3fn, torch.float8_e5m2), strict=True))
