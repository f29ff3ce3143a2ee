"""Plot a benchmark record (DESIGN §7) as a PNG: throughput per shape, ours beside each baseline,
with the measured ceilings of the record as horizontal roofline lines.

Each row kind gets up to two panels: memory-bound shapes in GB/s under the copy-bandwidth line, and
compute-bound shapes in TFLOPS under the FP8 per-tensor matmul line (``report.memory_bound`` decides,
from our row's arithmetic intensity against the ceilings' ridge point). Readability rules:

- tick labels show only the shape keys that vary within a panel; the constant ones go to the axis
  label (``experts=256, hidden=7168``), so a MoE shape is ``64`` rather than ``64×256×32×8×7168×2048``;
- a panel whose bars span more than ``LOG_SPAN``× (decode next to prefill) gets a log axis, so the
  small shapes stay visible;
- ours is red, our other variants (``moe_fp8_graph``, ``moe_fp8_eager``) orange / pink, baselines blue,
  green, purple, ...;
- many small panels (the MoE data path: nine row kinds) are laid out on two columns.

Needs matplotlib (the ``plots`` extra); it draws on a bare ``Figure``, so no display and no global
pyplot state are involved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import OURS, group_by_shape, memory_bound

__all__ = ["plot_record"]

_OURS_COLOR = "#d62728"
_OURS_VARIANT_COLORS = ("#ff7f0e", "#e377c2", "#bcbd22")
_BASELINE_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#7f7f7f", "#17becf")
LOG_SPAN = 30.0  # max / min bar height in a panel above which its y axis is logarithmic

Panel = tuple[str, bool, dict[str, dict[str, Any]]]


def _panels(record: dict[str, Any]) -> list[Panel]:
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


def _colors(impls: list[str]) -> dict[str, str]:
    ours = [n for n in impls if n.startswith(OURS + "_")]
    base = [n for n in impls if n != OURS and n not in ours]
    colors = {OURS: _OURS_COLOR}
    colors |= {n: _OURS_VARIANT_COLORS[i % len(_OURS_VARIANT_COLORS)] for i, n in enumerate(ours)}
    colors |= {n: _BASELINE_COLORS[i % len(_BASELINE_COLORS)] for i, n in enumerate(base)}
    return colors


def _shape_labels(shapes: list[dict[str, Any]]) -> tuple[list[str], str]:
    """Tick labels from the keys that vary across ``shapes`` and an axis label naming them, plus the
    constant keys as ``key=value``."""
    keys = list(dict.fromkeys(k for s in shapes for k in s))
    varying = [k for k in keys if len({str(s.get(k)) for s in shapes}) > 1] or keys[:1]
    fixed = [k for k in keys if k not in varying and all(k in s for s in shapes)]
    ticks = ["×".join(str(s.get(k, "-")) for k in varying) for s in shapes]
    label = "×".join(varying)
    if fixed:
        label += "   (" + ", ".join(f"{k}={shapes[0][k]}" for k in fixed) + ")"
    return ticks, label


def _draw(ax: Any, kind: str, mem: bool, shapes: dict[str, dict[str, Any]], impls: list[str],
          colors: dict[str, str], ceilings: dict[str, float]) -> None:
    metric, unit = ("gbps", "GB/s") if mem else ("tflops", "TFLOPS")
    # a shape where ours moved no counted bytes / FLOPs (one decode token routed to no local expert)
    # has no throughput to show: name it under the axis instead of drawing an empty slot
    empty = {k: s for k, s in shapes.items() if OURS in s and not s[OURS].get(metric)}
    shapes = {k: s for k, s in shapes.items() if k not in empty}
    ax.set_title(f"{kind}: {'memory' if mem else 'compute'}-bound shapes", fontsize=10)
    if not shapes:
        ax.text(0.5, 0.5, f"no {unit} counted for any shape", ha="center", va="center", transform=ax.transAxes)
        return
    ceiling_key, ceiling_name = ("copy_gbps", "copy") if mem else ("fp8_pertensor_tflops", "FP8 per-tensor matmul")
    present = [n for n in impls if any(n in s for s in shapes.values())]
    width = 0.8 / max(1, len(present))
    values: list[float] = []
    for j, name in enumerate(present):
        xs, ys = [], []
        for i, row_impls in enumerate(shapes.values()):
            r = row_impls.get(name)
            if r is not None and r.get(metric):
                xs.append(i + (j - (len(present) - 1) / 2) * width)
                ys.append(r[metric])
        values += ys
        ax.bar(xs, ys, width, label=name, color=colors[name],
               edgecolor="black" if name == OURS else "none", linewidth=0.6, zorder=2)
    ceiling = ceilings.get(ceiling_key)
    top = max([*values, ceiling or 0]) or 1.0
    log = bool(values) and top / min(values) > LOG_SPAN
    if log:
        ax.set_yscale("log")
        # legend room above the ceiling: the axis is multiplicative
        ax.set_ylim(min(values) / 2, top * 6)
    else:
        ax.set_ylim(0, top * 1.22)
    if ceiling:
        ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, zorder=3)
        ax.annotate(f"{ceiling_name} {ceiling:g} {unit}", xy=(1, ceiling), xycoords=("axes fraction", "data"),
                    xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom", fontsize=8)
    # a panel of one or two shapes would otherwise stretch its bars over the whole width
    ax.set_xlim(-0.6, max(len(shapes), 3) - 0.4)
    ticks, xlabel = _shape_labels([next(iter(s.values()))["shape"] for s in shapes.values()])
    rotate = max(map(len, ticks)) > 6 and len(ticks) > 2
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels(ticks, rotation=30 if rotate else 0, ha="right" if rotate else "center", fontsize=8)
    if empty:
        xlabel += f"\nnot shown (no {unit} counted): " + ", ".join(
            _shape_labels([s[OURS]["shape"] for s in (*empty.values(), *shapes.values())])[0][:len(empty)])
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(unit + (" (log)" if log else ""))
    ax.grid(axis="y", alpha=0.3, zorder=0)
    ax.legend(fontsize=7, ncols=min(4, len(present)), loc="upper left")


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
    colors = _colors(impls)

    widest = max(len(shapes) for _, _, shapes in panels)
    cols = 2 if len(panels) >= 4 and widest <= 6 else 1
    rows = -(-len(panels) // cols)
    col_width = max(6.0, 0.75 * widest + 3) if cols == 2 else max(8.0, 0.75 * widest + 3)
    fig = Figure(figsize=(col_width * cols, 3.6 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (kind, mem, shapes) in zip(axes, panels, strict=False):
        _draw(ax, kind, mem, shapes, impls, colors, ceilings)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    head = title or " · ".join(str(record[k]) for k in ("device", "commit", "date") if record.get(k))
    if head:
        fig.suptitle(head, fontsize=11)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, format="png")
    return out
