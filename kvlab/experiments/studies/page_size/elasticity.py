"""The optional elastic arm (`--elastic-blocks`): paged blocks and kernels over pages mapped on demand, one unit
per block size and vmm page size (elastic-16-2MiB). Beside paged and vmm it splits vmm's difference from paged in
two, each a ratio of SLO rates paired by seed with a bootstrap 95% interval (sim/serve/summary.py):

- elasticity at the paged layout: elastic-B-P / paged-B (the same block; the best paged unit when B is not in the
  grid): what mapping on demand costs or buys with the kernels held fixed;
- contiguity at elastic memory: vmm-P / elastic-B-P (the same page): what the contiguous layout and its kernels
  buy with the memory policy held fixed.

vmm-P / best paged is then roughly their product; docs/architecture.md "The 2x2" has the same split on real runs."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.serve.summary import slo_summary

PREFIX = "elastic-"


def unit_parts(unit: str) -> tuple[str, str]:
    """elastic-16-2MiB -> ("16", "2MiB")."""
    block, page = unit[len(PREFIX):].split("-", 1)
    return block, page


def paired(rates: dict[str, list[float]], top: str, bottom: str, effect: str) -> dict[str, Any]:
    ratio = slo_summary({top: rates[top], bottom: rates[bottom]}, bottom)["ratios"][top]
    return {"effect": effect, "over": f"{top} / {bottom}", "ratio": ratio["ratio"], "ci95": ratio["ci95"]}


def effects(rates: dict[str, list[float]], best_paged: str) -> list[dict[str, Any]]:
    """Each complete elastic unit's two effects (`rates`: unit -> SLO rate per seed, every unit complete)."""
    out = []
    for unit in (u for u in rates if u.startswith(PREFIX)):
        block, page = unit_parts(unit)
        same_block = f"paged-{block}"
        out.append(paired(rates, unit, same_block if same_block in rates else best_paged,
                          "elasticity, paged layout"))
        if f"vmm-{page}" in rates:
            out.append(paired(rates, f"vmm-{page}", unit, "contiguity, elastic memory"))
    return out


def sentence(label: str, found: list[dict[str, Any]]) -> str:
    parts = [f"{e['effect']} {e['over']} = {e['ratio']:.3f} [{e['ci95'][0]:.3f}, {e['ci95'][1]:.3f}]"
             for e in found]
    return f"Split by the elastic arm under {label}: " + "; ".join(parts) + "."
