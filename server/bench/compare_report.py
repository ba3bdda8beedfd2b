"""The one-screen table and the plot of a `sloserve bench compare` report."""

from __future__ import annotations

from pathlib import Path

from sloserve.bench.report import ruled_rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def format_compare(report: dict) -> str:
    """One row per (policy, load): attainment, interactive attainment, goodput, refusals, P99s;
    then goodput at the target attainment per policy."""
    header = (
        "policy",
        "load",
        "req/s",
        "attain %",
        "interactive %",
        "met/s",
        "done/sent",
        "refused",
        "TTFT p99 ms",
        "E2E p99 ms",
    )
    order = {p: i for i, p in enumerate(report["policies"])}
    loads = {label: i for i, label in enumerate(report["loads"])}
    rows = [header]
    for p in sorted(report["points"], key=lambda p: (order[p["policy"]], loads.get(p["load"], 0))):
        run = p["run"]
        rows.append(
            (
                p["policy"],
                p["load"],
                f"{p['rate']:.2f}",
                _pct(p["attainment"]),
                _pct(p["interactive_attainment"]),
                "-" if p["goodput"] is None else f"{p['goodput']:.2f}",
                f"{p['completed']}/{p['requests']}",
                str(p["refused"]),
                _ms(run["ttft_s"]["p99"]),
                _ms(run["e2e_s"]["p99"]),
            )
        )
    target = f"{100 * report['attainment_target']:g}%"
    capacity = report["capacity_rps"]
    goodput = [
        f"  {policy}: "
        + (
            "below the lowest load"
            if rate is None
            else f"{rate:.3g} req/s" + (f" ({rate / capacity:.2f}x capacity)" if capacity else "")
        )
        for policy, rate in report["goodput_rps"].items()
    ]
    head = f"workload {report['workload']}  model {report['model']}"
    if capacity:
        head += (
            f"  capacity {capacity:.3g} req/s{' (measured)' if report['capacity_measured'] else ''}"
        )
    return "\n".join(
        [
            head,
            *ruled_rows(rows),
            f"goodput (highest rate with >= {target} attainment, interpolated):",
            *goodput,
        ]
    )


def write_compare_plot(report: dict, path: str | Path) -> None:
    """Attainment and interactive attainment against load, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    relative = report["capacity_rps"] is not None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in (
        (axes[0], "attainment", "SLO attainment"),
        (axes[1], "interactive_attainment", f"{report['interactive_class']} attainment"),
    ):
        for policy in report["policies"]:
            points = sorted(
                (p["multiple"] if relative else p["rate"], p[key])
                for p in report["points"]
                if p["policy"] == policy and p[key] is not None
            )
            if points:
                ax.plot(
                    [x for x, _ in points], [100 * y for _, y in points], marker="o", label=policy
                )
        ax.axhline(100 * report["attainment_target"], color="grey", linestyle="--", linewidth=1)
        ax.set(
            title=title,
            xlabel="load (x capacity)" if relative else "request rate (req/s)",
            ylabel="% of requests",
            ylim=(0, 102),
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{report['workload']} on {report['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
