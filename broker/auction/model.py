"""Values of the auction: standing asks, job specifications, the market's rules and the
clearing result. All immutable; money is ``int`` micro-credits (1 credit = 1,000,000 micro),
times are seconds, work is in the plugin's work units (SD: steps x megapixels; Llama: tokens).
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .errors import InvalidJob

MICRO_PER_CREDIT = 1_000_000


class Priority(str, enum.Enum):
    """How much the client values time. Mapped to lambda (micro-credits per second of
    expected completion) by :class:`AuctionRules`."""

    ECONOMY = "economy"
    STANDARD = "standard"
    FAST = "fast"


#: Default lambda per priority, in micro-credits per second of expected completion time.
#: economy: 10 micro/s (0.036 credits per hour of waiting) - price almost decides alone;
#: standard: 100 micro/s - ten seconds faster is worth 0.001 credits, about what a 512x512,
#:           30-step SD 1.5 image costs at 100-200 micro per unit;
#: fast: 1,000 micro/s - speed dominates unless prices differ tenfold.
DEFAULT_LAMBDA_MICRO_PER_S: Mapping[Priority, int] = MappingProxyType({
    Priority.ECONOMY: 10,
    Priority.STANDARD: 100,
    Priority.FAST: 1_000,
})


@dataclass(frozen=True, slots=True)
class AuctionRules:
    """The admin-set rules of the market (one object, passed in; never read from globals).

    ``failure_penalty_micro`` is the default F of the score's ``(1 - reliability)·F``: what a
    failed attempt costs the client (re-queue, lost time), 0.01 credits by default, so a
    provider that fails 10% of jobs carries a 1,000-micro handicap - ten seconds at standard
    priority. ``claimed_throughput_factor`` is applied to a throughput that the broker has not
    measured yet: 0 (the default) makes such asks ineligible, as DESIGN §4 requires; an admin
    may set e.g. 0.5 to let new providers in on a discounted claim (claims are not verified,
    so a factor above 0 opens a channel for exaggeration). ``reputation_floor``: asks whose
    ``reputation`` is under it are not eligible while any ask at or above it could take the
    job (see :func:`clearing.floor_gives_way`). The ``max_*`` bounds reject absurd asks and
    impossible benchmark figures."""

    lambda_micro_per_s: Mapping[Priority, int] = field(
        default_factory=lambda: DEFAULT_LAMBDA_MICRO_PER_S)
    failure_penalty_micro: int = 10_000
    reputation_floor: float = 0.0
    claimed_throughput_factor: float = 0.0
    max_ask_micro_per_unit: int = 100 * MICRO_PER_CREDIT
    max_throughput_units_per_s: float = 1e6
    max_vram_gb: float = 4096.0
    max_queue_s: float = 7 * 86_400.0
    max_cold_start_s: float = 3_600.0
    max_slots: int = 1_024
    max_cached_views: int = 8

    def lambda_for(self, priority: Priority) -> int:
        return self.lambda_micro_per_s[Priority(priority)]


@dataclass(frozen=True, slots=True)
class Ask:
    """A provider's sealed standing ask for one plugin build, with the capacity facts the
    score needs. Posted by the agent, completed by the broker (measured throughput,
    reliability, reputation, linked accounts, online state and free slots).

    ``throughput_units_per_s`` is the broker's measured figure when it has one
    (``throughput_measured=True``), else the agent's claim. ``queue_s`` is the expected wait
    before the provider could start; ``cold_start_s`` 0 when the model is warm.
    ``linked_accounts`` are client accounts tied to this provider (its owner's own client
    account, shared payment details...): it may not serve their jobs. ``expires_at_s``
    (epoch seconds) makes a stale ask ineligible without a write."""

    provider_id: str
    operator_id: str
    plugin: str
    plugin_version: str
    weights_digest: str
    price_micro_per_unit: int
    throughput_units_per_s: float
    throughput_measured: bool = True
    queue_s: float = 0.0
    cold_start_s: float = 0.0
    reliability: float = 1.0
    reputation: float = 1.0
    online: bool = True
    slots_free: int = 1
    vram_gb: float = 0.0
    linked_accounts: frozenset[str] = field(default_factory=frozenset)
    expires_at_s: float | None = None

    @property
    def build_key(self) -> tuple[str, str, str]:
        """(plugin, version, weights digest): the order book's bucket."""
        return (self.plugin, self.plugin_version, self.weights_digest)

    @property
    def key(self) -> tuple[str, str, str, str]:
        """A provider has at most one standing ask per plugin build."""
        return (self.provider_id, self.plugin, self.plugin_version, self.weights_digest)


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What the auction needs to know about a job.

    ``work_units`` is the work of **one slot** (one image of a split batch); ``n_slots``
    siblings run on different providers where possible. ``reserve_micro_per_unit`` is the
    admin-set reserve: no ask above it is eligible and nobody is paid more.
    ``max_price_micro`` caps the **whole** job (all slots) and acts as a lower reserve.
    ``deadline_s`` bounds the expected completion time (seconds from clearing).
    ``failure_penalty_micro`` overrides the rules' F for this job (each distinct value
    builds its own index in the book: keep the set of values small).
    ``excluded_provider_ids`` / ``excluded_operator_ids`` keep out providers that already
    failed this job, or the first provider's operator for a verification re-run (§6).
    ``floor_lifted`` is set by the auction itself when the reputation floor gives way for
    this job (see :func:`clearing.floor_gives_way`); callers leave it False."""

    plugin: str
    plugin_version: str
    weights_digest: str
    work_units: float
    client_id: str
    reserve_micro_per_unit: int
    min_vram_gb: float = 0.0
    priority: Priority = Priority.STANDARD
    max_price_micro: int | None = None
    deadline_s: float | None = None
    n_slots: int = 1
    failure_penalty_micro: int | None = None
    excluded_provider_ids: frozenset[str] = frozenset()
    excluded_operator_ids: frozenset[str] = frozenset()
    job_id: str | None = None
    floor_lifted: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.work_units, (int, float)) and math.isfinite(self.work_units)
                and self.work_units > 0):
            raise InvalidJob("work_units", self.work_units, "a finite number above 0")
        if not isinstance(self.reserve_micro_per_unit, int) or self.reserve_micro_per_unit <= 0:
            raise InvalidJob("reserve_micro_per_unit", self.reserve_micro_per_unit,
                             "a positive integer (micro-credits per work unit)")
        if not isinstance(self.n_slots, int) or self.n_slots < 1:
            raise InvalidJob("n_slots", self.n_slots, "an integer of at least 1")
        if self.max_price_micro is not None and (
                not isinstance(self.max_price_micro, int) or self.max_price_micro <= 0):
            raise InvalidJob("max_price_micro", self.max_price_micro,
                             "None or a positive integer (micro-credits for the whole job)")
        if self.deadline_s is not None and not (self.deadline_s > 0):
            raise InvalidJob("deadline_s", self.deadline_s, "None or a number of seconds above 0")
        if self.failure_penalty_micro is not None and (
                not isinstance(self.failure_penalty_micro, int) or self.failure_penalty_micro < 0):
            raise InvalidJob("failure_penalty_micro", self.failure_penalty_micro,
                             "None or an integer of at least 0")
        if not math.isfinite(self.min_vram_gb) or self.min_vram_gb < 0:
            raise InvalidJob("min_vram_gb", self.min_vram_gb, "a finite number of at least 0")
        for name in ("excluded_provider_ids", "excluded_operator_ids"):
            if not isinstance(getattr(self, name), frozenset):
                raise InvalidJob(name, getattr(self, name), "a frozenset of ids")
        try:
            object.__setattr__(self, "priority", Priority(self.priority))
        except ValueError:
            raise InvalidJob("priority", self.priority,
                             "one of " + ", ".join(p.value for p in Priority)) from None

    @property
    def build_key(self) -> tuple[str, str, str]:
        return (self.plugin, self.plugin_version, self.weights_digest)

    @property
    def build_label(self) -> str:
        return f"{self.plugin}@{self.plugin_version} (weights {self.weights_digest[:12]})"


@dataclass(frozen=True, slots=True)
class Award:
    """One slot won. ``price_micro_per_unit`` is the clearing price paid to this winner (its
    critical ask, or the reserve when nobody competed); ``payment_micro`` = price x work
    units, rounded down. ``price_set_by`` is "runner_up" or "reserve". The winner's own ask is
    deliberately absent: asks are never revealed."""

    slot: int
    provider_id: str
    operator_id: str
    price_micro_per_unit: int
    payment_micro: int
    expected_completion_s: float
    price_set_by: str


@dataclass(frozen=True, slots=True)
class ClearingResult:
    """The outcome of clearing one job. ``unfilled_slots`` > 0 when a split found fewer free
    slots than siblings: the broker keeps those siblings queued. ``reserve_micro_per_unit``
    is the effective reserve (the admin reserve, lowered by the client's max price).
    ``floor_lifted``: nobody at or above the reputation floor could take the job, so
    providers under it competed (see :func:`clearing.floor_gives_way`)."""

    job_id: str | None
    build_key: tuple[str, str, str]
    awards: tuple[Award, ...]
    unfilled_slots: int
    reserve_micro_per_unit: int
    cleared_at_s: float
    floor_lifted: bool = False

    @property
    def total_payment_micro(self) -> int:
        return sum(a.payment_micro for a in self.awards)

    @property
    def winner(self) -> Award:
        """The award of a single-slot job."""
        return self.awards[0]
