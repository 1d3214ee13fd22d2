"""The scheduler, composed: queues (where each sequence is), admission (swap-in and FCFS admission under the
watermark), preemption (idle beams first, then newest admitted), lifecycle (tokens, forks, finishing, failing)
and sequence groups (single, parallel `n`, beam), wired by scheduler.Scheduler. The policy is the docstring of
common/sched/scheduler.py. This file imports nothing, so common/request.py may import sched.beam."""
