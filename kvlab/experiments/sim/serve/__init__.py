"""`kvlab simulate serve`: online serving on the roofline clock (arrivals, per-token timestamps, vLLM's result
keys), paired seeds with bootstrap intervals, SLO search and a driver cost model. See docs/simulator-serving.md."""
