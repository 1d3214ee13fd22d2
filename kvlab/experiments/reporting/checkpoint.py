"""Long runs keep what they did: every finished point is appended to points.jsonl in the results directory as
it finishes, an interrupted run (Ctrl-C, SIGTERM, a `timeout`) leaves partial.txt (the finished points in a
table and the command that resumes), and `--resume DIR` runs only the points DIR does not hold yet.

Used by `simulate serve`, `simulate pool`, `simulate pd` (through sim/serve/grid.py) and `bench serve`'s sweep.
checkpoint.json holds the command line and the run's configuration (what it computes, not where it writes): a
resume re-runs that command line, and refuses when the configuration it resolves to differs."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvlab.common.errors import ConfigError

HEADER = "checkpoint.json"
POINTS = "points.jsonl"
PARTIAL = "partial.txt"
SHOWN = ("request_rate", "seed", "slo_rate", "completed", "output_throughput", "request_goodput", "p99_ttft_ms",
         "p99_tpot_ms")      # the figures partial.txt shows per point, where a point has them


def resumed_argv(argv: list[str]) -> list[str]:
    """`kvlab CMD --resume DIR [flags]` -> the command line DIR was started with, then the given flags, then
    `--resume DIR` (argparse takes the last of a repeated flag). Anything without --resume, or whose DIR holds no
    checkpoint.json, is returned as is."""
    if "--resume" not in argv:
        return argv
    i = argv.index("--resume")
    if i + 1 >= len(argv):
        return argv                     # argparse reports the missing value
    where = Path(argv[i + 1])
    if not (where / HEADER).exists():
        return argv                     # a command that keeps its own journal (the study), or the command's error
    header = read_header(where)
    first_flag = next((k for k, a in enumerate(argv) if a.startswith("-")), i)
    return [*header["argv"], *argv[first_flag:i], *argv[i + 2:], "--resume", str(where)]


def without_resume(argv: Sequence[str]) -> list[str]:
    """The command line to store: as given, less `--resume DIR` (a resumed run stores what it resumed)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            out.append(arg)
    return out


def read_header(where: Path) -> dict[str, Any]:
    try:
        header = json.loads((where / HEADER).read_text())
    except (OSError, ValueError):
        raise ConfigError(f"--resume {where}: no {HEADER} there (not a results directory of a run that "
                          "checkpoints, or not started)") from None
    if not isinstance(header, dict) or not isinstance(header.get("argv"), list):
        raise ConfigError(f"--resume {where}: {HEADER} is not a kvlab checkpoint")
    return header


class Checkpoint:
    """One run's finished points, by key (a short text naming the point, e.g. `paged-16 rate 4 seed 0`)."""

    def __init__(self, out: Path, argv: Sequence[str], config: dict[str, Any], total: int, resume: bool) -> None:
        self.out, self.total = Path(out), total
        self.points: dict[str, Any] = {}
        self.out.mkdir(parents=True, exist_ok=True)
        if resume:
            self._load(config)
        else:
            (self.out / POINTS).unlink(missing_ok=True)
        header = {"argv": without_resume(argv), "config": config, "total": total}
        (self.out / HEADER).write_text(json.dumps(header, indent=1, default=str))
        self.resumed = len(self.points)

    def _load(self, config: dict[str, Any]) -> None:
        header = read_header(self.out)
        if json.loads(json.dumps(header.get("config"), default=str)) != json.loads(json.dumps(config, default=str)):
            raise ConfigError(f"--resume {self.out}: that run computed something else (its configuration in "
                              f"{HEADER} differs from this one); start a new run with --out")
        path = self.out / POINTS
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue                # a line cut by a kill mid-write: that point runs again
            self.points[record["key"]] = record["result"]
        if lines:                       # rewrite without a cut line, so later appends start on a line of their own
            path.write_text("".join(json.dumps({"key": k, "result": r}, default=str) + "\n"
                                    for k, r in self.points.items()))

    def __contains__(self, key: str) -> bool:
        return key in self.points

    def get(self, key: str) -> Any:
        return self.points[key]

    def record(self, key: str, result: Any) -> None:
        from kvlab.experiments.reporting.provenance import jsonable
        self.points[key] = result
        with open(self.out / POINTS, "a") as f:
            f.write(json.dumps({"key": key, "result": jsonable(result)}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finished(self) -> None:
        """The run completed: its full results are written; the partial report (from an earlier stop) goes."""
        (self.out / PARTIAL).unlink(missing_ok=True)

    def partial_report(self, command: str) -> str:
        lines = [f"{command}: interrupted after {len(self.points)} of {self.total} points "
                 f"({self.resumed} from an earlier run); every finished point is in {self.out / POINTS}",
                 f"resume with: kvlab {command.removeprefix('kvlab ')} --resume {self.out}", ""]
        lines += [point_line(key, result) for key, result in self.points.items()]
        return "\n".join(lines)

    def write_partial(self, command: str) -> Path:
        path = self.out / PARTIAL
        path.write_text(self.partial_report(command) + "\n")
        return path


def point_line(key: str, result: Any) -> str:
    if not isinstance(result, dict):
        return key
    shown = [f"{k} {fmt(result[k])}" for k in SHOWN if isinstance(result.get(k), (int, float))]
    return f"{key}: {', '.join(shown)}" if shown else key


def fmt(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


@contextlib.contextmanager
def keeping(checkpoint: Checkpoint | None, command: str) -> Iterator[None]:
    """Around a checkpointed run: SIGTERM stops it as Ctrl-C does, and either leaves partial.txt and a line
    saying where, before the interrupt goes on to the CLI's one line and exit 130."""
    if checkpoint is None:
        yield
        return
    with sigterm_interrupts():
        try:
            yield
        except KeyboardInterrupt:
            path = checkpoint.write_partial(command)
            print(f"\n{command}: {len(checkpoint.points)} of {checkpoint.total} points finished, kept in "
                  f"{checkpoint.out}/ ({path.name}); resume with --resume {checkpoint.out}", flush=True)
            raise
    checkpoint.finished()


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a `timeout`, a job scheduler) raises KeyboardInterrupt in the main thread, so it unwinds as a
    Ctrl-C; a forked worker that inherits the handler dies as by default. The previous handler comes back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def interrupt(sig: int, frame: Any) -> None:
        if os.getpid() != owner:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
