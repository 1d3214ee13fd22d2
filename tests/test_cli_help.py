"""`kvlab --help` and a bad command name answer without importing torch, from summaries that match the
subcommands' own help; every subcommand is listed in the README's command list."""
import subprocess
import sys
from pathlib import Path

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


def test_bench_help_parses_without_torch():
    """The bench parser reads the engine config's choices (kv_cache_dtype names from common/kv/dtype_names.py), not
    the torch dtypes behind them: its help took 1.9 s when it imported torch, 0.5 s without."""
    probe = ("import sys\nfrom kvlab.experiments.cli.main import main\ntry:\n    main(['bench', '--help'])\n"
             "except SystemExit:\n    pass\nprint('torch imported' if 'torch' in sys.modules else 'no torch', "
             "file=sys.stderr)")
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "--kv-cache-dtype" in shown.stdout and shown.stderr.strip().endswith("no torch"), shown.stderr
