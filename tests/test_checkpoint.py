"""Long runs keep what they did: points.jsonl as they finish, partial.txt when stopped, --resume runs the rest."""
import json

import pytest

from kvlab.common.errors import ConfigError
from kvlab.experiments.reporting.checkpoint import (
    HEADER,
    PARTIAL,
    POINTS,
    Checkpoint,
    keeping,
    resumed_argv,
    without_resume,
)
from kvlab.experiments.sim.serve.grid import Saved, pool_map

ARGV = ["simulate", "serve", "--num-prompts", "10", "--out", "X"]


def square(x: int) -> dict:
    return {"x": x, "output_throughput": float(x * x)}


def test_points_are_kept_as_they_finish_and_a_resume_runs_only_the_rest(tmp_path):
    first = Checkpoint(tmp_path, ARGV, {"n": 10}, total=4, resume=False)
    saved = Saved(first, lambda x: f"point {x}")
    assert pool_map(square, [1, 2], 1, saved=saved) == [square(1), square(2)]
    assert len((tmp_path / POINTS).read_text().splitlines()) == 2
    calls = []

    def counted(x):
        calls.append(x)
        return square(x)
    again = Checkpoint(tmp_path, ARGV, {"n": 10}, total=4, resume=True)
    assert pool_map(counted, [1, 2, 3, 4], 1, saved=Saved(again, lambda x: f"point {x}")) == \
        [square(x) for x in (1, 2, 3, 4)]
    assert calls == [3, 4] and again.resumed == 2


def test_an_interrupt_leaves_a_readable_partial_report(tmp_path):
    cp = Checkpoint(tmp_path, ARGV, {}, total=3, resume=False)
    with pytest.raises(KeyboardInterrupt):
        with keeping(cp, "simulate serve"):
            cp.record("paged-16 rate 4 seed 0", {"request_rate": 4.0, "p99_ttft_ms": 81.5})
            raise KeyboardInterrupt
    text = (tmp_path / PARTIAL).read_text()
    assert "interrupted after 1 of 3 points" in text and f"--resume {tmp_path}" in text
    assert "paged-16 rate 4 seed 0: request_rate 4, p99_ttft_ms 81.5" in text
    with keeping(cp, "simulate serve"):          # a finished run removes the stale partial report
        pass
    assert not (tmp_path / PARTIAL).exists()


def test_resume_reruns_the_stored_command_line_and_refuses_another_configuration(tmp_path):
    Checkpoint(tmp_path, [*ARGV, "--resume", "old"], {"n": 10}, total=1, resume=False)
    assert json.loads((tmp_path / HEADER).read_text())["argv"] == ARGV
    assert resumed_argv(["simulate", "serve", "--resume", str(tmp_path), "--jobs", "1"]) == \
        [*ARGV, "--jobs", "1", "--resume", str(tmp_path)]
    assert without_resume(["a", "--resume", "d", "--resume=e", "b"]) == ["a", "b"]
    with pytest.raises(ConfigError, match="computed something else"):
        Checkpoint(tmp_path, ARGV, {"n": 11}, total=1, resume=True)
    elsewhere = ["simulate", "serve", "--resume", str(tmp_path / "none")]
    assert resumed_argv(elsewhere) == elsewhere            # left to the command: its own journal, or the error below
    with pytest.raises(ConfigError, match="no checkpoint.json"):
        Checkpoint(tmp_path / "none", ARGV, {"n": 10}, total=1, resume=True)


def test_a_line_cut_by_a_kill_is_dropped_and_that_point_runs_again(tmp_path):
    cp = Checkpoint(tmp_path, ARGV, {}, total=2, resume=False)
    cp.record("a", 1)
    with open(tmp_path / POINTS, "a") as f:
        f.write('{"key": "b", "resu')
    again = Checkpoint(tmp_path, ARGV, {}, total=2, resume=True)
    assert "a" in again and "b" not in again
    again.record("b", 2)
    assert Checkpoint(tmp_path, ARGV, {}, total=2, resume=True).points == {"a": 1, "b": 2}
