"""The byte sizes the simulator reads without torch (common/kv/dtype_names.py) are torch's own."""
import torch

from kvlab.common.kv.dtype_names import COMPUTE_DTYPE_BYTES, FP8_NAMES
from kvlab.common.kv.torch_dtypes import FP8_DTYPES, TORCH_DTYPES
from kvlab.common.kv.types import KVShape


def test_the_named_sizes_are_torchs():
    assert set(COMPUTE_DTYPE_BYTES) == set(TORCH_DTYPES) and set(FP8_NAMES) == set(FP8_DTYPES)
    for name, size in COMPUTE_DTYPE_BYTES.items():
        shape = KVShape(num_layers=1, num_kv_heads=1, head_dim=2, num_q_heads=1, dtype=name)
        assert size == TORCH_DTYPES[name].itemsize == shape.itemsize == shape.cache_dtype.itemsize
        for fp8 in FP8_NAMES:
            stored = KVShape(num_layers=1, num_kv_heads=1, head_dim=2, num_q_heads=1, dtype=name, kv_cache_dtype=fp8)
            assert stored.itemsize == stored.cache_dtype.itemsize == FP8_DTYPES[fp8].itemsize == 1
    assert torch.tensor([], dtype=torch.bfloat16).element_size() == COMPUTE_DTYPE_BYTES["bfloat16"]
