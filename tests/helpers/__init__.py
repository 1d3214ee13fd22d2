"""Code the tests share: imported as `helpers.<module>` (tests/ is on sys.path, as for tests/fakes/ and
tests/backends/). Scripts here that run as their own process (handoff_worker.py, pool_ask_cost.py,
pool_wait_cost.py) put tests/ on sys.path themselves."""
