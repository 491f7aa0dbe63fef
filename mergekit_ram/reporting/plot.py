"""The `inspect --plot` picture: per-layer x per-agent density and unique share.

Optional: needs matplotlib (`NEEDS`, the hint the README gives too); `inspect` calls `require` before any work.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mergekit_ram.core.statistics import Statistics

#: What `--plot` says when matplotlib is missing (the README's words: mergekit-ram is not on PyPI, so no extra
#: can be installed by its name).
NEEDS = '--plot needs matplotlib: pip install matplotlib (in a checkout of mergekit-ram: pip install ".[plot]")'


def require() -> None:
    """RuntimeError(`NEEDS`) when matplotlib cannot be imported: checked before the statistics pass."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise RuntimeError(NEEDS) from error


def heatmap(stats: Statistics, path: Path, labels: Mapping[str, str] | None = None) -> Path:
    """Write a PNG with two heat maps (density, unique share), one row per layer; with diagnostics,
    two pairwise agent x agent maps beside them (same-sign share and cosine over common entries)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise RuntimeError(NEEDS) from error

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
    pairs = stats.pair_totals()
    height = max(1.6 + 0.26 * len(rows), 2.5 + 0.5 * len(agents) if pairs else 0)
    width = 4.5 + 1.9 * len(agents) + (2 * (2 + 0.6 * len(agents)) if pairs else 0)
    fig, axes = plt.subplots(1, 4 if pairs else 2, figsize=(width, height), constrained_layout=True)
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
    if pairs:
        _pairwise(fig, axes[2:], pairs, agents, short)
    fig.suptitle("RAM+ statistics per layer and agent" + (", and per pair of agents" if pairs else ""), fontsize=11)
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pairwise(fig, axes, pairs, agents, short) -> None:
    """Agent x agent maps of the same-sign share and the cosine over the entries both changed."""
    index = {a: i for i, a in enumerate(agents)}
    n = len(agents)
    same = [[float("nan")] * n for _ in range(n)]
    cosine = [[float("nan")] * n for _ in range(n)]
    for p in pairs:
        i, j = index[p.a], index[p.b]
        if p.same_sign_share is not None:
            same[i][j] = same[j][i] = 100 * p.same_sign_share
        if p.cosine is not None:
            cosine[i][j] = cosine[j][i] = p.cosine
    for ax, data, title, low, high, fmt in (
        (axes[0], same, "same sign (% of entries both changed)", 0, 100, "{:.0f}"),
        (axes[1], cosine, "cosine over entries both changed", -1, 1, "{:.2f}"),
    ):
        image = ax.imshow(data, cmap="coolwarm", vmin=low, vmax=high)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(n), short, rotation=20, ha="right", fontsize=9)
        ax.set_yticks(range(n), short, fontsize=9)
        for i in range(n):
            for j in range(n):
                if data[i][j] == data[i][j]:
                    ax.text(j, i, fmt.format(data[i][j]), ha="center", va="center", fontsize=8)
        fig.colorbar(image, ax=ax, shrink=0.8)
