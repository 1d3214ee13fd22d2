"""The `kvlab` argument parser class and the one-line error text, standard library only so that `kvlab --help`
and a usage error never import torch (experiments/cli/main.py builds the top level from these alone)."""
from __future__ import annotations

import argparse
from typing import NoReturn


class KvlabParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
