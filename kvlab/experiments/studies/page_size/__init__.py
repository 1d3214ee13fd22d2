"""`kvlab study page-size`: which KV unit serves a model, hardware, workload and SLO best, paged blocks or vmm
pages, and which unknowns (the contiguous kernel's advantage, the driver's latency) would change the answer.

settings (what was asked) -> point (one simulated run under turned costs) -> searches (SLO searches per
backend and seed, on a process pool or Ray: executor) -> flips (break-even searches) -> verdict and output.
docs/study.md describes the method."""
