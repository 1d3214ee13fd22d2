"""The dtype names of common/kv/dtype_names.py as torch dtypes (the one place that needs torch for them)."""
import torch

from kvlab.common.kv.dtype_names import COMPUTE_DTYPE_BYTES, FP8_NAMES

TORCH_DTYPES = dict(zip(COMPUTE_DTYPE_BYTES, (torch.float32, torch.float16, torch.bfloat16), strict=True))
# vLLM's kv_cache_dtype names -> the fp8 format stored (1 byte; kept in uint8 tensors, CPU torch lacks fp8 ops)
FP8_DTYPES = dict(zip(FP8_NAMES, (torch.float8_e4m3fn, torch.float8_e5m2), strict=True))
