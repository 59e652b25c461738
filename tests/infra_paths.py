"""Where the infra checks (tests/unit/test_infra_*.py) find what infra/ ships."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"


def infra_files() -> list[Path]:
    """The files infra/ ships: not the bytecode a test that imports one of its scripts
    leaves in ``__pycache__``."""
    return sorted(p for p in INFRA.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
