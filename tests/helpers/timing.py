"""Per-test CPU seconds, for judging the suite's speed on a loaded machine (wall time there says little):
`PYTHONPATH=tests python -m pytest -p helpers.timing` prints the slowest tests and files by CPU seconds (this
process, its threads and the children it waited for) beside their wall seconds, and the collection's; with
KVLAB_TEST_TIMES=FILE it also writes one JSON line per test to FILE."""
from __future__ import annotations

import json
import os
import resource
import time
from collections import defaultdict

import pytest

SHOWN = 40


def cpu_seconds() -> tuple[float, float]:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


class Times:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.start = (time.perf_counter(), *cpu_seconds())
        self.collection: tuple[float, float] | None = None
        self.out = open(os.environ["KVLAB_TEST_TIMES"], "a") if os.environ.get("KVLAB_TEST_TIMES") else None

    def since_start(self) -> tuple[float, float]:
        own, children = cpu_seconds()
        return time.perf_counter() - self.start[0], own + children - self.start[1] - self.start[2]

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session) -> None:
        self.collection = self.since_start()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall, (own, children) = time.perf_counter(), cpu_seconds()
        yield
        own2, children2 = cpu_seconds()
        row = {"test": item.nodeid, "wall_s": round(time.perf_counter() - wall, 3),
               "cpu_s": round(own2 - own, 3), "children_cpu_s": round(children2 - children, 3)}
        self.rows.append(row)
        if self.out:
            self.out.write(json.dumps(row) + "\n")
            self.out.flush()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        write = terminalreporter.write_line
        if not self.rows:      # pytest-xdist's controller: the workers ran the tests (and wrote KVLAB_TEST_TIMES)
            write("-- timing: no test ran in this process; with -n N set KVLAB_TEST_TIMES=FILE, or run -n 0")
            return
        cpu = lambda r: r["cpu_s"] + r["children_cpu_s"]                               # noqa: E731
        by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for r in self.rows:
            total = by_file[r["test"].split("::")[0]]
            total[0] += cpu(r)
            total[1] += r["wall_s"]
            total[2] += 1
        write(f"-- timing: {len(self.rows)} tests, {sum(map(cpu, self.rows)):.1f} CPU s, "
              f"{sum(r['wall_s'] for r in self.rows):.1f} wall s; load {os.getloadavg()[0]:.1f}")
        if self.collection:
            write(f"collection: {self.collection[0]:.1f} wall s, {self.collection[1]:.1f} CPU s")
        write("slowest files (CPU s, wall s, tests):")
        for name, (c, w, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:SHOWN]:
            write(f"  {c:8.1f} {w:8.1f} {n:5d}  {name}")
        write("slowest tests (CPU s = own + children, wall s):")
        for r in sorted(self.rows, key=lambda r: -cpu(r))[:SHOWN]:
            write(f"  {cpu(r):8.1f} = {r['cpu_s']:.1f} + {r['children_cpu_s']:.1f} {r['wall_s']:8.1f}  {r['test']}")


def pytest_configure(config) -> None:
    config.pluginmanager.register(Times(), "kvlab-timing")
