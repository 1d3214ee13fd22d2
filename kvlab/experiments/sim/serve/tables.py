"""`kvlab simulate serve`'s tables: the rate grid and the SLO search, each with its settings line and, where a vmm
row applies 2 MiB driver figures to smaller pages, the footnote that marks them as extrapolations."""
from __future__ import annotations

from typing import Any

from kvlab.experiments.sim.core import SimCase
from kvlab.experiments.sim.serve.costs import PROFILES, extrapolated, extrapolation_note, profile
from kvlab.experiments.sim.serve.measured_driver import is_measured
from kvlab.experiments.sim.serve.run import ServeSpec, rate_label


def extrapolation_footnote(spec: ServeSpec, cases: list[SimCase]) -> tuple[str, set[str]]:
    """('' or a line naming the rows whose driver latencies are extrapolated below 2 MiB, those rows' labels)."""
    if spec.driver_profile not in PROFILES and not is_measured(spec.driver_profile):
        return "", set()
    prof = profile(spec.driver_profile)
    pages = [(c.backend_label, c.options.get("page_size")) for c in cases if c.policy == "vmm"]
    note = extrapolation_note(prof, pages)
    return ("\n" + note if note else ""), {label for label, page in pages if extrapolated(prof, page)}


def marked(label: str, labels: set[str]) -> str:
    """A row's label with '*' when its driver latencies are extrapolated (the footnote says so)."""
    return f"{label} *" if label in labels else label


def profile_line(spec: ServeSpec) -> str:
    prof = profile(spec.driver_profile) if is_measured(spec.driver_profile) else PROFILES.get(spec.driver_profile)
    src = prof.source if prof else "kvlab calibrate"
    on = f"{spec.tensor_parallel_size} x {spec.hardware} (tensor parallel, GB per GPU)" \
        if spec.tensor_parallel_size > 1 else spec.hardware
    limit = f", max concurrency {spec.max_concurrency}" if spec.max_concurrency else ""
    return (f"{spec.num_requests} requests ({spec.dataset}){limit}, {spec.model} on {on}, prefill "
            f"{'modelled' if spec.model_prefill else 'ignored'}; driver costs {spec.driver_profile} ({src}), "
            f"background mapping {'on' if spec.background_mapping else 'off (no-overlap variant)'}, "
            f"cuMemSetAccess {spec.set_access}; kernel costs {spec.kernel_costs}; cross-layer attention penalty "
            f"{spec.layout_penalty}")


def pm(s: dict[str, float] | None) -> str:
    if not s:
        return "-"
    return f"{s['mean']:.4g}" if s["n"] == 1 else f"{s['mean']:.4g} ± {s['std']:.2g}"


def grid_table(figures: list[dict[str, Any]], spec: ServeSpec, cases: list[SimCase]) -> str:
    from kvlab.experiments.reporting.tables import table
    keys = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput", "request_goodput")
    note, starred = extrapolation_footnote(spec, cases)
    body = [[marked(f["backend"], starred), rate_label(f["request_rate"]), *(pm(f.get(k)) for k in keys)]
            for f in figures]
    seeds = max((f[k]["n"] for f in figures for k in keys if f.get(k)), default=1)
    over = " (mean ± std over seeds)" if seeds > 1 else " (one seed: no spread)"
    return table(["backend", "rate", *keys], body, profile_line(spec) + over) + note


def slo_table(result: dict[str, Any], target: dict[str, float], spec: ServeSpec, cases: list[SimCase]) -> str:
    from kvlab.experiments.reporting.tables import table
    note, starred = extrapolation_footnote(spec, cases)
    body = []
    for backend, r in result["backends"].items():
        ratio = result["ratios"].get(backend)
        rel = f"{ratio['ratio']:.3f} [{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]" if ratio else "1 (reference)"
        value = r.get("slo_max_concurrency", r.get("slo_rate"))
        body.append([marked(backend, starred), f"{value:.3g}", f"[{r['ci95'][0]:.3g}, {r['ci95'][1]:.3g}]",
                     " ".join(f"{v:.3g}" for v in r["per_seed"]), rel])
    goal = ", ".join(f"{k} <= {v:g}" for k, v in target.items())
    if result.get("axis") == "max-concurrency":
        head, what = "SLO max concurrency", "Highest max concurrency"
    else:
        head, what = "SLO rate (req/s)", "Highest rate"
    return table(["backend", head, "95% CI", "per seed", "ratio [95% CI]"], body,
                 f"{what} with {goal}; {profile_line(spec)}") + note


