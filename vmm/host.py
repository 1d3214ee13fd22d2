"""TRANSITIONAL: the host driver moved to vmm/drivers/host.py. Callers outside vmm/ (tests/test_bad_input.py,
benchmarks/allocator.py) still import it here; delete this module once they import kvlab.vmm.drivers.host."""
from kvlab.vmm.drivers.host import *  # noqa: F403
