"""Process helpers for the tests that interrupt or kill commands: a process's children and whether it lives."""
from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """Running, or anything but a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def command_line(pid: int) -> str:
    """Its arguments joined by spaces; "" once it is gone (or between its fork and its exec: still the parent's)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
