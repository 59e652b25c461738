"""Typed results of the SDK: what the broker's JSON answers hold, as dataclasses with
documented fields.

Each model keeps the answer it was read from as ``raw`` (fields a newer broker adds are
there), and reads like that dict too (``account["available_micro"]``, ``quote.get(...)``,
``account == {...}``), so code written against the dict answers keeps working. Money is
integer micro-credits (1 credit = 1,000,000) in fields ending ``_micro``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


class _Model:
    """Dict-compatible reading of a typed answer (see the module docstring)."""

    raw: dict

    @classmethod
    def from_json(cls, body: Mapping[str, Any]):
        names = {f.name for f in fields(cls)} - {"raw"}
        kwargs = {k: body[k] for k in names if k in body}
        return cls(**kwargs, raw=dict(body))

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Model):
            return type(other) is type(self) and other.raw == self.raw
        if isinstance(other, Mapping):
            return dict(other) == self.raw
        return NotImplemented

    __hash__ = None  # type: ignore[assignment] - mutable, like the dict it stands for


@dataclass(eq=False)
class Event(_Model):
    """One server-sent event of a job: ``id`` (resume after it with ``after=``), ``kind``
    (queued, assigned, running, progress, preview, token, requeued, done, failed,
    cancelled, refunded) and its ``data`` (``progress``: step, total, message; ``token``:
    text; ``preview``: a small data: URL image of the output so far, :attr:`preview`)."""
    id: int
    kind: str
    data: dict
    raw: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if not self.raw:
            self.raw = {"id": self.id, "kind": self.kind, "data": self.data}

    @property
    def step(self) -> int | None:
        return self.data.get("step")

    @property
    def total(self) -> int | None:
        return self.data.get("total")

    @property
    def text(self) -> str:
        return str(self.data.get("text", ""))

    @property
    def preview(self) -> bytes | None:
        """A "preview" event's thumbnail of the output so far (WebP bytes), else None."""
        url = self.data.get("preview") if self.kind == "preview" else None
        if not isinstance(url, str) or ";base64," not in url:
            return None
        import base64

        return base64.b64decode(url.split(";base64,", 1)[1])


@dataclass(eq=False)
class Quote(_Model):
    """What a job would cost, without running it. ``work_units`` as the plugin's formula
    counts them; ``min_micro`` / ``expected_micro`` / ``max_micro`` the charge at the
    lowest, the expected and the highest clearing price; ``held_at_submit_micro`` what a
    submit holds (the max); ``royalty_micro`` the adapters' publishers' share."""
    plugin: str = ""
    version: str = ""
    work_units: float = 0.0
    min_micro: int = 0
    expected_micro: int = 0
    max_micro: int = 0
    held_at_submit_micro: int = 0
    royalty_micro: int = 0
    raw: dict = field(default_factory=dict, repr=False)


@dataclass(eq=False)
class Account(_Model):
    """The caller's account: ``role`` (client, provider, publisher, admin), balances in
    micro-credits (``available_micro`` to spend or pay out, ``held_micro`` by running
    jobs, ``vesting_micro`` earned and not yet vested, ``stake_micro`` at stake,
    ``paid_out_micro``) and ``funding`` (``stripe``, or ``dev`` where an admin grants
    credits)."""
    id: str = ""
    role: str = ""
    funding: str = ""
    available_micro: int = 0
    held_micro: int = 0
    vesting_micro: int = 0
    stake_micro: int = 0
    paid_out_micro: int = 0
    raw: dict = field(default_factory=dict, repr=False)


@dataclass(eq=False)
class Transaction(_Model):
    """One ledger line of the account: ``amount_micro`` (negative: taken), ``kind`` (hold,
    release, post, deposit…), ``account`` (which balance: available, held, vesting,
    stake), ``memo`` ("job <id>" for a job's lines), ``hold_id`` and ``created_at``
    (ISO 8601)."""
    transaction_id: str = ""
    kind: str = ""
    account: str = ""
    amount_micro: int = 0
    created_at: str = ""
    memo: str = ""
    hold_id: str | None = None
    raw: dict = field(default_factory=dict, repr=False)


@dataclass(eq=False)
class OutputInfo(_Model):
    """One output of a settled job: its ``index``, ``media_type``, ``sha256``, ``size``
    (bytes), ``url`` (under the broker; fetched with the key) and the plugin's ``meta``
    as the provider signed it (seed, token ids, latent hash…)."""
    index: int = 0
    media_type: str = ""
    sha256: str = ""
    size: int = 0
    url: str = ""
    meta: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict, repr=False)


@dataclass(eq=False)
class JobInfo(_Model):
    """A job's record. ``state``: queued, matched, running, submitted, verifying,
    disputed, settled, failed, cancelled or refunded; ``progress_step`` of
    ``progress_total``; ``price_micro_per_unit``: the auction's clearing price once
    assigned; ``verification``: unchecked, checking, verified, disputed, overturned or
    nondeterministic; ``error``: {code, message} of a job that failed; ``outputs``: once
    settled (not in list summaries). Times are Unix seconds (None until they happen)."""
    id: str = ""
    plugin: str = ""
    version: str = ""
    state: str = ""
    attempt: int = 0
    inputs: dict = field(default_factory=dict)
    work_units: float = 0.0
    provider_id: str | None = None
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    error: dict | None = None
    priority: str | None = None
    price_micro_per_unit: int | None = None
    batch_id: str | None = None
    outputs: list[OutputInfo] = field(default_factory=list)
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "JobInfo":
        info = super().from_json(body)
        info.outputs = [OutputInfo.from_json(o) for o in body.get("outputs") or []]
        return info

    @property
    def progress_step(self) -> int:
        return int((self.raw.get("progress") or {}).get("step") or 0)

    @property
    def progress_total(self) -> int:
        return int((self.raw.get("progress") or {}).get("total") or 0)

    @property
    def verification(self) -> str:
        return (self.raw.get("verification") or {}).get("status", "unchecked")
