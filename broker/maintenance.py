"""Periodic money housekeeping: expire holds whose time ran out and vest providers' earnings
whose window has passed (DESIGN §5, §6). One small thread per broker; every step is
idempotent, so several broker replicas may run it at once."""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class Maintenance:
    def __init__(self, ledger, providers, *, interval_s: float = 5.0):
        self.ledger = ledger
        self.providers = providers
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tasks: list = []  # more idempotent sweeps (verification's), run each pass

    def run_once(self) -> dict:
        """One pass: returns how many holds expired and how many providers vested."""
        expired = len(self.ledger.expire_due())
        vested = 0
        for owner in self.providers.owners():
            try:
                if self.ledger.vest(owner) is not None:
                    vested += 1
            except Exception:  # noqa: BLE001 - one account must not stop everyone's vesting
                log.exception("vesting for provider account %s failed", owner)
        for task in self.tasks:
            try:
                task()
            except Exception:  # noqa: BLE001 - the next pass retries
                log.exception("maintenance task %s failed", getattr(task, "__name__", task))
        return {"expired": expired, "vested": vested}

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - keep sweeping; the next pass retries
                log.exception("ledger maintenance pass failed")

    def start(self) -> None:
        if self._thread is None and self.interval_s > 0:
            self._thread = threading.Thread(target=self._loop, name="ledger-maintenance",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
