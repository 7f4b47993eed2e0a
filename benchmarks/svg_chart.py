"""Grouped bar charts as standalone SVG files, for plots in the benchmark pages (docs/benchmarks/).

matplotlib is not among vLLM's dependencies and is not installed here; a bar chart
of a few benchmark figures needs nothing but text, so the benchmarks write SVG.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


@dataclass(frozen=True)
class BarChart:
    """Groups along x (e.g. prompt lengths), one bar per series in each group."""

    title: str
    y_label: str
    groups: list[str]
    series: dict[str, list[float]]

    def __post_init__(self) -> None:
        for name, values in self.series.items():
            if len(values) != len(self.groups):
                raise ValueError(f"series {name!r} has {len(values)} values for {len(self.groups)} groups")

    def to_svg(self, width: int = 760, height: int = 360) -> str:
        left, right, top, bottom = 64, 16, 40, 72
        plot_w, plot_h = width - left - right, height - top - bottom
        peak = max((v for vs in self.series.values() for v in vs), default=1.0) or 1.0
        y_max = _nice_ceiling(peak)
        n_series = max(len(self.series), 1)
        group_w = plot_w / max(len(self.groups), 1)
        bar_w = group_w * 0.8 / n_series
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="12">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(self.title)}</text>',
        ]
        for i in range(5):
            value = y_max * i / 4
            y = top + plot_h - plot_h * i / 4
            out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{value:g}</text>')
        out.append(
            f'<text x="16" y="{top + plot_h / 2}" transform="rotate(-90 16 {top + plot_h / 2})" '
            f'text-anchor="middle">{escape(self.y_label)}</text>'
        )
        for g, group in enumerate(self.groups):
            x0 = left + g * group_w + group_w * 0.1
            for s, values in enumerate(self.series.values()):
                h = plot_h * values[g] / y_max
                x = x0 + s * bar_w
                out.append(
                    f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{bar_w * 0.92:.1f}" '
                    f'height="{h:.1f}" fill="{PALETTE[s % len(PALETTE)]}">'
                    f"<title>{values[g]:g}</title></rect>"
                )
            out.append(
                f'<text x="{left + (g + 0.5) * group_w:.1f}" y="{top + plot_h + 16}" '
                f'text-anchor="middle">{escape(group)}</text>'
            )
        legend_y = height - 22
        for s, name in enumerate(self.series):
            x = left + s * (plot_w / n_series)
            out.append(
                f'<rect x="{x:.1f}" y="{legend_y - 10}" width="12" height="12" fill="{PALETTE[s % len(PALETTE)]}"/>'
            )
            out.append(f'<text x="{x + 16:.1f}" y="{legend_y}">{escape(name)}</text>')
        out.append("</svg>")
        return "\n".join(out) + "\n"

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_svg())
        return path


def _nice_ceiling(value: float) -> float:
    """Smallest of 1, 2, 2.5, 5 x 10^k at or above value, so axis ticks are round."""
    magnitude = 10.0 ** (len(str(int(value))) - 1) if value >= 1 else 1.0
    while magnitude > value:
        magnitude /= 10
    for step in (1, 2, 2.5, 5, 10):
        if step * magnitude >= value:
            return step * magnitude
    return 10 * magnitude
