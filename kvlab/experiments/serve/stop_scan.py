"""How much decoded text to hold back while it may be the start of a stop string: a Knuth-Morris-Pratt automaton
per stop string, fed only the new text of each token. A stop string costs its length once (its border table),
and each decoded character O(1) amortized, however long the stop string is: the hold-back it replaces rebuilt
every prefix of every stop string per token (a 1 MB stop string took 62.6 s of the event loop)."""
from __future__ import annotations


def borders(stop: str) -> list[int]:
    """borders[i]: the length of the longest proper prefix of stop[:i + 1] that is also its suffix."""
    table, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class StopScan:
    """`matched`: the length of the longest end of the text fed so far that is a prefix of the stop string."""

    def __init__(self, stop: str, table: list[int]) -> None:
        self.stop, self.table, self.matched = stop, table, 0

    def feed(self, text: str) -> None:
        stop, table, k = self.stop, self.table, self.matched
        for c in text:
            if k == len(stop):                   # a whole match: go on from its longest border
                k = table[k - 1]
            while k and c != stop[k]:
                k = table[k - 1]
            if c == stop[k]:
                k += 1
        self.matched = k

    def held(self) -> int:
        """Characters to hold back (the caller cuts a whole match before asking)."""
        return min(self.matched, len(self.stop) - 1)
