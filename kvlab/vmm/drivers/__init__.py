"""The virtual-memory drivers: base.py keeps the books and checks every call; host.py (mmap + memfd), cuda.py
(the CUDA VMM driver API) and accounting.py (no memory) make the real calls. `make_driver` picks one."""
