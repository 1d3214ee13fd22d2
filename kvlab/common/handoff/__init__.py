"""Prefill/decode KV handoff (issue 30): a prefill engine keeps a finished request's KV until a decode engine pulls
it over an abstract Unix socket; each backend moves it its own way (vmm/handoff.py, paged/handoff.py,
reserve/handoff.py) behind the `KVHandoff` seam (seam.py)."""
