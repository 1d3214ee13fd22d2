"""`kvlab study page-size`: which KV unit serves a model, hardware, workload and SLO best, paged blocks or vmm
pages, as a curve over the one unknown that decides it (paged/contiguous attention time), with the break-even.

settings (what was asked) -> point (one simulated run under turned costs) -> probe/journal (SLO searches per
backend and seed, each once, on a process pool or Ray: executor) -> curve (vmm/paged against the kernel ratio,
r*) -> verdict, report and files; session (provenance, interrupt, resume). docs/study.md describes the method."""
