"""`specserve compare`'s figures: per-request latency through a run, one PNG per metric.

Each figure has one panel per test case (the union over the variants) and, in each
panel, one line per variant: x is the request's index in start order, y the request's
latency, from 0 up. Failed requests (an error code, or no figure) are left out and
break the line, so a gap is a failure, not a fast request. A variant keeps its colour
in every panel.

Figures are drawn on matplotlib's Agg canvas directly, without pyplot: nothing opens a
display and no global figure state is kept between calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from specserve.bench.compare import Variant, test_cases_of

MAX_PANEL_COLUMNS = 3


@dataclass(frozen=True)
class PerRequestPlot:
    file_name: str
    key: str  # per-request field, in seconds
    title: str
    y_label: str
    scale: float  # seconds -> the unit of y_label


PLOTS = (
    PerRequestPlot(
        "e2e_latency.png", "end_to_end_latency_s", "End-to-end latency per request", "end-to-end latency (s)", 1.0
    ),
    PerRequestPlot(
        "inter_token_latency.png",
        "inter_token_latency_s",
        "Inter-token latency per request",
        "inter-token latency (ms)",
        1000.0,
    ),
    PerRequestPlot("ttft.png", "ttft_s", "Time to first token per request", "TTFT (ms)", 1000.0),
)


def write_plots(variants: list[Variant], output_dir: Path) -> list[Path]:
    """Write every figure of PLOTS into output_dir; return their paths."""
    paths = []
    for plot in PLOTS:
        path = output_dir / plot.file_name
        draw(plot, variants).savefig(path, dpi=100)
        paths.append(path)
    return paths


def draw(plot: PerRequestPlot, variants: list[Variant]) -> Figure:
    test_cases = test_cases_of(variants)
    columns = min(len(test_cases), MAX_PANEL_COLUMNS)
    rows = math.ceil(len(test_cases) / columns)
    figure = Figure(figsize=(5.0 * columns, 3.6 * rows + 0.6), layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(f"{plot.title} (baseline: {variants[0].name})")
    for panel, test_case in enumerate(test_cases):
        axes = figure.add_subplot(rows, columns, panel + 1)
        axes.set_title(test_case)
        axes.set_xlabel("request index (start order)")
        axes.set_ylabel(plot.y_label)
        for colour, variant in enumerate(variants):
            points = per_request_points(variant, test_case, plot)
            if any(not math.isnan(y) for _, y in points):
                x, y = zip(*points)
                axes.plot(x, y, marker="o", markersize=3, linewidth=1.2, color=f"C{colour}", label=variant.name)
        if axes.lines:
            axes.legend(fontsize="small")
            axes.set_ylim(0, axes.dataLim.ymax * 1.1)
        else:
            axes.text(0.5, 0.5, "no completed requests", transform=axes.transAxes, ha="center", va="center")
        axes.grid(alpha=0.3)
    return figure


def per_request_points(variant: Variant, test_case: str, plot: PerRequestPlot) -> list[tuple[int, float]]:
    """(request index, value) per request of the test case in start order; NaN (a gap) where it failed."""
    result = variant.test_cases.get(test_case)
    if result is None:
        return []
    return sorted(
        (
            response["request_index"],
            math.nan
            if response["error_code"] is not None or response[plot.key] is None
            else response[plot.key] * plot.scale,
        )
        for response in result.responses
    )
