"""Plot a benchmark record (DESIGN §7) as a PNG: throughput per shape, ours beside each baseline,
with the measured ceilings of the record as horizontal roofline lines.

Each row kind gets up to two panels: memory-bound shapes in GB/s under the copy-bandwidth line, and
compute-bound shapes in TFLOPS under the FP8 per-tensor matmul line (``report.memory_bound`` decides,
from our row's arithmetic intensity against the ceilings' ridge point). Needs matplotlib (the
``plots`` extra); it draws on a bare ``Figure``, so no display and no global pyplot state are involved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import OURS, group_by_shape, memory_bound, shape_label

__all__ = ["plot_record"]

# ours first and in a colour no baseline gets
_OURS_COLOR = "#d62728"
_BASELINE_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#7f7f7f", "#17becf", "#bcbd22")


def _panels(record: dict[str, Any]) -> list[tuple[str, bool, dict[str, dict[str, Any]]]]:
    """``(row kind, memory-bound?, {shape key: {impl: row}})`` per non-empty panel, in record order."""
    ceilings = record.get("ceilings") or {}
    kinds = list(dict.fromkeys(r["kind"] for r in record["rows"]))
    out = []
    for kind in kinds:
        split: dict[bool, dict[str, dict[str, Any]]] = {True: {}, False: {}}
        for key, impls in group_by_shape(record["rows"], kind).items():
            ref = impls.get(OURS) or next(iter(impls.values()))
            split[memory_bound(ref, ceilings)][key] = impls
        out += [(kind, mem, split[mem]) for mem in (True, False) if split[mem]]
    return out


def plot_record(record: dict[str, Any], out: Path, title: str | None = None) -> Path:
    """Write ``out`` (PNG) for ``record`` and return its path. Raises ``ImportError`` without matplotlib
    and ``ValueError`` for a record without rows."""
    from matplotlib.figure import Figure

    panels = _panels(record)
    if not panels:
        raise ValueError("the record has no rows to plot")
    ceilings = record.get("ceilings") or {}
    impls = list(dict.fromkeys([OURS, *(r["impl"] for r in record["rows"])]))
    if not any(r["impl"] == OURS for r in record["rows"]):
        impls.remove(OURS)
    colors = {name: _OURS_COLOR if name == OURS else _BASELINE_COLORS[i % len(_BASELINE_COLORS)]
              for i, name in enumerate(n for n in impls if n != OURS)}
    colors.setdefault(OURS, _OURS_COLOR)

    widest = max(len(shapes) for _, _, shapes in panels)
    fig = Figure(figsize=(max(8.0, 0.75 * widest + 3), 3.6 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (kind, mem, shapes) in zip(axes, panels, strict=True):
        metric, unit = ("gbps", "GB/s") if mem else ("tflops", "TFLOPS")
        ceiling_key, ceiling_name = (("copy_gbps", "copy") if mem else ("fp8_pertensor_tflops", "FP8 per-tensor matmul"))
        present = [n for n in impls if any(n in s for s in shapes.values())]
        width = 0.8 / max(1, len(present))
        for j, name in enumerate(present):
            xs, ys = [], []
            for i, row_impls in enumerate(shapes.values()):
                r = row_impls.get(name)
                if r is not None and r.get(metric) is not None:
                    xs.append(i + (j - (len(present) - 1) / 2) * width)
                    ys.append(r[metric])
            ax.bar(xs, ys, width, label=name, color=colors[name],
                   edgecolor="black" if name == OURS else "none", linewidth=0.6, zorder=2)
        ceiling = ceilings.get(ceiling_key)
        if ceiling:
            ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, zorder=3)
            ax.annotate(f"{ceiling_name} {ceiling:g} {unit}", xy=(1, ceiling), xycoords=("axes fraction", "data"),
                        xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom", fontsize=8)
            ax.set_ylim(0, ceiling * 1.15)
        # a panel of one or two shapes would otherwise stretch its bars over the whole width
        ax.set_xlim(-0.6, max(len(shapes), 4) - 0.4)
        first = next(iter(shapes.values()))
        shape_keys = "×".join(next(iter(first.values()))["shape"])
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([shape_label(next(iter(s.values()))["shape"]) for s in shapes.values()],
                           rotation=30, ha="right", fontsize=8)
        ax.set_xlabel(shape_keys, fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(f"{kind}: {'memory' if mem else 'compute'}-bound shapes", fontsize=10)
        ax.grid(axis="y", alpha=0.3, zorder=0)
        ax.legend(fontsize=7, ncols=min(4, len(present)), loc="upper left")
    head = title or " · ".join(str(record[k]) for k in ("device", "commit", "date") if record.get(k))
    if head:
        fig.suptitle(head, fontsize=11)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, format="png")
    return out
