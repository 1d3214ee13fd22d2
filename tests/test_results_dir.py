"""Every experiment writes its files to results/<timestamp>/ by default and says where; progress never floods a log."""
import io

from kvlab.experiments.cli.main import main
from kvlab.experiments.reporting.tables import progress_bar, results_dir


def test_simulate_writes_a_results_directory_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--policies", "paged", "--num-requests", "20", "--no-progress", "--jobs", "1"]) == 0
    (out,) = (tmp_path / "results").iterdir()
    assert {p.name for p in out.iterdir()} == {"provenance.json", "rows.json", "batch.png", "report.txt"}
    from helpers.provenance_check import read_back
    config = read_back(out, "rows.json", "simulate")
    assert config["policies"] == ["paged"] and config["settings"]["workload"]["num_requests"] == 20
    assert f"results in {out.relative_to(tmp_path)}/" in capsys.readouterr().out


def test_results_dir_never_reuses_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = results_dir(None)
    first.mkdir(parents=True)
    assert results_dir(None) != first
    assert results_dir("given") == tmp_path.joinpath("given").relative_to(tmp_path)


def test_progress_in_a_log_writes_rarely(monkeypatch):
    log = io.StringIO()
    bar = progress_bar(total=1000, file=log)
    for _ in range(1000):
        bar.update(1)
    bar.close()
    assert log.getvalue().count("\r") < 5


def test_a_bar_that_erases_itself_on_a_terminal_ends_with_its_last_line_in_a_log():
    log = io.StringIO()
    for _ in progress_bar(range(40), file=log, desc="deciding", leave=False):
        pass
    assert log.getvalue().endswith("\n") and log.getvalue().rstrip().rsplit("\r", 1)[-1].startswith("deciding: 100%")


def test_a_bar_in_a_log_does_not_write_a_line_for_each_new_label():
    log = io.StringIO()
    bar = progress_bar(total=200, file=log, desc="sharing")
    for i in range(200):
        bar.set_postfix_str(f"run {i}")
        bar.set_description(f"repeat {i}")
        bar.update(1)
    bar.close()
    assert log.getvalue().count("\r") < 5 and "run 199" in log.getvalue()
