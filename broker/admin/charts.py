"""Small inline SVG charts, rendered on the server (no scripts, nothing fetched)."""
from __future__ import annotations

from datetime import datetime
from html import escape

from markupsafe import Markup

W, H, PAD_L, PAD_B, PAD_T = 360, 120, 34, 18, 8


def _fmt(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:.1f}k"
    if v == int(v):
        return f"{v:.0f}"
    return f"{v:.2g}" if v < 1 else f"{v:.1f}"


def chart(points: list[tuple[float, float | None]], *, kind: str = "line", label: str = "",
          color: str = "#4f7cff") -> Markup:
    """A line or bar chart of (epoch seconds, value) points; None values are gaps."""
    values = [v for _, v in points if v is not None]
    top = max(values) if values else 0
    top = top * 1.15 if top > 0 else 1
    n = max(1, len(points))
    iw, ih = W - PAD_L - 4, H - PAD_B - PAD_T
    x = lambda i: PAD_L + (i + 0.5) * iw / n  # noqa: E731
    y = lambda v: PAD_T + ih - (v / top) * ih  # noqa: E731
    parts = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(label)}">']
    for frac in (0, 0.5, 1):
        gy = PAD_T + ih - frac * ih
        parts.append(f'<line x1="{PAD_L}" x2="{W - 4}" y1="{gy:.1f}" y2="{gy:.1f}" class="grid"/>')
        parts.append(f'<text x="{PAD_L - 4}" y="{gy + 3:.1f}" class="axis" text-anchor="end">'
                     f'{_fmt(top * frac / 1.15) if frac else 0}</text>')
    if kind == "bar":
        bw = max(1.0, iw / n - 1.5)
        for i, (_, v) in enumerate(points):
            if v:
                parts.append(f'<rect x="{x(i) - bw / 2:.1f}" y="{y(v):.1f}" width="{bw:.1f}" '
                             f'height="{PAD_T + ih - y(v):.1f}" fill="{color}" rx="1"/>')
    else:
        segs, cur = [], []
        for i, (_, v) in enumerate(points):
            if v is None:
                if cur:
                    segs.append(cur)
                cur = []
            else:
                cur.append(f"{x(i):.1f},{y(v):.1f}")
        if cur:
            segs.append(cur)
        for seg in segs:
            if len(seg) == 1:
                cx, cy = seg[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>')
            else:
                parts.append(f'<polyline points="{" ".join(seg)}" fill="none" stroke="{color}" '
                             'stroke-width="2" stroke-linejoin="round"/>')
    if points:
        for i in (0, len(points) - 1):
            t = datetime.fromtimestamp(points[i][0]).strftime("%H:%M")
            anchor = "start" if i == 0 else "end"
            parts.append(f'<text x="{x(i):.1f}" y="{H - 4}" class="axis" text-anchor="{anchor}">{t}</text>')
    if not values:
        parts.append(f'<text x="{W / 2 + PAD_L / 2}" y="{H / 2}" class="empty" '
                     'text-anchor="middle">no data in the last hour</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


#: Verification statuses in the order and colours the console shows them.
STATUS_COLORS = (("verified", "#17a05d"), ("checking", "#d9900b"), ("disputed", "#e5484d"),
                 ("overturned", "#b4231f"), ("nondeterministic", "#7828c8"),
                 ("unchecked", "#c3c8d4"))


def status_bar(counts: dict[str, int], *, height: int = 14) -> Markup:
    """A stacked horizontal bar of verification statuses (an SVG: no inline styles)."""
    total = sum(max(0, int(counts.get(k, 0))) for k, _ in STATUS_COLORS)
    parts = [f'<svg class="vbar" viewBox="0 0 1000 {height}" preserveAspectRatio="none" '
             f'role="img" aria-label="verification statuses">']
    x = 0.0
    for key, color in STATUS_COLORS:
        n = max(0, int(counts.get(key, 0)))
        if not n or not total:
            continue
        w = 1000 * n / total
        parts.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{color}">'
                     f'<title>{escape(key)}: {n}</title></rect>')
        x += w
    parts.append("</svg>")
    return Markup("".join(parts))
