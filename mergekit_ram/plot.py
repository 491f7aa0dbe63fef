"""The `inspect --plot` picture: per-layer x per-agent density and unique share.

Optional: needs matplotlib (`pip install "mergekit-ram[plot]"`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mergekit_ram.statistics import Statistics


def heatmap(stats: Statistics, path: Path, labels: Mapping[str, str] | None = None) -> Path:
    """Write a PNG with two heat maps (density, unique share), one row per layer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError('--plot needs matplotlib: pip install "mergekit-ram[plot]"') from error

    groups = stats.groups("layer")
    names = list(groups)
    agents = stats.agents
    density = [[0.0] * len(agents) for _ in names]
    unique = [[0.0] * len(agents) for _ in names]
    for i, name in enumerate(names):
        totals = stats.totals(groups[name])
        for j, agent in enumerate(agents):
            s = totals[agent]
            density[i][j] = 100 * s.density
            unique[i][j] = 100 * s.shares[0]
    short = [(labels or {}).get(a, a) for a in agents]
    rows = [n.removeprefix("model.") for n in names]
    height = 1.6 + 0.26 * len(rows)
    fig, axes = plt.subplots(1, 2, figsize=(4.5 + 1.9 * len(agents), height), constrained_layout=True)
    for ax, data, title, cmap in (
        (axes[0], density, "density (% of weights changed)", "viridis"),
        (axes[1], unique, "unique share (% of changed weights)", "magma"),
    ):
        image = ax.imshow(data, aspect="auto", cmap=cmap, vmin=0, vmax=100)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(len(short)), short, rotation=20, ha="right", fontsize=9)
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        if len(rows) <= 48:
            for i, row in enumerate(data):
                for j, value in enumerate(row):
                    ax.text(
                        j,
                        i,
                        f"{value:.0f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if value < 60 else "black",
                    )
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle("RAM+ statistics per layer and agent", fontsize=11)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
