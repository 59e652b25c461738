"""bench/dispatch.py's SVG (make bench): a band per database, each with the raw queue's bars
beside ours and the ratio between them printed."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from bench import dispatch  # the package, not bench/ on sys.path: its names would shadow


def _rows(ours: float, raw: float) -> list[dict]:
    return [{"agents": n, "jobs_per_s": ours, "raw_jobs_per_s": raw,
             "cpu_ms": {"broker": 5.0, "agents": 1.0, "database": 2.0}} for n in (1, 2, 4)]


def test_one_band_per_database_with_its_ratios(tmp_path):
    path = tmp_path / "bench.svg"
    dispatch.write_svg([("SQLite", _rows(200, 2000)), ("PostgreSQL", _rows(90, 1000))], path, 2)
    root = ET.parse(path).getroot()  # well-formed
    ns = "{http://www.w3.org/2000/svg}"
    bands = root.findall(f"{ns}g")
    assert len(bands) == 2
    texts = ["".join(t.itertext()) for band in bands for t in band.iter(f"{ns}text")]
    assert any("SQLite" in t for t in texts) and any("PostgreSQL" in t for t in texts)
    assert any("1: 0.10×, 2: 0.10×, 4: 0.10×" in t for t in texts)
    assert any("1: 0.09×, 2: 0.09×, 4: 0.09×" in t for t in texts)
    assert sum(t == "raw 1" for t in texts) == 2  # the raw queue's bar in each band
    assert float(root.get("height")) > 2 * 280


def test_a_row_without_the_raw_queue_draws_without_a_ratio(tmp_path):
    path = tmp_path / "bench.svg"
    rows = [{"agents": 1, "jobs_per_s": 150, "cpu_ms": {"broker": 5.0}}]  # --no-raw
    dispatch.write_svg([("SQLite", rows)], path, 2)
    text = path.read_text()
    assert "raw 1" not in text and "ours ÷ raw" not in text
