"""`kvlab pool create | status | limit`: the table and JSON, limits by name, one-line errors with exit code 2, and
the holder process: it ends on SIGTERM (exit 0) or, with --exit-when-idle, once the engines that joined have left,
leaving nothing behind."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys

import pytest
from helpers.pool_workers import leftovers

from kvlab.experiments.cli.main import main
from kvlab.vmm import pool

PAGE = 4096


@pytest.fixture
def name():
    name = f"test-cli-{os.getpid()}"
    with pool.create(name, 16 * PAGE, PAGE, engine="alpha") as member:
        member.take(3)
        yield name


def test_status_prints_the_table_and_json(name, capsys):
    assert main(["pool", "status", name]) == 0
    out = capsys.readouterr().out
    assert f"pool {name} on cpu: total 64.0 KiB (16), used 12.0 KiB (3), free 52.0 KiB (13)" in out
    assert "alpha" in out and str(os.getpid()) in out
    assert main(["pool", "status", name, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["total_bytes"], data["used_pages"], data["engines"][0]["held"]) == (16 * PAGE, 3, 3)
    assert data["device"] == "cpu"


def test_limit_changes_a_running_engine(name, capsys):
    assert main(["pool", "limit", name, "alpha", "--min", "8KiB", "--max", "32KiB"]) == 0
    assert "floor 8.0 KiB (2), ceiling 32.0 KiB (8)" in capsys.readouterr().out
    engine = pool.status(name).engine("alpha")
    assert (engine.floor, engine.ceiling) == (2, 8)


@pytest.mark.parametrize("argv, fragment", [
    (["pool", "status", "no-such-pool"], "no pool named 'no-such-pool'"),
    (["pool", "limit", "no-such-pool", "e", "--max", "4KiB"], "no pool named"),
    (["pool", "limit", "{name}", "nobody", "--max", "4KiB"], "no engine 'nobody'"),
    (["pool", "limit", "{name}", "alpha"], "needs --min BYTES and/or --max BYTES"),
    (["pool", "limit", "{name}", "alpha", "--min", "16KiB", "--max", "8KiB"], "floor <= ceiling"),
    (["pool", "limit", "{name}", "alpha", "--max", "1TiB"], "<= the pool's 16 pages"),
    (["pool", "limit", "{name}", "alpha", "--max", "5000"], "multiple of the pool's page size"),
    (["pool", "create", "{name}", "--bytes", "64KiB"], "already exists"),
    (["pool", "create", "x", "--bytes", "12 parsecs"], "bad size"),
    (["pool", "create", "x", "--bytes", "64KiB", "--page-size", "5000"], "multiple of the OS page"),
    (["pool", "create", "x", "--bytes", "65537"], "multiple of the page size"),
    (["pool", "create", "x", "--bytes", "100TiB"], "more than this machine's RAM"),
    (["pool", "create", "a/b", "--bytes", "64KiB"], "bad pool name"),
    (["pool", "create", "x", "--bytes", "64KiB", "--device", "gpu0"], "unknown device 'gpu0'"),
])
def test_errors_are_one_line_and_exit_2(name, argv, fragment, capsys):
    assert main([a.format(name=name) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvlab") and fragment in err[0], err


def start_holder(name: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvlab.experiments.cli.main", "pool", "create", name,
                             "--bytes", "64KiB", "--page-size", "4KiB", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen, name: str) -> None:
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready and f"pool {name}: 64.0 KiB in 16 pages" in proc.stdout.readline()


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, out, err


def test_create_holds_the_pool_until_sigterm_or_until_idle():
    """Two holders started together (each start imports torch through the CLI: seconds)."""
    held, idle = f"test-hold-{os.getpid()}", f"test-idle-{os.getpid()}"
    procs = {held: start_holder(held), idle: start_holder(idle, "--exit-when-idle")}
    try:
        for name, proc in procs.items():
            wait_ready(proc, name)
        with pool.join(held, engine="e") as member:
            assert len(member.take(16)) == 16                  # the holder takes no pages
            assert {e.name for e in pool.status(held).engines} == {"pool-holder", "e"}
        with pool.join(idle) as member:
            member.take(2)
        procs[held].send_signal(signal.SIGTERM)
        for name, proc in procs.items():                        # the idle holder ends by itself
            code, out, err = finish(proc)
            assert (code, out.strip(), err) == (0, f"pool {name}: closed", "")
            assert leftovers(name) == []
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
