"""Tensor-parallel workers are fresh interpreters running `python -m kvlab.common.dist.worker`, never the user's
__main__: tp=2 runs from a guarded script, an unguarded one, standard input and an interactive interpreter, gives
tp=1's greedy tokens and leaves no process after close(). SIGTERM to `kvlab generate --tensor-parallel-size 2`
stops every rank and exits 143 without a leaked-resource warning. Each case starts processes (~20 s on 2 cores):
the unguarded script and SIGTERM run by default, the other launch contexts are `slow`."""
from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.processes import alive, children, command_line

from kvlab.common.dist.launch import WORKER_MODULE
from kvlab.common.llm import LLM
from kvlab.common.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"backend": "paged", "max_model_len": 128, "kv_cache_bytes": 1 << 20}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
# one statement per line, so the same lines run as a script, from stdin and typed into the interactive prompt
LINES = [
    "import os",
    "from kvlab import LLM, SamplingParams",
    f"llm = LLM(tensor_parallel_size=2, **{CONFIG!r})",
    f"outs = llm.generate({PROMPTS!r}, SamplingParams(**{GREEDY!r}))",
    "llm.close()",
    "me = os.getpid()",
    "print('RESULT', ([o.outputs[0].token_ids for o in outs], open(f'/proc/{me}/task/{me}/children').read().split()))",
]


def guarded() -> str:
    return "\n".join([*LINES[:2], 'if __name__ == "__main__":', *("    " + line for line in LINES[2:])]) + "\n"


def launch(how: str, folder: Path) -> subprocess.CompletedProcess:
    script = folder / "user_script.py"
    script.write_text(guarded() if how == "guarded" else "\n".join(LINES) + "\n")
    argv, stdin = {"guarded": ([str(script)], None), "unguarded": ([str(script)], None),
                   "stdin": (["-"], script.read_text()), "interactive": (["-i"], "\n".join(LINES) + "\n")}[how]
    return subprocess.run([sys.executable, *argv], input=stdin, cwd=folder, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def tp1_tokens() -> list[list[int]]:
    with LLM(**CONFIG) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY))]


@pytest.mark.parametrize("how", [pytest.param("guarded", marks=pytest.mark.slow),   # ~8 s each; test_tp.py runs
                                 pytest.param("unguarded", marks=pytest.mark.slow),   # tp2 in the default suite
                                 pytest.param("stdin", marks=pytest.mark.slow),
                                 pytest.param("interactive", marks=pytest.mark.slow)])
def test_tp2_runs_from_any_main_and_leaves_no_process(how, tmp_path, tp1_tokens):
    done = launch(how, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if "RESULT" in x)
    tokens, kids = ast.literal_eval(line[line.index("RESULT") + len("RESULT"):].strip())
    assert tokens == tp1_tokens
    assert kids == [], "a worker outlived close()"
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr, done.stderr[-2000:]


def tp_workers(pid: int) -> list[int]:
    """The children of `pid` running the worker module. Not any child: while kvlab imports, ctypes.util.find_library
    runs `ldconfig -p` (twice), and a SIGTERM sent once that child was seen came before rank 0's handler (exit -15)."""
    return [c for c in children(pid) if WORKER_MODULE in command_line(c)]


def test_sigterm_to_generate_tp2_stops_every_rank_and_exits_143():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "kvlab.experiments.cli.main", "generate", "--model", "tiny",
                             "--tensor-parallel-size", "2", "--max-tokens", "1000", "--ignore-eos", "hello"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not tp_workers(proc.pid) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        workers = tp_workers(proc.pid)
        early = proc.poll()
        assert workers, f"the worker never started (exit {early}): " + (proc.stderr.read()[-1500:] if early is not None
                                                                         else "still running")
        time.sleep(5)           # the worker runs, so rank 0's handler is in: into start-up or the first steps, alike
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err
    assert "SIGTERM: stopping every tensor-parallel rank" in err
    assert "Traceback" not in err and "leaked" not in err, err
    assert not [w for w in workers if alive(w)]
