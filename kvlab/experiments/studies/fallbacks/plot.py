"""The fallback study's heat map: rows head_dim x dtype, columns block size, colour = chosen paged kernel."""
from __future__ import annotations

from pathlib import Path

from kvlab.experiments.studies.fallbacks.grid import Row

# (scenario, phase, title) of each panel; GQA is fixed: it changes no decision (only its divisibility)
PANELS = [
    ("cuda+fa+fi", "decode", "H200 + flash-attn + flashinfer: paged decode"),
    ("cuda+fa+fi", "prefill", "H200 + flash-attn + flashinfer: paged prefill"),
    ("cuda", "decode", "H200 as installed (no flash-attn/flashinfer): paged decode"),
]
KERNEL_STYLE = {  # kernel -> (short label, colour)
    "flash_attn_paged": ("FA", "#1b9e77"),
    "flashinfer_paged": ("FI", "#7570b3"),
    "triton_paged": ("TR", "#e6ab02"),
    "flex_paged": ("FX", "#66a61e"),
    "torch_paged": ("T", "#d95f02"),
}
PANEL_GQA = 4


def panel_matrix(rows: list[Row], scenario: str, phase: str,
                 gqa: int) -> tuple[list[str], list[int], list[list]]:
    """(row labels "d80 bf16", block sizes, matrix of Row or None) for one panel."""
    picked = [r for r in rows if r.scenario == scenario and r.backend == "paged" and r.phase == phase
              and r.gqa_ratio == gqa]
    heads = sorted({r.head_dim for r in picked})
    dtypes = [d for d in ("float32", "float16", "bfloat16") if any(r.dtype == d for r in picked)]
    blocks = sorted({r.block_size for r in picked})
    index = {(r.head_dim, r.dtype, r.block_size): r for r in picked}
    labels, matrix = [], []
    for h in heads:
        for d in dtypes:
            labels.append(f"d{h} {d.replace('float', 'fp').replace('bfp16', 'bf16')}")
            matrix.append([index.get((h, d, b)) for b in blocks])
    return labels, blocks, matrix


def plot_heatmap(rows: list[Row], path: Path, gqa: int = PANEL_GQA) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    kernels = list(KERNEL_STYLE)
    cmap = ListedColormap([KERNEL_STYLE[k][1] for k in kernels])
    panels = [p for p in PANELS if any(r.scenario == p[0] for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 11), squeeze=False)
    for ax, (scenario, phase, title) in zip(axes[0], panels, strict=True):
        labels, blocks, matrix = panel_matrix(rows, scenario, phase, gqa)
        codes = [[kernels.index(r.kernel) if r else -1 for r in line] for line in matrix]
        ax.imshow(codes, cmap=cmap, vmin=0, vmax=len(kernels) - 1, aspect="auto")
        for i, line in enumerate(matrix):
            for j, r in enumerate(line):
                if r is not None:
                    text = KERNEL_STYLE[r.kernel][0] + ("*" if r.kernel_head_dim != r.head_dim else "")
                    ax.text(j, i, text, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(blocks)), [str(b) for b in blocks])
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel("block size (tokens)")
        ax.set_title(f"{title}\nGQA {gqa}", fontsize=9)
    shown = {r.kernel for scenario, phase, _ in panels for line in panel_matrix(rows, scenario, phase, gqa)[2]
             for r in line if r is not None}
    # the legend lists only the kernels that appear in some panel
    handles = [Patch(color=KERNEL_STYLE[k][1], label=f"{KERNEL_STYLE[k][0]} = {k}") for k in kernels if k in shown]
    fig.legend(handles=handles, loc="lower center", ncol=max(1, len(handles)), fontsize=8,
               title="* = runs a padded head_dim kernel")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
