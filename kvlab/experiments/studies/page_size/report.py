"""The printed report: the profiles' sources, one table per cell at the profile's own costs, the kernel-ratio
curve with the published figures placed on it, then the verdict paragraph."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.kernel_evidence import MARKS
from kvlab.experiments.sim.kernels import kernel_profile
from kvlab.experiments.sim.layouts import CROSS_LAYER
from kvlab.experiments.sim.serve.costs import profile
from kvlab.experiments.studies.page_size.settings import StudySettings


def bracket(pair: list[float] | None, fmt: str) -> str:
    return "-" if not pair else f"[{format(pair[0], fmt)}, {format(pair[1], fmt)}]"


def cell_table(label: str, cell: dict[str, Any]) -> str:
    from kvlab.experiments.reporting.tables import table
    body = []
    for unit, u in cell["units"].items():
        r = u["ratio_to_best_paged"]
        body.append([unit, u["tokens_per_unit"], f"{u['slo_rate']:.3g} {bracket(u['slo_rate_ci95'], '.3g')}",
                     f"{u['output_throughput']:.4g}", f"{r['ratio']:.3f} {bracket(r['ci95'], '.3f')}"])
    head = ["unit", "tokens/unit", "SLO rate req/s [95% CI]", "output tok/s", f"x {cell['best_paged']} [95% CI]"]
    return table(head, body, f"{label}: at the profile's own costs")


def effects_table(label: str, found: list[dict[str, Any]]) -> str:
    from kvlab.experiments.reporting.tables import table
    body = [[e["effect"], e["over"], f"{e['ratio']:.3f} {bracket(e['ci95'], '.3f')}"] for e in found]
    return table(["effect", "SLO rates", "ratio [95% CI]"], body, f"{label}: layout and elasticity apart")


def curve_table(label: str, c: dict[str, Any]) -> str:
    from kvlab.experiments.reporting.tables import table
    vmm = list(c["break_even"])
    body = [[f"{p['kernel_ratio']:g}", p["best_paged"],
             *(f"{p['vmm'][u]['ratio']:.3f} {bracket(p['vmm'][u]['ci95'], '.3f')}" for u in vmm)]
            for p in c["points"]]
    return table(["r", "best paged", *(f"{u} / best paged [95% CI]" for u in vmm)], body,
                 f"{label}: vmm/paged SLO rate against r = paged/contiguous decode kernel time (16-token blocks)")


def marks_text() -> str:
    lines = ["Published figures on the r axis (docs/evidence.md):"]
    for name, lo, hi in MARKS:
        lines.append(f"  r = {lo:g}" + (f"-{hi:g}" if hi != lo else "") + f": {name}")
    return "\n".join(lines)


def sources(s: StudySettings) -> str:
    lines = []
    for driver in dict.fromkeys(c.driver for c in s.cells):
        p = profile(driver, s.spec.calibration, s.vmm_pages[0] if s.vmm_pages else None)
        lines.append(f"driver profile {driver}: {p.source}")
    for kernel in dict.fromkeys(c.kernel for c in s.cells):
        k = kernel_profile(kernel)
        lines.append(f"kernel profile {kernel}: {k.source if k else 'no kernel term'}")
    return "\n".join(lines)


def report(s: StudySettings, result: dict[str, Any]) -> str:
    spec = s.spec
    goal = ", ".join(f"{k} <= {v:g}" for k, v in s.slo.items())
    head = (f"{spec.model} on {spec.hardware}, {spec.num_requests} requests a run ({spec.dataset}), "
            f"{len(s.seeds)} paired seeds, KV budget {s.budget_gb:g} GB per GPU, SLO {goal}, background mapping "
            f"{'on' if spec.background_mapping else 'off'}")
    if spec.layout_penalty != "none" and CROSS_LAYER in s.vmm_layouts:
        head += f", cross-layer attention penalty {spec.layout_penalty}"
    parts = [head, sources(s)]
    for label, cell in result["cells"].items():
        parts.append(cell_table(label, cell))
        if cell.get("elastic_effects"):
            parts.append(effects_table(label, cell["elastic_effects"]))
        if cell.get("curve"):
            parts.append(curve_table(label, cell["curve"]))
    if any(c.get("curve") for c in result["cells"].values()):
        parts.append(marks_text())
    parts += ["Verdict: " + result["verdict"], f"({result['host_seconds']:.0f} s host time)"]
    if result.get("interrupted"):
        parts.append(result["interrupted"])
    return "\n\n".join(parts)
