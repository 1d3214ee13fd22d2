"""Issue 37's command lines that ended in a traceback (or ran when they should not): each is now one line on
stderr and exit status 2, before any server starts or any work is done."""
from __future__ import annotations

import json
import os

import pytest

from kvlab.experiments.cli.main import main

DEEP = "[" * 100_000 + "]" * 100_000
PROVENANCE = {"config": {"a": 1}, "kvlab": {"version": "x", "commit": None}, "torch": "2", "machine": {}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("round4")
    (d / "deep.json").write_text(DEEP)
    (d / "provlist.json").write_text(json.dumps({"provenance": [1, 2], "runs": [{"backend": "vmm", "x": 1}]}))
    (d / "backdict.json").write_text(json.dumps({"provenance": PROVENANCE, "runs": [{"backend": {"a": 1}}]}))
    (d / "ok.json").write_text(json.dumps({"provenance": PROVENANCE, "runs": [{"backend": "vmm", "x": 2}]}))
    os.symlink("/dev/zero", d / "zero.json")
    return d


CASES = {
    "sim pool vmm-0": "simulate pool --arrangements shared:vmm-0",
    "sim pd vmm-0": "simulate pd --backends vmm-0",
    "sim pd paged-0": "simulate pd --backends paged-0",
    "deep --model": "simulate serve --model {d}/deep.json",
    "deep --kernel-costs": "simulate serve --kernel-costs measured:{d}/deep.json",
    "deep compare": "compare {d}/deep.json {d}/ok.json",
    "compare provenance list": "compare {d}/provlist.json {d}/ok.json",
    "compare backend dict": "compare {d}/backdict.json {d}/ok.json",
    "page-size duplicate": "study page-size --vmm-pages 64KiB,64KiB",
    "page-size zero": "study page-size --vmm-pages 0",
    "pool study owned flag": "study pool --server-args=--kv-pool=x",
    "pool study total 0": "study pool --total-bytes 0",
    "pool study bogus model": "study pool --model bogus",
    "router unclosed ipv6": "serve --role router --prefill http://[::1 --decode http://127.0.0.1:2",
    "bench /dev/zero": "bench serve --dataset-name sharegpt --dataset-path {d}/zero.json --model m "
                       "--base-url http://127.0.0.1:9",
    "bench empty dataset": "bench serve --model m --base-url http://127.0.0.1:9 --num-prompts 1 --dataset-name=",
}


@pytest.mark.parametrize("line", CASES.values(), ids=CASES.keys())
def test_a_bad_command_line_is_one_line_and_exit_2(line, files, capsys):
    rc = main(line.format(d=files).split())
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("url", ["http://127.0.0.1:1 x", "http://127.0.0.1:1\n", "http://127.0.0.1:1\t"])
def test_router_urls_with_whitespace_are_refused_at_start(url, capsys):
    rc = main(["serve", "--role", "router", "--prefill", url, "--decode", "http://127.0.0.1:2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "--prefill" in err


def test_a_figure_beyond_a_float_is_left_out_of_compare(files, capsys):
    (files / "big.json").write_text(json.dumps({"provenance": PROVENANCE, "runs": [{"backend": "vmm", "x": 1}]})
                                    .replace('"x": 1', '"x": 1' + "0" * 400))
    assert main(["compare", str(files / "big.json"), str(files / "ok.json")]) == 0
    assert "Traceback" not in capsys.readouterr().err


class JunkPool:
    """A pool name whose server answers every join with junk books (an empty, a short or a pipe memfd)."""

    def __init__(self, kind: str) -> None:
        import threading

        from kvlab.vmm.pool import rendezvous
        self.name = f"r4-junk-{kind}-{os.getpid()}"
        self.server, self.kind = rendezvous.claim(self.name), kind
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.answer, daemon=True)
        self.thread.start()

    def fds(self) -> list[int]:
        if self.kind == "pipe":
            r, w = os.pipe()
            os.close(w)
            return [r, os.dup(r)]
        books = os.memfd_create("junk")
        os.ftruncate(books, 0 if self.kind == "empty" else 24)
        return [books, os.memfd_create("pages")]

    def answer(self) -> None:
        from kvlab.vmm.pool import rendezvous
        while not self.stop.is_set():
            fds = self.fds()
            try:
                rendezvous.serve_one(self.server, fds, 0.1)
            finally:
                for fd in fds:
                    os.close(fd)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.server.close()


@pytest.mark.parametrize("kind", ["empty", "short", "pipe"])
@pytest.mark.parametrize("command", ["pool status {name}", "pool limit {name} e --max 1MiB",
                                     "serve --model tiny --backend vmm --kv-pool {name} --engine-thread --port 0"])
def test_a_pool_whose_server_sends_junk_books_is_one_line(kind, command, capsys):
    junk = JunkPool(kind)
    try:
        rc = main(command.format(name=junk.name).split())
    finally:
        junk.close()
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 0 and junk.name in err, err


@pytest.mark.parametrize("kwargs", [{"kv_pool": 123}, {"kv_pool": "r4", "kv_pool_bytes": "1GiB"},
                                    {"kv_pool": "r4", "kv_pool_bytes": 1.5e9},
                                    {"kv_pool": "r4", "kv_pool_bytes": 100 << 40}])
def test_the_api_s_pool_arguments_are_one_line_config_errors(kwargs):
    from kvlab.common.config import make_config
    from kvlab.common.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        make_config(model="tiny", backend="vmm", **kwargs)
    assert "\n" not in str(e.value) and "kv_pool" in str(e.value)


def test_serve_refuses_a_pool_larger_than_the_machine_as_pool_create_does(capsys):
    rc = main(["serve", "--model", "tiny", "--backend", "vmm", "--kv-pool", "r4-huge", "--kv-pool-bytes", "100TiB",
               "--engine-thread"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "RAM" in err and err.count("\n") == 0, err


@pytest.mark.parametrize("call", [
    lambda pool, n: pool.create(n, 1.5 * 2**20), lambda pool, n: pool.create(n, 2**20, page_size=None),
    lambda pool, n: pool.create(n, 2**20, page_size=2**16, device=99), lambda pool, n: pool.create(n, True)])
def test_pool_create_refuses_bad_arguments_in_one_line(call):
    from kvlab.vmm import pool
    with pytest.raises(pool.PoolError) as e:
        call(pool, f"r4-api-{os.getpid()}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("call", [lambda m: m.take(2**70), lambda m: m.take(1.0), lambda m: m.give([0.0]),
                                  lambda m: m.give([True])])
def test_take_and_give_refuse_bad_page_counts_in_one_line(call):
    from kvlab.vmm import pool
    member = pool.create(f"r4-take-{os.getpid()}", 2**20, page_size=2**16)
    try:
        if call.__code__.co_names[-1] == "give":
            member.take(1)
        with pytest.raises(pool.PoolError) as e:
            call(member)
        assert "\n" not in str(e.value)
    finally:
        member.close()
