"""Progress of package downloads in the agent's installer (issue #25)."""
from __future__ import annotations

import io
import logging

from provider_agent.installer import PROGRESS_MIN_BYTES, download_progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_large_download_draws_a_bar_on_a_terminal():
    out = _Tty()
    bar = download_progress("sd15@1.0.0 unet.safetensors", 3 * PROGRESS_MIN_BYTES, out)
    for _ in range(3):
        bar.update(PROGRESS_MIN_BYTES)
    bar.close()
    assert "sd15@1.0.0 unet.safetensors" in out.getvalue() and "24.0M" in out.getvalue()


def test_off_a_terminal_one_log_line_and_small_files_say_nothing(caplog):
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="agent.installer"):
        download_progress("big.bin", PROGRESS_MIN_BYTES * 2, out).update(1)
        download_progress("small.json", 100, _Tty()).update(100)
    assert [r.getMessage() for r in caplog.records] == ["downloading big.bin (16.0 MiB)"]
    assert out.getvalue() == ""
