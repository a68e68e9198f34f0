"""Plot helpers shared by the benchmarks."""

from __future__ import annotations


def grouped_bars(axis, groups: list[str], series: dict[str, list[float]], rotation: int = 0) -> None:
    """
    One bar per series in each group, a line at 1.0 (the baseline's speed), the groups labelled and a legend.

    Args:
        axis: a matplotlib `Axes`.
        groups (`list[str]`): the group labels, along the x axis.
        series (`dict[str, list[float]]`): per series (a method), one value per group.
        rotation (`int`): the angle of the group labels.
    """
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        axis.bar([x + i * width for x in range(len(groups))], values, width, label=label)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(groups))])
    axis.set_xticklabels(groups, rotation=rotation, ha="right" if rotation else "center")
    axis.legend()
