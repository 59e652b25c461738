"""Were claimed tokens *sampled* as the job asked? A test of sampled text (DESIGN §6).

Teacher-forced scores say that each claimed token is possible under the job's model. They
do not say that the tokens were drawn from the distribution the job asked for: greedy
output, or output sampled colder, hotter or from a narrower nucleus than asked, is made of
possible tokens too. This module tests a whole claim against honest sampling.

**What the checker reports** for each claimed token x (``Position``), from its
teacher-forced pass at the job's temperature and top_p: x's log-probability before top_p;
the mass of the tokens likelier than x, and of those exactly as likely (x included); the
mass of the likeliest tokens; the mass the nucleus keeps; and, for a few powers g, the log
of the sum over the nucleus of q(y)^g, q being the distribution sampled from.

**The evidence** is an e-value: the equal-weight mixture, over the alternatives below, of
the product over the tested positions of each alternative's likelihood ratio to q. Under
honest sampling each product is a test martingale (its expectation is 1 after every
position, given everything before), so by Ville's inequality the mixture *ever* reaches
``1/α`` with probability at most ``α``, whatever the claim's length, wherever it stopped,
whichever positions are tested (a position is chosen only from what came before it) and
whatever the model. The false-alarm rate of each bound is at most its ``α`` by
construction; ``bench/text_checks.py`` measures it across numeric paths (the ratios use the
checker's distribution, which another numeric path's sampler only approximates). The
alternatives:

* ``greedy``: the likeliest token but ``GREEDY_SLIP`` of the time (its ratio at a position
  is 0.95 / the likeliest tokens' share there when the claim took one of them): greedy
  output claimed as sampled;
* ``tilt<g>``: q sharpened (g > 1: sampled colder, or from a narrower nucleus) or
  flattened (g < 1: hotter) by the power g within the nucleus, q(x)^g / Σ q^g, ratio
  q(x)^(g−1) / Σ q^g: the likelihood ratio of sampling at temperature T/g, whose statistic
  is the claimed tokens' summed log-probability;
* ``low`` / ``high``: the randomised probability integral transform
  u = (mass above x + V · mass tied with x) / nucleus mass, uniform on [0, 1] under honest
  sampling (V uniform, drawn by the broker), pulled towards 0 or pushed towards 1 (tokens
  at the nucleus' tail, or past it: u is clipped to 1). Shape alternatives the others miss.

Two bounds: ``reject`` (α = 1e-9: a clear mismatch, grounds for a slash once a third run
agrees) and ``doubt`` (α = 1e-4: a grey zone, which brings a third run and never a slash).

**Power.** A short claim, or one whose positions are nearly certain, cannot show how it was
sampled: the test could not reject it even were every token the likeliest (the figures say
``power: "low"``). Greedy output there is not rejected; its evidence can still reach
``doubt`` (a third run, and if that agrees the provider loses the job's credits and its run
of valid checks, so that it is checked more often: the escalation). Positions where the
likeliest tokens hold all but ``1 − CERTAIN_SHARE`` of the mass are not tested: every
sampler takes them there. Nor are positions the checker did not score by teacher forcing
(a re-run's, from where it parts from the claim: the scoring run that follows tests them).

**Across checks** (``SamplingState``): one check of a claim sampled from a narrower nucleus
than asked reaches ``doubt`` (e^11–e^16 on the tiny llama) but not ``reject`` (e^20.7):
a grey zone, never a slash. The successive checks of one provider's claims (per plugin)
compound: given everything before, each check's e-value has expectation at most 1 under
honest sampling (its claim is a fresh draw, which claims are checked is the broker's
draw), so products of successive e-values are test supermartingales too. The broker keeps
the mixture, over the check k at which a provider may have started cheating, of the
product of the e-values from check k on, with weight w_k = 1/(k(k+1)) (Σ w_k = 1):

    M_n = S_n + 1/(n+1),   S_n = e_n · (S_{n−1} + w_n),   S_0 = 0, M_0 = 1

(a check k not reached yet stands at 1: their weights sum to 1/(n+1)). M is a test
supermartingale under honest sampling, so by Ville's inequality an honest provider's M
*ever* reaches ``1/α`` with probability at most ``α`` (``reject``: 1e-9 per provider and
plugin; over 10^5 honest providers and a few plugins at most ~10^-3 that any is ever
accused, and an accusation still needs a third run's own compounded evidence to agree).
Unlike the plain product from the first check, M cannot be banked: a provider honest for
its first k − 1 checks that then cheats pays only log(k(k+1)) nats for starting late, not
the drift of its honest checks' e-values below 1. Nothing resets it (an e-process reset
at will would lose Ville's bound); a slash closes it and a fresh one starts (an honest
provider's first alarm is the only one that could be false, so its bound stays α).

V comes from a hash of ``salt`` (the broker passes the id of the run it judges the claim
against, which the claiming provider never sees) and the position, so a judgement can be
recomputed.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

#: Positions where the likeliest tokens hold at least this share are not tested.
CERTAIN_SHARE = 0.999
#: What the ``greedy`` alternative leaves to other tokens (a greedy claim made on another
#: numeric path can flip a near-tie now and then).
GREEDY_SLIP = 0.05
#: Strength of the ``low`` / ``high`` alternatives: densities k·e^(−k·u) / (1 − e^(−k)).
PIT_STRENGTH = 10.0
#: The powers g of the ``tilt`` alternatives (the llama plugin reports log Σ q^g for these,
#: its ``TILTS``; others a checker reports are ignored: the mixture is fixed beforehand).
TILTS = (0.6, 1.5, 3.0)
#: The largest log-ratio one position may add (a token the checker gives ~0 probability):
#: lowering a ratio keeps the product a test martingale.
MAX_LOG_RATIO = 30.0


@dataclass(frozen=True)
class Position:
    """The checker's teacher-forced view of one claimed token, at the job's temperature
    (masses before top_p, except ``tilts``; see the module docstring)."""

    lp: float                 # log p(x) at the job's temperature, before top_p
    mass_above: float
    mass_tied: float          # tokens exactly as likely as x, x included
    top_mass: float           # the likeliest tokens (tied for the top)
    nucleus_mass: float       # what top_p keeps (1 without top_p)
    tilts: tuple[tuple[float, float], ...] = ()  # (g, log Σ_nucleus q^g)

    @property
    def top_share(self) -> float:
        """The likeliest tokens' share of the distribution sampled from."""
        return min(1.0, self.top_mass / self.nucleus_mass) if self.nucleus_mass > 0 else 1.0

    @classmethod
    def of(cls, score: dict[str, Any]) -> "Position | None":
        """From an entry of a llama run's ``meta["scores"]``; None when it lacks the fields
        (a greedy job, an older plugin build, a checkpoint's null)."""
        if not isinstance(score, dict) or "nucleus_mass" not in score:
            return None
        try:
            return cls(lp=float(score["lp_t"]), mass_above=float(score["mass_above"]),
                       mass_tied=float(score["mass_tied"]), top_mass=float(score["top_mass"]),
                       nucleus_mass=float(score["nucleus_mass"]),
                       tilts=tuple((float(g), float(v)) for g, v in score.get("tilts") or ()))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class SamplingBounds:
    """The e-value bounds: their α are the false-alarm rates (at most)."""

    reject: float = 1e-9
    doubt: float = 1e-4

    def __post_init__(self) -> None:
        if not 0.0 < self.reject <= self.doubt < 1.0:
            raise ValueError(f"need 0 < reject <= doubt < 1: {self}")


@dataclass(frozen=True)
class SamplingEvidence:
    """The test's answer. ``verdict``: "pass", "doubt" or "reject"; ``power``: "enough",
    or "low" where even an all-greedy claim over these positions would not be rejected."""

    verdict: str
    tested: int
    log_e: float
    log_e_greedy: float   # what an all-greedy claim over the same positions would reach
    power: str
    alternative: str      # the alternative that weighs most
    mean_u: float
    # the claiming provider's evidence across its checks with this one (``SamplingState``);
    # None when the judgement was given no prior (a checker's run, a pure test)
    compounded: "SamplingState | None" = None

    def figures(self) -> dict[str, Any]:
        out = {"verdict": self.verdict, "tested": self.tested, "log_e": round(self.log_e, 3),
               "log_e_greedy": round(self.log_e_greedy, 3), "power": self.power,
               "alternative": self.alternative, "mean_u": round(self.mean_u, 4)}
        if self.compounded is not None:
            out["compounded"] = {"checks": self.compounded.checks,
                                 "log_m": round(self.compounded.log_m, 3)}
        return out

    @property
    def reason(self) -> str:
        kind = self.alternative.rstrip("0123456789.")
        what = {"greedy": "the likeliest token far more often than sampling takes it",
                "tilt": ("likelier tokens than sampling at the job's temperature and top_p "
                         "gives" if _power(self.alternative) > 1 else
                         "less likely tokens than sampling at the job's temperature gives"),
                "low": "likelier tokens than sampling at the job's temperature and top_p gives",
                "high": "less likely tokens than sampling at the job's temperature and top_p "
                        "gives"}.get(kind, "")
        across = (f"; compounded over its last {self.compounded.checks} checked claims "
                  f"e^{self.compounded.log_m:.1f}" if self.compounded is not None
                  and self.compounded.checks > 1 else "")
        return (f"the tokens do not look sampled as the job asked: {self.tested} tested "
                f"tokens took {what} (evidence e^{self.log_e:.1f}{across}; mean PIT "
                f"{self.mean_u:.2f}, 0.5 expected)")


def _power(name: str) -> float:
    try:
        return float(name.removeprefix("tilt"))
    except ValueError:
        return 1.0


def uniform(salt: bytes, index: int) -> float:
    """V for position ``index``: uniform on [0, 1), fixed by ``salt`` and the position."""
    h = hashlib.sha256(salt + b":" + str(index).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def pit(position: Position, v: float) -> float:
    """u of one claimed token, clipped to [0, 1] (past 1: outside the checker's nucleus)."""
    m = position.nucleus_mass
    if not m > 0:
        return 1.0
    return min(1.0, max(0.0, (position.mass_above + v * position.mass_tied) / m))


def _pit_log_density(u: float) -> float:
    k = PIT_STRENGTH
    return math.log(k / -math.expm1(-k)) - k * u


@dataclass(frozen=True)
class SamplingState:
    """A provider's sampled-text evidence across its checked claims of one plugin (see the
    module docstring): ``checks`` e-values compounded, ``log_s`` = log S_n (None: S = 0)."""

    checks: int = 0
    log_s: float | None = None

    def __post_init__(self) -> None:
        if self.checks < 0 or (self.log_s is not None and math.isnan(self.log_s)):
            raise ValueError(f"need checks >= 0 and log_s a number or None: {self}")

    @property
    def log_m(self) -> float:
        """log M_n: the evidence against honest sampling (0 before any check)."""
        rest = -math.log(self.checks + 1)
        return rest if self.log_s is None else _log_add(self.log_s, rest)

    def after(self, log_e: float) -> "SamplingState":
        """The state after one more check whose e-value is e^``log_e``."""
        if math.isnan(log_e):
            raise ValueError("log_e is NaN: an e-value must be a number")
        n = self.checks + 1
        log_w = -math.log(n) - math.log(n + 1)
        base = log_w if self.log_s is None else _log_add(self.log_s, log_w)
        return SamplingState(n, max(-1e300, min(1e300, base + log_e)))

    def crossed(self, bounds: "SamplingBounds") -> bool:
        return self.log_m >= -math.log(bounds.reject)


def _log_add(a: float, b: float) -> float:
    top = max(a, b)
    return top + math.log1p(math.exp(min(a, b) - top))


def sampling_evidence(positions: Sequence[Position | None], salt: bytes,
                      bounds: SamplingBounds = SamplingBounds(),
                      prior: SamplingState | None = None) -> SamplingEvidence:
    """Test the claimed tokens (the checker's view of each, in order; None where it has
    none: not tested) against honest sampling; see the module docstring. ``prior``: the
    claiming provider's evidence from its earlier checks; when given, the claim is also
    rejected when the compounded evidence with this check reaches the reject bound."""
    logs: dict[str, float] = {"greedy": 0.0, "low": 0.0, "high": 0.0,
                              **{f"tilt{g:g}": 0.0 for g in TILTS}}
    best_greedy = 0.0
    us: list[float] = []
    for i, pos in enumerate(positions):
        if pos is None:
            continue
        share = pos.top_share
        if not 0.0 < share < CERTAIN_SHARE:
            continue
        u = pit(pos, uniform(salt, i))
        us.append(u)
        greedy_ok = math.log((1.0 - GREEDY_SLIP) / share)
        logs["greedy"] += (greedy_ok if pos.mass_above <= 0.0
                           else math.log(GREEDY_SLIP / (1.0 - share)))
        best_greedy += greedy_ok
        logs["low"] += _pit_log_density(u)
        logs["high"] += _pit_log_density(1.0 - u)
        log_q = pos.lp - math.log(pos.nucleus_mass)
        for g, log_sum in pos.tilts:
            key = f"tilt{g:g}"
            if key in logs:
                logs[key] += min(MAX_LOG_RATIO, (g - 1.0) * log_q - log_sum)
    log_e = _log_mean_exp(list(logs.values()))
    log_e_greedy = best_greedy - math.log(len(logs))
    alternative = max(logs, key=logs.__getitem__)
    power = "enough" if log_e_greedy >= -math.log(bounds.reject) else "low"
    compounded = prior.after(log_e) if prior is not None else None
    if log_e >= -math.log(bounds.reject) or (compounded is not None
                                             and compounded.crossed(bounds)):
        verdict = "reject"
    elif log_e >= -math.log(bounds.doubt):
        verdict = "doubt"
    else:
        verdict = "pass"
    return SamplingEvidence(verdict, len(us), log_e, log_e_greedy, power, alternative,
                            sum(us) / len(us) if us else 0.5, compounded)


def _log_mean_exp(xs: list[float]) -> float:
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs) / len(xs))
