"""`kvlab --help` and a bad command name answer without importing torch, from summaries that match the
subcommands' own help; every subcommand is listed in the README's command list."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.experiments.cli.commands import COMMANDS, chosen_command
from kvlab.experiments.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import sys; from kvlab.experiments.cli.main import main; status = main(sys.argv[1:]); "
         "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_top_level_help_and_errors_do_not_import_torch():
    shown = run_cli("--help")
    assert shown.returncode == 0 and "no torch" in shown.stderr
    for name in COMMANDS:
        assert f"    {name} " in shown.stdout
    for argv in (["teleport"], [], ["-v"]):
        failed = run_cli(*argv)
        assert failed.returncode == 0, failed.stderr          # the probe's own exit; main returned 2
        lines = failed.stderr.strip().splitlines()
        assert lines[0].startswith("kvlab: error:") and lines[-1] == "no torch"


def test_a_chosen_subcommand_gets_its_full_parser():
    assert chosen_command(["-v", "bench", "--help"]) == "bench" and chosen_command(["--help"]) is None
    assert chosen_command(["teleport"]) is None
    args = build_parser(["simulate"]).parse_args(["simulate", "--policies", "paged"])
    assert args.command == "simulate"


def test_every_summary_equals_its_modules_own_help():
    full = build_parser()
    sub = next(a for a in full._actions if a.dest == "command")
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    assert helps == {name: command.summary for name, command in COMMANDS.items()}


def test_the_readme_command_list_names_every_subcommand():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("### Command line", 1)[1].split("```", 2)[1]
    for name in COMMANDS:
        assert f"kvlab {name}" in block, f"README's command list omits kvlab {name}"


def test_docs_experiments_table_names_every_subcommand():
    text = (ROOT / "docs" / "experiments.md").read_text()
    for name in COMMANDS:
        assert f"| `kvlab {name}" in text, f"docs/experiments.md's table omits kvlab {name}"


HEAVY = ("torch", "fastapi", "uvicorn", "aiohttp", "httpx")
BLOCK_TORCH = "sys.modules['torch'] = None\n"       # any `import torch` after this raises ImportError


def imported_after(argv: list[str], prelude: str = "") -> subprocess.CompletedProcess:
    """Run `kvlab argv` in a fresh interpreter; its stderr ends with the HEAVY modules it imported."""
    probe = (f"import sys\n{prelude}from kvlab.experiments.cli.main import main\ntry:\n    status = main({argv!r})\n"
             f"except SystemExit as e:\n    status = e.code\nprint('status', status, file=sys.stderr)\n"
             f"print('heavy', sorted(m for m in {HEAVY!r} if sys.modules.get(m)), file=sys.stderr)")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize(("argv", "flag", "forbidden"), [
    (["bench", "--help"], "--kv-cache-dtype", ("torch",)),    # `bench serve`'s flags live with the HTTP client
    (["simulate", "--help"], "--policies", HEAVY),
    (["simulate", "serve", "--help"], "--slo", HEAVY),
    (["serve", "--help"], "--max-waiting", HEAVY)])
def test_subcommand_help_imports_neither_torch_nor_the_http_stack(argv, flag, forbidden):
    """The parsers read names (dtype names from common/kv/dtype_names.py, the hardware and model tables), not the
    modules that run: bench's help took 1.9 s when it imported torch, simulate's 3.8 s and serve's 3.0 s."""
    shown = imported_after(argv)
    heavy = ast.literal_eval(shown.stderr.strip().splitlines()[-1].removeprefix("heavy "))
    assert flag in shown.stdout and not set(heavy) & set(forbidden), shown.stderr


def test_the_simulator_runs_without_torch():
    """Accounting-only caches size their units from dtype names, so a simulated run never imports torch (nor the
    load generator's HTTP client): the SLO search's start-up no longer pays for either."""
    shown = imported_after(["simulate", "serve", "--backends", "paged-16,vmm-2MiB", "--num-prompts", "20",
                            "--request-rate", "4", "--no-progress", "--no-save", "--no-plots"], BLOCK_TORCH)
    assert "status 0" in shown.stderr and shown.stderr.strip().endswith("heavy []"), shown.stderr
