"""`kvlab simulate --preset seed`: the seed article's simulation ("batch size doubles, throughput does not"),
its cases, the figures it reports, and a report that prints each reproduced figure beside the article's."""
from __future__ import annotations

from kvlab.common.kv.registry import get_backend
from kvlab.experiments.reporting.tables import fmt, pct, table
from kvlab.experiments.sim.core import SimCase, SimRow, SimSettings, format_page, run_cases

HEADLINE_WATERMARK = 0.05
BLOCK_SIZES = (16, 32, 128, 512)
WATERMARKS = (0.0, 0.01, 0.05)
VMM_PAGES = (2 * 2**20, 64 * 2**10)
BUDGETS = (60.0, 20.0)



def key(policy: str, budget_gb: float, block_size: int | None = None, page_size: int | None = None,
        watermark: float = 0.0) -> tuple:
    """A case's key (SimCase.key), for the tables below."""
    return SimCase(policy, budget_gb, block_size, page_size, watermark).key


# The article's figures, by case key, under the run record's names.
ARTICLE: dict[tuple, dict[str, float]] = {
    key("reserve", 60.0): {"mean_batch": 79, "kv_utilization": 0.396, "output_tokens_per_s": 9460},
    key("paged", 60.0, 16, watermark=0.05): {"mean_batch": 149, "kv_utilization": 0.996,
                                            "output_tokens_per_s": 12894, "preemptions": 0},
    key("reserve", 20.0): {"mean_batch": 35, "output_tokens_per_s": 5490},
    key("paged", 20.0, 16, watermark=0.05): {"mean_batch": 87, "output_tokens_per_s": 9933},
    key("paged", 60.0, 16): {"output_tokens_per_s": 12990, "mean_waste_tokens": 7.4, "preemptions": 251,
                             "recomputed_tokens": 196631, "recompute_seconds": 6.4, "sim_seconds": 57.5},
    key("paged", 60.0, 32): {"mean_waste_tokens": 15.3},
    key("paged", 60.0, 128): {"output_tokens_per_s": 12886, "mean_waste_tokens": 63.9},
    key("paged", 60.0, 512): {"kv_utilization": 0.87, "output_tokens_per_s": 12585, "mean_waste_tokens": 257},
    key("paged", 60.0, 16, watermark=0.01): {"preemptions": 17},
}
ARTICLE_RATIOS = {"batch_60": 1.88, "tput_60": 1.36, "batch_20": 87 / 35, "tput_20": 1.81}


# the runs drawn by --plot: the three policies at 60 GB, and vAttention's two page sizes
PLOTTED = {key("reserve", 60.0), key("oracle", 60.0), key("paged", 60.0, 16, watermark=HEADLINE_WATERMARK),
           *(key("vmm", 60.0, page_size=p, watermark=HEADLINE_WATERMARK) for p in VMM_PAGES)}


def cases(include_vmm: bool = True) -> list[SimCase]:
    out = []
    for gb in BUDGETS:
        out += [SimCase("reserve", gb), SimCase("oracle", gb), SimCase("paged", gb, 16, watermark=HEADLINE_WATERMARK)]
    out += [SimCase("paged", 60.0, b) for b in BLOCK_SIZES]
    out += [SimCase("paged", 60.0, 16, watermark=w) for w in WATERMARKS]
    if include_vmm:
        out += [SimCase("vmm", 60.0, page_size=p, watermark=HEADLINE_WATERMARK) for p in VMM_PAGES]
    return out


def article(row: SimRow) -> dict[str, float]:
    return ARTICLE.get(row.key, {})


def both(row: SimRow, key: str, formatter=fmt) -> str:
    ours = getattr(row, key)
    theirs = article(row).get(key)
    return formatter(ours) if theirs is None else f"{formatter(ours)} ({formatter(theirs)})"


def report(all_cases: list[SimCase], rows: list[SimRow], settings: SimSettings) -> str:
    by_key = {c.key: r for c, r in zip(all_cases, rows)}
    w = settings.workload
    head = (f"Seed article reproduction: {w.num_requests} requests (seed {w.seed}), {settings.model} on "
            f"{settings.hardware}, decode-only roofline. Each cell: kvlab (article).")
    parts = [head, "", _policies(by_key), "", _ratios(by_key), "", _blocks(by_key), "", _watermarks(by_key),
             "", _vmm(by_key)]
    return "\n".join(parts)


def _policies(by_key: dict) -> str:
    body = []
    for gb in BUDGETS:
        for k in (key("reserve", gb), key("oracle", gb), key("paged", gb, 16, watermark=HEADLINE_WATERMARK)):
            r = by_key[k]
            name = {"reserve": "reserve 4,096", "oracle": "oracle (exact length)"}.get(r.policy, "paged-16, wm 5%")
            body.append([f"{gb:g} GB  {name}", both(r, "mean_batch"), both(r, "kv_utilization", pct),
                         both(r, "output_tokens_per_s"), both(r, "preemptions")])
    return table(["budget / policy", "mean batch", "KV util", "output tok/s", "preemptions"], body,
                 "Reservation vs paging")


def ratios(by_key: dict) -> dict[str, float]:
    out = {}
    for gb, tag in ((60.0, "60"), (20.0, "20")):
        reserve, paged = by_key[key("reserve", gb)], by_key[key("paged", gb, 16, watermark=HEADLINE_WATERMARK)]
        out[f"batch_{tag}"] = paged.mean_batch / reserve.mean_batch
        out[f"tput_{tag}"] = paged.output_tokens_per_s / reserve.output_tokens_per_s
    return out


def _ratios(by_key: dict) -> str:
    ours = ratios(by_key)
    body = [[f"{gb} GB", f"x{ours['batch_' + gb]:.2f} (x{ARTICLE_RATIOS['batch_' + gb]:.2f})",
             f"x{ours['tput_' + gb]:.2f} (x{ARTICLE_RATIOS['tput_' + gb]:.2f})"] for gb in ("60", "20")]
    return table(["budget", "mean batch", "throughput"], body, "Paged-16 (wm 5%) over reserve-4,096")


def _blocks(by_key: dict) -> str:
    body = []
    for b in BLOCK_SIZES:
        r = by_key[key("paged", 60.0, b)]
        body.append([f"{b}", both(r, "kv_utilization", pct), both(r, "output_tokens_per_s"),
                     both(r, "mean_waste_tokens"), fmt((b - 1) / 2), r.preemptions])
    return table(["block", "KV util", "output tok/s", "end waste", "(b-1)/2", "preemptions"], body,
                 "Block size (60 GB, no watermark)")


def _watermarks(by_key: dict) -> str:
    base = by_key[key("paged", 60.0, 16)].output_tokens_per_s
    body = []
    for wm in WATERMARKS:
        r = by_key[key("paged", 60.0, 16, watermark=wm)]
        body.append([pct(wm, 0), both(r, "preemptions"), both(r, "recomputed_tokens"),
                     both(r, "recompute_seconds"), both(r, "sim_seconds"), both(r, "output_tokens_per_s"),
                     pct(r.output_tokens_per_s / base - 1, 2)])
    return table(["watermark", "preemptions", "tokens to recompute", "recompute s @50% MFU", "decode s",
                  "output tok/s", "vs wm 0"], body, "Admission watermark (paged-16, 60 GB); article: 5% costs -0.7%")


def _vmm(by_key: dict) -> str:
    rows = [("paged-16", by_key[key("paged", 60.0, 16, watermark=HEADLINE_WATERMARK)])]
    rows += [(f"vmm {format_page(p)}", by_key[key("vmm", 60.0, page_size=p, watermark=HEADLINE_WATERMARK)])
             for p in VMM_PAGES]
    body = [[name, r.tokens_per_unit, fmt(r.mean_batch), pct(r.kv_utilization), fmt(r.output_tokens_per_s),
             fmt(r.mean_waste_tokens), r.preemptions] for name, r in rows]
    return table(["backend", "tokens/unit", "mean batch", "KV util", "output tok/s", "end waste", "preemptions"],
                 body, "vAttention page size vs paging (60 GB, wm 5%; the article has no vmm figures)")


# -- seed-to-seed spread ----------------------------------------------------------------------------------------

def figures(by_key: dict) -> dict[str, tuple[float, float]]:
    """Every figure the article reports, as name -> (kvlab, article)."""
    names = {"batch": "paged-16/reserve mean batch", "tput": "paged-16/reserve throughput"}
    out = {f"{names[k.split('_')[0]]}, {k.split('_')[1]} GB": (v, ARTICLE_RATIOS[k]) for k, v in ratios(by_key).items()}
    for k, figs in ARTICLE.items():
        row = by_key[k]
        name = f"{row.label} wm {row.watermark:g}" if get_backend(row.backend).watermark else row.label
        for metric, value in figs.items():
            out[f"{row.budget_gb:g} GB {name}: {metric}"] = (getattr(row, metric), value)
    return out


def spread(settings: SimSettings, num_seeds: int, jobs: int, progress: bool) -> str:
    """Run the preset (without vmm) for `num_seeds` seeds; each figure's mean, sd and range beside the article's."""
    import dataclasses
    import statistics

    all_cases = cases(include_vmm=False)
    samples: dict[str, list[float]] = {}
    article_value: dict[str, float] = {}
    first = settings.workload.seed
    for seed in range(first, first + num_seeds):
        s = dataclasses.replace(settings, workload=dataclasses.replace(settings.workload, seed=seed))
        rows = run_cases(all_cases, s, jobs, progress)
        for name, (ours, theirs) in figures({c.key: r for c, r in zip(all_cases, rows)}).items():
            samples.setdefault(name, []).append(float(ours))
            article_value[name] = theirs
    body = []
    for name, values in samples.items():
        mean, sd = statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
        a = article_value[name]
        body.append([name, _num(a), _num(mean), _num(sd), f"{_num(min(values))}-{_num(max(values))}",
                     f"{(mean - a) / sd:+.1f}" if sd > 1e-9 * max(1.0, abs(mean)) else "-"])
    return table(["figure", "article", "mean", "sd", "range", "(mean-article)/sd"], body,
                 f"Seed-to-seed spread over seeds {first}..{first + num_seeds - 1} ({settings.workload.num_requests} "
                 f"requests each)")


def _num(x: float) -> str:
    if abs(x) < 10:
        return f"{x:.3f}"
    return fmt(x)
