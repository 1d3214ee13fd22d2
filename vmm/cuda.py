"""TRANSITIONAL: the CUDA driver moved to vmm/drivers/cuda.py. Callers outside vmm/ (tests/test_bad_input.py,
tests/test_crash_safety.py, experiments/gpu_check.py) still import it here; delete this module once they import
kvlab.vmm.drivers.cuda."""
from kvlab.vmm.drivers.cuda import *  # noqa: F403
