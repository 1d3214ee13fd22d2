"""The import path kept for `Scheduler` and `SchedulerOutput`: the scheduler lives in common/sched/."""
from kvlab.common.request import SchedulerOutput
from kvlab.common.sched.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerOutput"]
