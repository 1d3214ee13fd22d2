"""Every flag of every `kvlab` command, found by walking the argparse tree (not a hand list), given hostile values
(NaN, +-inf, huge, negative, zero, empty, wrong type, unicode, lone surrogates, overlong strings, unwritable paths):
the command exits 0, or exits 2 with exactly one line on stderr and nothing on stdout; never a traceback, never
past a time bound.

In process, and up to argument validation only: each command's first step of real work (a model load, a
simulation, a server, a sweep, a measurement) is replaced by a stub that ends the run as accepted (STOPS below).
A value that reaches it passed every check; what happens after is the other tests' business. One drawn value per
flag in `make test` (derandomized: the same each run); every listed value and 40 more under `-m slow`.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import resource
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlab.experiments.cli.main import build_parser, main

TIME_BOUND_S = 10            # one command, up to its first real work
MEMORY_BOUND = 4 << 30       # address space one command may add before its real work (a runaway one fails here
                             # with MemoryError, naming its flag, instead of taking the machine's memory)

# command -> what its real work starts with (module, attribute): replaced by a stub that ends the run accepted
STOPS: dict[tuple[str, ...], tuple[tuple[str, str], ...]] = {
    ("generate",): (("kvlab.common.llm", "LLM"),),
    ("bench",): (("kvlab.experiments.bench.offline", "load"), ("kvlab.experiments.bench.offline", "importlib")),
    ("bench", "handoff"): (("kvlab.experiments.bench.handoff", "measure_all"),),
    ("bench", "serve"): (("kvlab.experiments.loadgen.cli", "bench_once"),
                         ("kvlab.experiments.loadgen.sweep", "run_sweep"),
                         ("kvlab.experiments.loadgen.multi_cli", "fetch_model")),
    ("simulate",): (("kvlab.experiments.sim.cli", "changes_line"), ("kvlab.experiments.sim.cli", "run_kv_preset"),
                    ("kvlab.experiments.sim.worked_example", "print_worked_example")),
    ("simulate", "serve"): (("kvlab.experiments.sim.serve.cli", "simulate_serve"),),
    ("simulate", "pool"): (("kvlab.experiments.sim.pool.cli", "simulate_pool"),),
    ("simulate", "pd"): (("kvlab.experiments.sim.pd.cli", "simulate_pd"),),
    ("fallbacks",): (("kvlab.experiments.studies.fallbacks", "run_grid"),),
    ("sharing",): (("kvlab.common.loader", "load_model"),),
    ("serve",): (("kvlab.experiments.serve.server", "start_engine"),
                 ("kvlab.experiments.serve.server", "serve_router")),       # --role router
    ("prefix",): (("kvlab.experiments.studies.prefix", "sim_rows"), ("kvlab.experiments.studies.prefix", "real_rows")),
    ("calibrate",): (("kvlab.experiments.bench.calibrate", "measure"),
                     ("kvlab.experiments.bench.calibrate", "measure_profile")),      # --kernels
    ("study",): (),
    ("study", "page-size"): (("kvlab.experiments.studies.page_size.study", "run_study"),),
    ("study", "pool"): (("kvlab.experiments.studies.pool.study", "execute"),),
    ("study", "corners"): (("kvlab.experiments.studies.corners", "run_corners"),),
    ("compare",): (("kvlab.experiments.compare.saved", "load_run"),),
    ("pool",): (),
    ("pool", "create"): (("kvlab.vmm.pool", "create"),),
    ("pool", "status"): (("kvlab.vmm.pool", "status"),),
    ("pool", "limit"): (("kvlab.vmm.pool", "set_limits"),),
}
# the flags that keep a command's accepted runs tiny (each is itself fuzzed when it is the flag drawn)
BASE: dict[tuple[str, ...], list[str]] = {
    ("generate",): ["hi"],
    ("simulate",): ["--num-requests", "5", "--jobs", "1", "--no-save", "--no-progress"],
    ("simulate", "serve"): ["--num-prompts", "5", "--jobs", "1", "--no-save", "--no-progress"],
    ("simulate", "pool"): ["--jobs", "1", "--no-save", "--no-progress"],
    ("simulate", "pd"): ["--num-prompts", "5", "--jobs", "1", "--no-save", "--no-progress"],
    ("bench",): ["--num-requests", "2", "--no-progress"],
    ("sharing",): ["--num-requests", "2", "--no-progress"],
    ("prefix",): ["--no-save"],
    ("fallbacks",): ["--no-plot"],
    ("study", "page-size"): ["--no-save", "--no-progress"],      # it writes provenance.json before its searches
}
HOSTILE = ["nan", "-nan", "NaN", "inf", "-inf", "Infinity", "1e309", "-1e309", "1e300", "-1e300", "1e-300",
           "-1", "-5", "0", "-0", "0.0", "0.5", "1", "2", "3", "1000", "1000000000", "10000000", str(2**63),
           str(2**70), "9" * 400, "-" + "9" * 400, "", " ", ",", ",,", "a,b", "1,2", "-", "abc", "{}", "[]",
           "true", "None", "64KiB", "1e9GiB", "é", "日本語", "\udcff", "\ud800x", "x" * 5000, "/proc/x",
           "/proc/x/y", "/dev/null", "/", ".", "trace:/proc/x", "vmm-0", "paged-0", "p101_ttft_ms<=5",
           "p99_ttft_ms<=5,p99_ttft_ms<=6", "ttft:nan", "host",
           # round 4: bad engine URLs, duplicate or zero-sized units, study-owned server flags, metadata pairs,
           # devices as files, sizes beyond the machine
           "http://[::1", "http://127.0.0.1:1 x", "http://127.0.0.1:1\n", "64KiB,64KiB", "shared:vmm-0",
           "split:paged-0", "measured:/dev/zero", "--kv-pool x", "a=b", "=v", "k=", "100TiB", "/dev/zero",
           # digits to str.isdigit() that int() refuses (the slow fuzz drew '²' for study page-size's TP sizes)
           "²", "①", "paged-²", "1,²", "host:²"]
# round 4: the commands and flags added or hardened since round 3 (test_round4_flags_every_listed_hostile_value)
ROUND4_FLAGS = {
    ("bench", "serve"): ("--save-detailed", "--append-result", "--metadata", "--label", "--result-dir",
                         "--result-filename", "--dataset-name", "--dataset-path", "--save-result"),
    ("serve",): ("--prefill", "--decode", "--colocated", "--upstream-timeout", "--kv-pool", "--kv-pool-bytes",
                 "--role", "--handoff-timeout-s"),
    ("simulate", "pool"): ("--arrangements",), ("simulate", "pd"): ("--backends",),
    ("study", "page-size"): ("--vmm-pages", "--paged-blocks"),
    ("study", "pool"): ("--total-bytes", "--model", "--server-args", "--engines"),
    ("pool", "create"): None, ("pool", "status"): None, ("pool", "limit"): None, ("compare",): None,
}


class Accepted(BaseException):
    """Raised by a stub in place of real work: every check before it passed."""


def stop(*args: Any, **kwargs: Any) -> Any:
    raise Accepted


class StopImporter:
    """Stands in for a module's `importlib`: the module it imports runs nothing."""

    @staticmethod
    def import_module(name: str) -> Any:
        return argparse.Namespace(main=stop)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                                             argparse.ArgumentParser]]:
    """(path, parser) of every command and subcommand under `parser`."""
    if path:
        yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def flag_cases() -> list[tuple[tuple[str, ...], argparse.Action]]:
    """(command path, action) for every flag and positional argument of every command but -h."""
    return [(path, action) for path, parser in commands(build_parser()) for action in parser._actions
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))]


def case_id(case: tuple[tuple[str, ...], argparse.Action]) -> str:
    path, action = case
    return " ".join(path) + " " + (action.option_strings[-1] if action.option_strings else action.dest)


CASES = flag_cases()


def values_for(action: argparse.Action) -> st.SearchStrategy[str]:
    choices = [str(c) for c in action.choices or ()]
    return st.one_of(st.sampled_from(HOSTILE + choices), st.text(max_size=30))


def argv_for(path: tuple[str, ...], action: argparse.Action, value: str) -> list[str]:
    base = BASE.get(path, [])
    if not action.option_strings:                  # a positional: the drawn value in its place
        return [*path, value]
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return [*path, *base, flag]
    return [*path, *base, f"{flag}={value}"] if value.startswith("-") else [*path, *base, flag, value]


@contextlib.contextmanager
def time_bound(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"no answer within {seconds} s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def memory_bound(extra: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    in_use = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = in_use + extra if hard == resource.RLIM_INFINITY else min(hard, in_use + extra)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(scope="module")
def stubbed() -> Iterator[None]:
    import importlib
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        for stops in STOPS.values():
            for module, name in stops:
                mp.setattr(importlib.import_module(module), name, StopImporter if name == "importlib" else stop)
        yield
    torch.set_num_threads(threads)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of main(argv) in this process; a run stopped at real work counts as exit 0."""
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), time_bound(TIME_BOUND_S), \
                memory_bound(MEMORY_BOUND):
            logging.basicConfig(stream=sys.stderr, force=True)
            rc = main(argv)
    except Accepted:
        rc = 0
    finally:
        root.handlers, root.level = handlers, level
    return rc, out.getvalue(), err.getvalue()


def check_outcome(argv: list[str], rc: int, out: str, err: str) -> None:
    assert "Traceback" not in err, f"{argv!r}:\n{err}"
    assert rc in (0, 2), f"{argv!r}: exit {rc}\n{err}"
    if rc == 2:
        lines = err.splitlines()
        assert len(lines) == 1, f"{argv!r}: {len(lines)} lines on stderr:\n{err}"
        assert out == "", f"{argv!r}: stdout before the error: {out[:300]!r}"


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def test_the_walk_finds_every_command_and_a_stop_for_each():
    paths = {path for path, _ in commands(build_parser())}
    assert paths == set(STOPS), f"commands without a stop (or stops without a command): {paths ^ set(STOPS)}"
    assert len(CASES) > 150


@pytest.mark.parametrize("case", CASES, ids=case_id)
@fuzz(1)
@given(data=st.data())
def test_every_flag_hostile_value_is_one_line_or_accepted(stubbed, case, data):
    path, action = case
    argv = argv_for(path, action, data.draw(values_for(action), label="value"))
    check_outcome(argv, *run_cli(argv))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=case_id)
@fuzz(len(HOSTILE) + 40)
@given(data=st.data())
def test_every_flag_hostile_value_slow(stubbed, case, data):
    path, action = case
    argv = argv_for(path, action, data.draw(values_for(action), label="value"))
    check_outcome(argv, *run_cli(argv))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_flag_every_listed_hostile_value(stubbed, case):
    path, action = case
    for value in HOSTILE:
        argv = argv_for(path, action, value)
        check_outcome(argv, *run_cli(argv))


def round4_cases() -> list[tuple[tuple[str, ...], argparse.Action]]:
    """ROUND4_FLAGS' flags (None: every flag and positional of that command)."""
    return [(path, action) for path, action in CASES if path in ROUND4_FLAGS
            and (ROUND4_FLAGS[path] is None or set(action.option_strings) & set(ROUND4_FLAGS[path]))]


def test_every_round4_flag_is_found():
    found = {(path, flag) for path, action in round4_cases() for flag in action.option_strings}
    wanted = {(path, flag) for path, flags in ROUND4_FLAGS.items() for flag in flags or ()}
    assert wanted <= found, wanted - found


@pytest.mark.slow
def test_round4_flags_every_listed_hostile_value(stubbed, capsys):
    """Every round-4 flag with every listed hostile value; prints how many inputs and how many were handled."""
    failures, total = [], 0
    for path, action in round4_cases():
        for value in HOSTILE:
            argv = argv_for(path, action, value)
            total += 1
            try:
                check_outcome(argv, *run_cli(argv))
            except (AssertionError, TimeoutError, MemoryError) as e:
                failures.append(f"{argv!r}: {str(e).splitlines()[0][:200]}")
    with capsys.disabled():
        print(f"\nround 4 flag fuzz: {total} inputs, {total - len(failures)} handled")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("argv", [
    ["study", "page-size", "--tensor-parallel-sizes", "1,²"],
    ["simulate", "serve", "--backends", "paged-²"],
    ["calibrate", "--kernels", "--contexts", "①"],
], ids=["study-tp-sizes", "simulate-backends", "calibrate-contexts"])
def test_a_digit_that_int_refuses_is_a_one_line_error(stubbed, argv):
    """str.isdigit() passes '²' and '①', int() refuses them: where kvlab reads a count it asks for ASCII digits."""
    rc, out, err = run_cli(argv)
    check_outcome(argv, rc, out, err)
    assert rc == 2 and ("²" in err or "①" in err)


def test_is_digits_takes_ascii_digits_only():
    from kvlab.common.validate import is_digits
    assert is_digits("0123") and not any(is_digits(t) for t in ("²", "①", "٣", "", "1.0", "-1", " 1"))
