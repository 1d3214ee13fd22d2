"""The `kvlab` command (its subcommands: experiments/cli/commands.py).

Each subcommand lives in its own module with `add_parser(subparsers)` and `run(args) -> int`; the flags they
share are in cli/flags.py. Only the module of the subcommand being run is imported: `kvlab --help` and a bad
command name print from the summaries in commands.py without importing torch. Any KvlabError, and any bad flag
value, becomes one line on stderr and exit code 2.
"""
from __future__ import annotations

if __name__ == "__main__":  # python -m kvlab.experiments.cli.main: a Ctrl-C during the imports below is one line
    from kvlab.experiments.cli.startup import guard_startup
    guard_startup()

import argparse
import importlib
import logging
import sys
from collections.abc import Collection
from typing import Any

from kvlab.common.errors import ConfigError, KvlabError
from kvlab.common.kv.registry import BUILTIN
from kvlab.experiments.cli.commands import COMMANDS, chosen_command
from kvlab.experiments.cli.parser import KvlabParser, first_line
from kvlab.experiments.cli.startup import end_startup

SUBCOMMANDS = {name: command.module for name, command in COMMANDS.items()}   # subcommand -> its module


def missing_subcommand(name: str, reason: str):
    """Registered in place of a subcommand whose module is not available; fails clearly when used."""
    def run(args: argparse.Namespace) -> int:
        raise ConfigError(f"`kvlab {name}` is unavailable: {reason}")
    return run


def register(subparsers: Any, name: str) -> None:
    module_name = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        logging.getLogger("kvlab").warning("subcommand %s disabled: %s is missing", name, module_name)
        p = subparsers.add_parser(name, help=f"(unavailable: {module_name} is missing)")
        p.set_defaults(run=missing_subcommand(name, f"{module_name} is missing"))
        return
    module.add_parser(subparsers)


def build_parser(full: Collection[str] = tuple(COMMANDS)) -> KvlabParser:
    """The parser with the subcommands in `full` complete (all by default); the others appear by name and
    summary only, so their modules are not imported."""
    parser = KvlabParser(prog="kvlab", description=f"Compare KV-cache memory managers: {', '.join(BUILTIN)}.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, entry in COMMANDS.items():
        if name in full:
            register(subparsers, name)
        else:
            subparsers.add_parser(name, help=entry.summary, add_help=False)
    return parser


def undecodable_argument(argv: list[str]) -> str | None:
    """The first argument that is not valid UTF-8 (Python keeps such bytes as lone surrogates)."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return ascii(arg)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    bad = undecodable_argument(argv)
    if bad is not None:
        print(f"kvlab: error: argument {bad} is not valid UTF-8 text", file=sys.stderr)
        return 2
    command = f"kvlab {argv[0]}" if argv and argv[0] in SUBCOMMANDS else "kvlab"
    try:
        end_startup()            # inside the try: from here on a Ctrl-C is the KeyboardInterrupt caught below
        if "--resume" in argv:
            from kvlab.experiments.reporting.checkpoint import resumed_argv
            argv = resumed_argv(argv)
        command_name = chosen_command(argv)
        parser = build_parser([command_name] if command_name else [])
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:                      # -h (0) or a usage error (2, already printed)
            return int(e.code or 0)
        command = f"kvlab {args.command}"
        args.command_line = argv         # what a checkpointing run stores for --resume (reporting/checkpoint.py)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(name)s: %(levelname)s: %(message)s")
        return int(args.run(args) or 0)
    except (KvlabError, OSError) as e:        # OSError: an unwritable --out/--json path, a missing file
        if isinstance(e.__context__, KeyboardInterrupt):      # releasing after Ctrl-C failed: the interrupt wins
            print(f"{command}: interrupted (and releasing failed: {first_line(e)})", file=sys.stderr)
            return 130
        print(f"{command}: error: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                 # every `with`/`finally` on the way out has released its engine
        print(f"{command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    status = main()
    # Under `python -m`, CPython remembers a Ctrl-C that passed through an exec/eval of a string (a dataclass or
    # namedtuple being made when it came), handled or not, and then exits by SIGINT (-2) instead of with our 130;
    # the next evaluation of a string forgets it. (The `kvlab` script exits through Py_Exit: not affected.)
    eval("None")
    sys.exit(status)
