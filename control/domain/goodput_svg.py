"""A job's timeline as an SVG picture: one bar coloured by goodput bucket, the rounds
above it, each failure marked, and a legend with each bucket's share (pure text out)."""

from __future__ import annotations

from collections.abc import Callable
from xml.sax.saxutils import escape

from rove.control.domain.goodput import Bucket, Failure, Interval, Report
from rove.control.domain.words import counted, local_iso

COLOURS = {
    Bucket.PRODUCTIVE: "#2e7d32",
    Bucket.START_UP: "#90a4ae",
    Bucket.RENDEZVOUS: "#5c6bc0",
    Bucket.RESTORE: "#26a69a",
    Bucket.CHECKPOINT: "#ffb300",
    Bucket.WASTED: "#e53935",
    Bucket.DATA: "#8d6e63",
    Bucket.PENDING: "#ab47bc",
    Bucket.DISRUPTION: "#f4511e",
    Bucket.OTHER: "#cfd8dc",
}

_W, _LEFT, _RIGHT = 1000, 20, 20
_BAR_Y, _BAR_H = 70, 40


def render(report: Report) -> str:
    """The SVG document for `report`: its window of the job's timeline."""
    intervals = report.intervals
    lo, hi = report.start, report.end
    span = max(hi - lo, 1e-9)
    width = _W - _LEFT - _RIGHT

    def x(t: float) -> float:
        return _LEFT + width * (min(max(t, lo), hi) - lo) / span

    parts: list[str] = []
    for iv in intervals:
        if iv.end <= lo or iv.start >= hi:
            continue
        parts.extend(_segment(iv, x))
    rounds: dict[int, float] = {}
    for iv in intervals:
        if iv.round and lo <= iv.start <= hi:
            rounds.setdefault(iv.round, iv.start)
    for n, t in sorted(rounds.items()):
        parts.append(
            f'<line x1="{x(t):.1f}" y1="{_BAR_Y - 14}" x2="{x(t):.1f}" y2="{_BAR_Y + _BAR_H}" '
            'stroke="#37474f" stroke-width="1"/>'
            f'<text x="{x(t) + 2:.1f}" y="{_BAR_Y - 4}" font-size="10">round {n}</text>'
        )
    parts.extend(_failure(fl, x) for fl in report.failures)
    parts.extend(_legend(report))
    title = (
        f"job {report.job}: goodput {report.goodput:.1%} over {_duration(report.total_s)}"
        f" ({counted(report.rounds, 'round')}, {counted(len(report.failures), 'failure')})"
    )
    height = _BAR_Y + _BAR_H + 40 + 18 * ((len(Bucket) + 1) // 2)
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{height}" '
            f'viewBox="0 0 {_W} {height}" font-family="sans-serif">',
            f"<title>{escape(title)}</title>",
            f'<rect width="{_W}" height="{height}" fill="white"/>',
            f'<text x="{_LEFT}" y="24" font-size="15" font-weight="bold">{escape(title)}</text>',
            f'<text x="{_LEFT}" y="42" font-size="11" fill="#546e7a">'
            f"{local_iso(lo)} to {local_iso(hi)}</text>",
            *parts,
            "</svg>",
            "",
        ]
    )


def _segment(iv: Interval, x: Callable[[float], float]) -> list[str]:
    """The interval's rectangle; its carved-out parts (checkpoint blocking, data
    waiting) as stripes at the bottom of it, in proportion."""
    assert callable(x)
    x0, x1 = x(iv.start), x(iv.end)
    out = [
        f'<rect x="{x0:.2f}" y="{_BAR_Y}" width="{max(x1 - x0, 0.3):.2f}" height="{_BAR_H}" '
        f'fill="{COLOURS[iv.bucket]}"><title>{escape(iv.bucket.value)}, round {iv.round}: '
        f"{_duration(iv.end - iv.start)}</title></rect>"
    ]
    y: float = _BAR_Y + _BAR_H
    for bucket, frac in iv.carve:
        h = _BAR_H * frac
        y -= h
        out.append(
            f'<rect x="{x0:.2f}" y="{y:.2f}" width="{max(x1 - x0, 0.3):.2f}" height="{h:.2f}" '
            f'fill="{COLOURS[bucket]}"/>'
        )
    return out


def _failure(fl: Failure, x: Callable[[float], float]) -> str:
    px = x(fl.ts)
    y = _BAR_Y + _BAR_H
    label = f"{fl.what} on {fl.node} at {local_iso(fl.ts)}: {fl.reason}"
    return (
        f'<path d="M{px:.1f},{y + 2} l-5,9 h10 z" fill="#b71c1c">'
        f"<title>{escape(label)}</title></path>"
    )


def _legend(report: Report) -> list[str]:
    out = []
    total = report.total_s or 1.0
    y0 = _BAR_Y + _BAR_H + 36
    for i, bucket in enumerate(Bucket):
        secs = report.seconds.get(bucket, 0.0)
        col, row = i % 2, i // 2
        lx, ly = _LEFT + col * 480, y0 + row * 18
        out.append(
            f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{COLOURS[bucket]}"/>'
            f'<text x="{lx + 18}" y="{ly}" font-size="12">{escape(bucket.value)}: '
            f"{_duration(secs)} ({secs / total:.1%})</text>"
        )
    return out


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
