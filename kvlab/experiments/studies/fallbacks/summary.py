"""The fallback study's summary: chosen kernels, fallbacks by cause, fallback paths and example findings."""
from __future__ import annotations

from collections import Counter

from kvlab.experiments.studies.fallbacks.decisions import CAUSES
from kvlab.experiments.studies.fallbacks.grid import NUM_KV_HEADS, Grid, Row, Scenario, causes_of, row_key


def kernel_counts(rows: list[Row]) -> dict[tuple[str, str, str], Counter]:
    counts: dict[tuple[str, str, str], Counter] = {}
    for r in rows:
        counts.setdefault((r.scenario, r.backend, r.phase), Counter())[r.kernel] += 1
    return counts


def cause_counts(rows: list[Row]) -> dict[tuple[str, str], Counter]:
    """Per scenario and backend: decisions, fallbacks, and fallbacks per rule family (a decision refused for
    two reasons counts under both)."""
    counts: dict[tuple[str, str], Counter] = {}
    for r in rows:
        c = counts.setdefault((r.scenario, r.backend), Counter())
        c["decisions"] += 1
        if r.fallback:
            c["fallbacks"] += 1
            c.update(r.causes)
    return counts


def fallback_paths(rows: list[Row]) -> Counter:
    """Distinct (scenario, backend, phase, chosen kernel, displaced kernels with causes) and how often."""
    paths: Counter = Counter()
    for r in rows:
        if r.fallback:
            displaced = tuple(f"{k} [{', '.join(causes_of(rs))}]" for k, rs in r.reasons.items())
            paths[(r.scenario, r.backend, r.phase, r.kernel, displaced)] += 1
    return paths


def shared_paths(rows: list[Row]) -> dict[tuple, list[str]]:
    """fallback_paths with the backends that took a path equally often on one line (paged and elastic run the
    same kernels): (count, scenario, phase, chosen, displaced) -> backends, most frequent first."""
    grouped: dict[tuple, list[str]] = {}
    for (scen, backend, phase, kernel, displaced), n in fallback_paths(rows).most_common():
        grouped.setdefault((n, scen, phase, kernel, displaced), []).append(backend)
    return grouped


def gqa_sensitivity(rows: list[Row]) -> int:
    """How many (scenario, backend, phase, head_dim, dtype, block) points change kernel with the GQA ratio."""
    kernels: dict[tuple, set[str]] = {}
    for r in rows:
        kernels.setdefault(row_key(r)[:-1], set()).add(r.kernel)
    return sum(len(v) > 1 for v in kernels.values())


def describe(row: Row) -> str:
    pad = f" (computes with head_dim {row.kernel_head_dim})" if row.kernel_head_dim != row.head_dim else ""
    block = f", block {row.block_size}" if row.block_size is not None else ""
    text = (f"[{row.scenario}] {row.backend} {row.phase}, head_dim {row.head_dim}, {row.dtype}{block}, "
            f"GQA {row.gqa_ratio}: {row.kernel}{pad}")
    if row.displaced:
        text += "; displaced " + "; ".join(f"{k} ({', '.join(rs)})" for k, rs in row.reasons.items())
    return text


def at(scenario: str, backend: str, phase: str, head_dim: int, dtype: str, block: int | None,
       kv_dtype: str = "auto") -> tuple:
    """A row key at GQA 4."""
    return (scenario, backend, phase, head_dim, dtype, block, kv_dtype, 4)


# The example findings the study calls out, each looked up in the decided rows.
FINDINGS = [
    ("head_dim 80 on flash-attn paged kernels (page 256: padded to 96; page 16: refused; FlashInfer: no 80)",
     [at("cuda+fa+fi", "paged", "decode", 80, "bfloat16", 256),
      at("cuda+fa+fi", "paged", "decode", 80, "bfloat16", 16)]),
    ("an fp32 model",
     [at("cuda+fa+fi", "paged", "decode", 128, "float32", 256),
      at("cuda+fa+fi", "vmm", "decode", 128, "float32", None)]),
    ("block size 16 refused by upstream flash-attn's paged path (elastic's blocks alike)",
     [at("cuda+fa+fi", "paged", "decode", 128, "bfloat16", 16),
      at("cuda+fa+fi", "elastic", "decode", 128, "bfloat16", 16)]),
    ("a missing package (this machine's packages on an H200)",
     [at("cuda", "paged", "decode", 128, "bfloat16", 256),
      at("cuda", "vmm", "decode", 128, "bfloat16", None)]),
    ("head_dim 100: decode and prefill get different kernels",
     [at("cuda+fa+fi", "paged", "decode", 100, "bfloat16", 256),
      at("cuda+fa+fi", "paged", "prefill", 100, "bfloat16", 256)]),
]


def findings(rows: list[Row]) -> list[tuple[str, list[str]]]:
    index = {row_key(r): r for r in rows}
    out = []
    for title, keys in FINDINGS:
        found = [describe(index[k]) for k in keys if k in index]
        if found:
            out.append((title, found))
    return out


def format_summary(rows: list[Row], scenarios: list[Scenario], grid: Grid) -> str:
    lines = [(f"kvlab fallbacks: {len(rows):,} decisions; head_dim {list(grid.head_dims)}, "
              f"dtype {list(grid.dtypes)}, block {list(grid.block_sizes)} (paged only), "
              f"GQA {list(grid.gqa_ratios)} (H_kv={NUM_KV_HEADS}); backends "
              f"{', '.join(dict.fromkeys(r.backend for r in rows))}; prefill and decode"), ""]
    lines += ["Scenarios"] + [f"  {s.name:<11} {s.label}; packages {', '.join(sorted(s.env.packages or ()))}"
                              for s in scenarios] + [""]
    lines.append("Chosen kernel (number of decisions)")
    for (scen, backend, phase), c in kernel_counts(rows).items():
        kernels = ", ".join(f"{k} {n}" for k, n in c.most_common())
        lines.append(f"  {scen:<11} {backend:<7} {phase:<8} {kernels}")
    lines += ["", "Fallbacks by cause (a decision refused for several reasons counts under each)"]
    counts = cause_counts(rows)
    causes = [c for c in CAUSES if any(cc[c] for cc in counts.values())]
    header = ["scenario".ljust(11), "backend".ljust(7), "decisions", "fallbacks", *causes]
    lines.append("  " + " ".join(f"{h:>9}" for h in header))
    for (scen, backend), c in counts.items():
        cells = [scen.ljust(11), backend.ljust(7), c["decisions"], c["fallbacks"], *(c[x] for x in causes)]
        lines.append("  " + " ".join(f"{v:>{max(9, len(h))}}" for v, h in zip(cells, header, strict=True)))
    lines += ["", "Fallback paths (chosen <- displaced [causes]), most frequent first; backends joined by + took "
              "the same path as often"]
    for (n, scen, phase, kernel, displaced), backends in list(shared_paths(rows).items())[:12]:
        lines.append(f"  {n:>5}  {scen:<11} {'+'.join(backends):<13} {phase:<8} {kernel} <- {'; '.join(displaced)}")
    lines += ["", f"The GQA ratio changed the kernel at {gqa_sensitivity(rows)} of the other grid points", ""]
    lines.append("Example findings")
    for title, found in findings(rows):
        lines.append(f"  * {title}")
        lines += [f"      {text}" for text in found]
    return "\n".join(lines)
