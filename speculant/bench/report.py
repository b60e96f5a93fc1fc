"""Report output shared by the benchmark modes: one table description, rendered three ways.

A `Table` is plain strings (title, header, rows, notes), so the terminal view (rich, stdout), the
Markdown file and any test see exactly the same numbers. JSON holds the raw values; the PNG chart
is drawn with matplotlib's Agg canvas directly (no pyplot, so no global figure state).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table as RichTable

from ..errors import SpeculantError
from ..models.native import kernel_build
from ..threads import cpu_model


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()
    row_styles: tuple[str | None, ...] = ()  # rich styles, e.g. "bold red" for a failed check

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise SpeculantError(f"table {self.title!r}: a row has {len(row)} cells for {len(self.columns)} columns")


def fmt(value: float | int | None, digits: int = 1, suffix: str = "") -> str:
    """A number for a table cell; '-' for missing or non-finite values."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, int):
        return f"{value:,}{suffix}"
    return f"{value:,.{digits}f}{suffix}"


def machine_info() -> dict[str, object]:
    """Where the numbers were taken: the CPU, the kernel build it runs, cores, and how busy the machine was
    (load average)."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu": cpu_model(), "kernels": kernel_build(), "cpus": os.cpu_count(), "load_average": load}


def machine_note(info: dict[str, object], threads: object = None) -> str:
    """The table line naming the machine: speed ratios hold for the CPU they were measured on."""
    used = f", {threads} thread{'' if threads == 1 else 's'}" if threads else ""
    return f"measured on {info.get('cpu')}: {info.get('cpus')} CPUs{used}, {info.get('kernels')} kernels."


def load_note(info: dict[str, object]) -> str | None:
    """A warning when other work was running: timings on a busy machine are noisy."""
    load, cpus = info.get("load_average"), info.get("cpus")
    if not load or not cpus or load[0] < 0.5 * cpus:
        return None
    return (f"load average {load[0]:.2f} on {cpus} CPUs when the run started: other processes were running, "
            "so timings are noisy.")


def output_dir(path: str | Path) -> Path:
    out = Path(path).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpeculantError(f"cannot create the output folder {out}: {e}; pass another --out DIR") from None
    return out


def stdout_console() -> Console:
    """Console for the tables: the terminal's width, or wide enough for every column when piped."""
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 240))


def render(table: Table, console: Console) -> None:
    t = RichTable(title=table.title, title_justify="left", header_style="bold")
    for i, col in enumerate(table.columns):
        t.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for i, row in enumerate(table.rows):
        t.add_row(*row, style=table.row_styles[i] if i < len(table.row_styles) else None)
    console.print(t)
    for note in table.notes:
        console.print(f"  [dim]{note}[/dim]")


def to_markdown(tables: Iterable[Table], heading: str | None = None) -> str:
    parts = [f"# {heading}\n"] if heading else []
    for t in tables:
        parts.append(f"## {t.title}\n")
        parts.append("| " + " | ".join(_md(c) for c in t.columns) + " |")
        parts.append("|" + "|".join(["---"] + ["---:"] * (len(t.columns) - 1)) + "|")
        parts.extend("| " + " | ".join(_md(c) for c in row) + " |" for row in t.rows)
        parts.append("")
        parts.extend(f"- {n}" for n in t.notes)
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def _md(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def write_markdown(path: Path, tables: Sequence[Table], heading: str | None = None) -> Path:
    path.write_text(to_markdown(tables, heading), encoding="utf-8")
    return path


def write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def publish(tables: Sequence[Table], data: object, out: Path, name: str) -> list[Path]:
    """Print `tables` and write them as OUT/NAME.md beside the raw results OUT/NAME.json (`bench NAME`)."""
    console = stdout_console()
    for t in tables:
        render(t, console)
    return [write_json(out / f"{name}.json", data), write_markdown(out / f"{name}.md", tables, f"speculant bench {name}")]


def bar_chart(path: Path, groups: Sequence[str], series: dict[str, Sequence[float | None]], *, title: str,
              ylabel: str, baseline: float | None = 1.0) -> Path:
    """Grouped bars: one group per entry of `groups`, one bar per series (None = no bar)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not groups or not series:
        raise SpeculantError("nothing to plot: the chart needs at least one group and one series")
    for name, values in series.items():
        if len(values) != len(groups):
            raise SpeculantError(f"series {name!r} has {len(values)} values for {len(groups)} groups")
    fig = Figure(figsize=(max(6.0, 1.2 * len(groups) * max(1, len(series)) * 0.6 + 2), 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(series)
    for j, (name, values) in enumerate(series.items()):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, ys, width, label=name)
        for bar, v in zip(bars, values):
            if v is not None:
                ax.annotate(f"{v:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
    if baseline is not None:
        ax.axhline(baseline, color="gray", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    top = max((v for vs in series.values() for v in vs if v is not None), default=1.0)
    ax.set_ylim(0, max(top, baseline or 0.0) * 1.2)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
