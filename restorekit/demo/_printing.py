"""What the demo prints and draws: the accuracy tables, how the report's counts add up, the plot."""

from __future__ import annotations

from pathlib import Path

from restorekit.demo._training import ARMS, CLASSES, DEFAULT_SHOTS, DESCRIPTIONS, missing_libraries

def _mean_std(values) -> tuple[float, float]:
    import numpy as np

    values = np.asarray(values, dtype=float)
    return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0


def _verdict(name: str, differences) -> str:
    """One sentence on ``name`` vs cold: the mean difference against two standard errors of it."""
    mean, std = _mean_std(differences)
    margin = 2 * std / len(differences) ** 0.5
    head = f"  {name} - cold: {mean:+.2f} pts on average, two standard errors {margin:.2f}:"
    if abs(mean) <= margin:
        return f"{head} within the seed-to-seed noise, no clear difference"
    if mean > 0:
        return f"{head} {name} is ahead, by more than the seed-to-seed noise"
    return f"{head} {name} is behind cold, by more than the seed-to-seed noise"


def accuracy_table(runs: dict) -> str:
    """Each seed's test accuracy at the last step for every arm, then mean and std over seeds.

    Args:
        runs: arm -> Runs of the same seeds, in the same order (``DemoResult.runs``).

    Returns:
        A text table (accuracies in %, differences in percentage points) and one
        verdict line per restored arm.
    """
    arms = list(ARMS)
    finals = {arm: [r.final_accuracy * 100 for r in runs[arm]] for arm in arms}
    gains = {arm: [a - c for a, c in zip(finals[arm], finals["cold"])] for arm in ("probe", "warm")}
    header = "".join(f"{arm:>8}" for arm in arms) + "".join(f"{arm + ' - cold':>14}" for arm in gains)
    lines = [f"  {'seed':<6}{header}"]

    def row(label: str, values, gain_values, percent: str = "%") -> str:
        cells = "".join(f"{v:>7.1f}{percent or ' '}" for v in values)
        return f"  {label:<6}{cells}" + "".join(f"{g:>+10.1f} pts" for g in gain_values)

    for i, run in enumerate(runs["cold"]):
        lines.append(row(str(run.seed), [finals[a][i] for a in arms], [gains[a][i] for a in gains]))
    lines.append(row("mean", [_mean_std(finals[a])[0] for a in arms], [_mean_std(gains[a])[0] for a in gains]))
    std = row("std", [_mean_std(finals[a])[1] for a in arms], [_mean_std(gains[a])[1] for a in gains], "")
    lines.append(std.replace("+", " "))
    n = len(finals["cold"])
    for arm in gains:
        wins = sum(g > 0 for g in gains[arm])
        ties = sum(g == 0 for g in gains[arm])
        lines.append(f"  {arm} is ahead of cold in {wins} of {n} seeds" + (f" (tied in {ties})" if ties else ""))
    lines.extend(_verdict(arm, gains[arm]) for arm in gains)
    return "\n".join(lines)


def curve_table(runs: dict) -> str:
    """Mean test accuracy over the seeds at a few steps along the way: the plot, as text."""
    import numpy as np

    steps = list(runs["cold"][0].steps)
    picks = sorted({s for s in (0, 5, 10, 25, 50) if s in steps} | {steps[-1]})
    lines = [f"  {'step':<6}" + "".join(f"{s:>8}" for s in picks)]
    for arm in ARMS:
        mean = np.mean([r.accuracy for r in runs[arm]], axis=0) * 100
        lines.append(f"  {arm:<6}" + "".join(f"{mean[steps.index(s)]:>7.1f}%" for s in picks))
    return "\n".join(lines)


def count_lines(report) -> str:
    """How the restore report's counts add up, for someone reading one for the first time.

    The report counts the new graph's variables, but ``skipped`` and ``unused`` also
    hold checkpoint entries. This splits every number by where it comes from: model
    variables vs optimizer slots vs EMA shadows vs global_step, in the graph and in
    the checkpoint.

    Args:
        report: the RestoreReport of a warm (or probe) run of this demo.

    Returns:
        Indented text lines.
    """
    from collections import Counter

    from restorekit._checkpoint import Checkpoint

    entries = Counter(_entry_kind(name) for name in Checkpoint(report.checkpoint))
    model = len(report.matched) + len(report.missing) + len(report.shape_mismatched) + len(report.dtype_mismatched)
    graph = Counter(_reason_words(r.reason) for r in report.skipped if r.variable_name is not None)
    stored = Counter(_reason_words(r.reason) for r in report.skipped if r.variable_name is None)
    both = {r.variable_name for r in report.skipped} & {r.checkpoint_name for r in report.skipped} - {None}
    unused = Counter(_entry_kind(r.checkpoint_name) for r in report.unused)
    once = f" - {len(both)} on both sides, counted once ({', '.join(sorted(both))})" if both else ""
    return "\n".join([
        "      how the counts add up:",
        f"        the new graph's {report.num_variables} variables = {model} model variables "
        f"({len(report.matched)} matched + {len(report.missing)} missing: the new head, initialized fresh) "
        f"+ {_listing(graph)}",
        f"        the checkpoint's {sum(entries.values())} entries = {_listing(entries)}",
        f"        matched {len(report.matched)}: the backbone's {len(report.matched)} variables, each read from its EMA shadow",
        f"        skipped {sum(graph.values()) + sum(stored.values()) - len(both)} = "
        f"{sum(graph.values())} in the graph ({_listing(graph)}) "
        f"+ {sum(stored.values())} in the checkpoint ({_listing(stored)}){once}",
        f"        unused {len(report.unused)}: task A's head 'digits' ({_listing(unused)}), which task B does not have",
    ])


# How the count lines order and word what they count.
_KIND_ORDER = ("weights", "raw weights", "EMA shadows", "Momentum slots", "Adam slots", "global_step")


def _listing(counter) -> str:
    def order(item):
        kind = item[0]
        return (_KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER), kind)

    return " + ".join(f"{n} {kind}" for kind, n in sorted(counter.items(), key=order))


def _entry_kind(name: str) -> str:
    """What a checkpoint entry of this demo holds, by its name."""
    if name == "global_step":
        return "global_step"
    if name.endswith("/ExponentialMovingAverage"):
        return "EMA shadows"
    if name.endswith("/Momentum"):
        return "Momentum slots"
    return "weights"


def _reason_words(reason: str) -> str:
    """A skip reason as a plural noun: 'optimizer slot (Adam)' -> 'Adam slots'."""
    if reason.startswith("optimizer slot ("):
        return reason[len("optimizer slot ("):].rstrip(")") + " slots"
    if reason.startswith("raw weights"):
        return "raw weights"  # their EMA shadows were restored instead
    return reason


def plot_learning_curves(runs: dict, path, *, shots: int = DEFAULT_SHOTS) -> str:
    """Write the test-accuracy curves of every arm (each seed faint, the mean bold) to a PNG.

    Draws on matplotlib's Agg canvas directly, so no GUI backend or pyplot state is touched.

    Args:
        runs: arm -> Runs (``DemoResult.runs``).
        path: the PNG to write (its directory is created).
        shots: training images per class, for the title.

    Returns:
        The path written, as a str.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    import numpy as np

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise missing_libraries(["matplotlib"]) from None

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(10.5, 4.6), dpi=100)
    FigureCanvasAgg(figure)
    curves_axes, seeds_axes = figure.subplots(1, 2, gridspec_kw={"width_ratios": [1.7, 1]})
    colors = {"cold": "#d62728", "probe": "#2ca02c", "warm": "#1f77b4"}
    for arm in ARMS:
        steps = np.asarray(runs[arm][0].steps)
        curves = np.asarray([r.accuracy for r in runs[arm]]) * 100
        for curve in curves:
            curves_axes.plot(steps, curve, color=colors[arm], alpha=0.12, linewidth=1)
        curves_axes.plot(steps, curves.mean(axis=0), color=colors[arm], linewidth=2.2, label=f"{arm}: {DESCRIPTIONS[arm]}")
    chance = 100 / CLASSES
    curves_axes.axhline(chance, color="grey", linestyle=":", linewidth=1)
    curves_axes.text(steps[-1], chance + 1, "chance", color="grey", ha="right", va="bottom", fontsize=8)
    curves_axes.set_xlabel("fine-tuning step (Adam, full batch)")
    curves_axes.set_ylabel("test accuracy on digits 5-9 (%)")
    curves_axes.set_title(f"learning curves (bold: mean of {len(runs['cold'])} seeds)", fontsize=10)
    curves_axes.set_xlim(0, steps[-1])
    curves_axes.set_ylim(0, 100)
    curves_axes.grid(alpha=0.3)
    curves_axes.legend(loc="lower right", fontsize=7.5)

    # The last step, zoomed: one line per seed through its three arms, so the paired
    # differences (same images, same initial head) are visible at their real size.
    finals = np.asarray([[r.final_accuracy * 100 for r in runs[arm]] for arm in ARMS])
    x = np.arange(len(ARMS))
    for seed_finals in finals.T:
        seeds_axes.plot(x, seed_finals, color="grey", alpha=0.45, linewidth=1, marker="o", markersize=3)
    seeds_axes.plot(x, finals.mean(axis=1), color="black", linewidth=2.2, marker="o", label="mean")
    for i, arm in enumerate(ARMS):
        seeds_axes.plot([i], [finals[i].mean()], marker="o", markersize=8, color=colors[arm], zorder=3)
    seeds_axes.set_xticks(x, list(ARMS))
    seeds_axes.set_xlim(-0.3, len(ARMS) - 0.7)
    low, high = finals.min(), finals.max()
    seeds_axes.set_ylim(low - 0.1 * (high - low + 1), high + 0.1 * (high - low + 1))
    seeds_axes.set_ylabel("test accuracy at the last step (%)")
    seeds_axes.set_title("each seed at the last step (zoomed)", fontsize=10)
    seeds_axes.grid(alpha=0.3)
    seeds_axes.legend(loc="lower right", fontsize=8)
    figure.suptitle(
        f"Digits 5-9 from {shots} labelled images per class, after pretraining on digits 0-4", fontsize=11
    )
    figure.tight_layout()
    figure.savefig(path)
    return str(path)
