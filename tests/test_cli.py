import sys
import types

import pytest

from kvlab.experiments.cli import main as cli
from kvlab.experiments.cli.flags import engine_config, parse_bytes
from kvlab.experiments.cli.main import main


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv, fragment", [
    ([], "required"),
    (["simulate", "--budget-gb", "abc"], "invalid float value"),
    (["bench", "--kv-cache-bytes", "12 parsecs"], "bad size"),
    (["teleport"], "invalid choice"),
    (["simulate", "--policies", "magic", "--no-progress"], "unknown policy 'magic'"),
    (["simulate", "--hardware", "tpu"], "unknown hardware 'tpu'"),
    (["generate", "--model", "no-such-model", "hi"], "no-such-model"),
    (["generate", "--backend", "floppy", "hi"], "unknown backend 'floppy'"),
    (["generate", "--page-size", "3000", "--backend", "vmm", "hi"], "not a multiple of the host page size"),
    (["bench", "--backends", "paged,nope"], "unknown backend(s) nope"),
    (["simulate", "--workload", "poisson"], "bad workload"),
    (["simulate", "--workload", "trace:/no/such.jsonl"], "does not exist"),
    (["simulate", "--worked-example", "--preset", "seed", "--seeds", "0"], "--seeds must be >= 1"),
    (["simulate", "--num-requests", "5", "--json", "/no/such/dir/rows.json", "--no-progress", "--jobs", "1"],
     "No such file or directory"),
])
def test_errors_are_one_line_and_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert line.startswith("kvlab") and fragment in line


def test_help_exits_0(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("text, value", [("65536", 65536), ("64KiB", 65536), ("2MiB", 2 * 2**20),
                                         ("60GB", 60 * 10**9), ("1.5k", 1536)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_engine_flags_override_the_toml_file(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text('[engine]\nbackend = "vmm"\nblock_size = 32\nmax_num_seqs = 8\n')
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "--config", str(path), "--block-size", "64", "hi"])
    config = engine_config(vars(args))
    assert (config.backend, config.block_size, config.max_num_seqs) == ("vmm", 64, 8)
    assert engine_config(vars(args), block_size=128).block_size == 128


def test_generate_prints_a_continuation(capsys):
    assert main(["generate", "--model", "tiny", "--backend", "paged", "--max-tokens", "8", "some prompt"]) == 0
    out = capsys.readouterr().out
    assert out.strip()


def test_generate_parallel_samples_print_one_line_each(capsys):
    assert main(["generate", "--model", "tiny", "--backend", "vmm", "--max-tokens", "4", "--n", "3",
                 "--temperature", "1.0", "--sample-seed", "1", "hello"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line[:3] for line in lines] == ["[0]", "[1]", "[2]"]


def test_bench_suite_perf_without_the_package_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kvlab.experiments.bench.perf.__main__", None)  # import raises ModuleNotFoundError
    assert main(["bench", "--suite", "perf"]) == 2
    assert "python -m kvlab.experiments.bench.perf" in one_error_line(capsys)


def test_bench_suite_perf_calls_the_benchmarks_main(monkeypatch, tmp_path):
    calls = []
    fake = types.ModuleType("kvlab.experiments.bench.perf.__main__")
    fake.main = lambda argv: calls.append(argv) or 0
    monkeypatch.setitem(sys.modules, "kvlab.experiments.bench.perf.__main__", fake)
    assert main(["bench", "--suite", "perf", "--out", str(tmp_path)]) == 0
    assert main(["bench", "--suite", "perf", "--threads", "2"]) == 0
    assert calls == [["--out", str(tmp_path)], ["--threads", "2"]]
