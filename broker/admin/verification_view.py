"""How the console shows verification (DESIGN §6): comparison figures as table rows, the
sampling reasons and statuses in words, the image and text thresholds as captions.

Pure functions over the plain values verification stores (``Verification.comparisons``,
``Dispute.comparisons``): ``{"primary~checker": {"verdict", "method", "reasons",
"outputs": [per-output figures]}, ...}``. An older or hand-opened dispute may carry one
flat figure dict (``{"ssim": 0.41, "psnr_db": 12.3, ...}``); it is shown as one row.
"""
from __future__ import annotations

import math
from typing import Any

#: Why a job's check probability was what it was (``Verification.reason``).
REASONS = {
    "new_provider": "new provider — checked until it has a record of valid checks",
    "high_value": "high-value job — always checked above the admin's threshold",
    "no_catch_estimate": "no catch-rate estimate for this plugin — always checked",
    "economic_floor": "economic floor p ≥ g / (q·(S + g))",
    "reputation": "reputation — 1 / CV",
    "client_asked": "the client asked for verify=always (and pays for the check)",
    "unseeded": "queued before the broker fixed every job's seed — a check could only "
                "re-run it with the seed its provider reported, so it is not checked",
}

#: What each verification status means for the client's output.
STATUS_TEXT = {
    "unchecked": "not sampled for a check; the output stands as delivered",
    "checking": "a second provider is re-running the job",
    "verified": "another provider's run agrees",
    "disputed": "the runs disagree; a third provider decides 2-of-3",
    "overturned": "the output was wrong: the client got the majority's output and a refund",
    "nondeterministic": "no two runs agree: the client was refunded, nobody slashed",
}

ROLE_ORDER = ("primary", "checker", "tiebreaker")


def role_rank(role: str) -> int:
    """Where a run is shown among a dispute's sides: ``ROLE_ORDER``, then any other role."""
    return ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)


PAIR_ORDER = ("primary~checker", "primary~tiebreaker", "checker~tiebreaker")
METHODS = {"image": "image", "structural": "structural (SSIM / PSNR / pHash)",
           "latent_hash": "latent hash", "text_rescore": "teacher-forced re-score",
           "exact": "exact bytes", "count": "output count"}

#: Table columns: (key, heading, tooltip), shown only when some row has the figure.
COLUMNS = (
    ("ssim", "SSIM", "structural similarity, 1 = identical"),
    ("psnr_db", "PSNR", "peak signal-to-noise ratio in dB (higher is closer)"),
    ("phash_bits", "pHash Δ", "bits that differ between the 64-bit perceptual hashes"),
    ("trace", "Latent trace", "largest relative distance of the two runs' latents at a "
                              "quarter, half, three quarters and all of their steps"),
    ("latent", "Latent hash", "final-latent sha256, compared within one reproducibility class"),
    ("tokens", "Tokens", "tokens re-scored / claimed"),
    ("max_gap", "Max gap", "largest per-token log-prob gap, nats"),
    ("mean_gap", "Mean gap", "mean per-token log-prob gap, nats"),
    ("grey_tokens", "Grey", "tokens in the grey zone"),
    ("bad_positions", "Bad tokens", "positions that fail the re-score"),
    ("end", "Ends by", "the ending the tokens and the job's parameters give (stop, length, "
                       "none = cut short)"),
    ("sampling", "Sampled?", "the test that sampled tokens are a sample of the job's "
                             "distribution: its verdict, evidence and tokens tested"),
    ("exact", "Exact match", "outputs equal byte for byte"),
)


def pair_label(pair: str) -> str:
    a, _, b = pair.partition("~")
    return f"{a} ↔ {b}" if b else pair


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _cells(fig: dict[str, Any], method: str, verdict: str) -> dict[str, str]:
    """The formatted figures of one output's comparison."""
    c: dict[str, str] = {}
    if (v := _num(fig.get("ssim"))) is not None:
        c["ssim"] = f"{v:.4f}"
    if (v := _num(fig.get("psnr_db"))) is not None:
        c["psnr_db"] = "identical" if v >= 99 or math.isinf(v) else f"{v:.1f} dB"
    bits = fig.get("phash_bits", fig.get("phash_distance"))
    if (v := _num(bits)) is not None:
        c["phash_bits"] = f"{int(v)} / 64"
    if "trace_distance" in fig:
        v = _num(fig.get("trace_distance"))
        c["trace"] = f"{v:.4f}" if v is not None else "other schedule"
    if method == "latent_hash" or "latent_hash_equal" in fig:
        equal = fig.get("latent_hash_equal")
        reasons = " ".join(str(r) for r in fig.get("reasons") or [])
        if equal is None:
            equal = verdict == "match" or "latent hashes match" in reasons
        c["latent"] = ("equal" if equal else "differ") + (
            " (PNG differs)" if equal and verdict != "match" else "")
    if "tokens" in fig:
        checked = fig.get("checked_tokens")
        c["tokens"] = (f"{checked} / {fig['tokens']}" if checked is not None
                       else str(fig["tokens"]))
    for key in ("max_gap", "mean_gap"):
        if (v := _num(fig.get(key))) is not None:
            c[key] = f"{v:.3f}"
    if "grey_tokens" in fig:
        c["grey_tokens"] = str(fig["grey_tokens"])
    if "bad_positions" in fig:
        bad = list(fig.get("bad_positions") or [])
        c["bad_positions"] = (", ".join(str(b) for b in bad[:8]) + (" …" if len(bad) > 8 else "")
                              ) if bad else "none"
    if isinstance(fig.get("end"), str):
        c["end"] = fig["end"]
    sampling = fig.get("sampling")
    if isinstance(sampling, dict) and (v := _num(sampling.get("log_e"))) is not None:
        c["sampling"] = (f"{sampling.get('verdict', '?')} (e^{v:.1f}, "
                         f"{sampling.get('tested', '?')} tested"
                         + (", low power" if sampling.get("power") == "low" else "") + ")")
    if "equal" in fig:
        c["exact"] = "yes" if fig["equal"] else "no"
    if "token_rank_ok" in fig:
        c["bad_positions"] = "none" if fig["token_rank_ok"] else "some"
    return c


def comparison_rows(comparisons: dict[str, Any] | None) -> dict[str, Any]:
    """``{"rows": [...], "columns": [(key, heading, tip), ...]}`` for a comparisons dict.

    Each row: ``pair`` (label), ``index`` (output index or None), ``verdict``, ``method``,
    ``cells`` (formatted figures by column key) and ``reasons``."""
    comparisons = comparisons or {}
    rows: list[dict[str, Any]] = []
    nested = bool(comparisons) and all(isinstance(v, dict) for v in comparisons.values())
    if comparisons and not nested:
        verdict = str(comparisons.get("verdict", ""))
        method = str(comparisons.get("method", ""))
        rows.append({"pair": "", "index": None, "verdict": verdict,
                     "method": METHODS.get(method, method),
                     "cells": _cells(comparisons, method, verdict),
                     "reasons": list(comparisons.get("reasons") or [])})
    order = {p: i for i, p in enumerate(PAIR_ORDER)}
    for pair in sorted(comparisons if nested else (), key=lambda p: (order.get(p, 99), p)):
        fig = comparisons[pair]
        verdict = str(fig.get("verdict", ""))
        method = str(fig.get("method", ""))
        outputs = [o for o in fig.get("outputs") or [] if isinstance(o, dict)]
        if not outputs:
            rows.append({"pair": pair_label(pair), "index": None, "verdict": verdict,
                         "method": METHODS.get(method, method),
                         "cells": _cells(fig, method, verdict),
                         "reasons": list(fig.get("reasons") or [])})
            continue
        for i, out in enumerate(outputs):
            o_method = str(out.get("method") or method)
            o_verdict = str(out.get("verdict") or verdict)
            rows.append({"pair": pair_label(pair), "index": out.get("index", i),
                         "verdict": o_verdict, "method": METHODS.get(o_method, o_method),
                         "cells": _cells(out, o_method, o_verdict),
                         "reasons": list(out.get("reasons") or ([] if i else
                                                               fig.get("reasons") or []))})
    present = {k for r in rows for k in r["cells"]}
    return {"rows": rows, "columns": [c for c in COLUMNS if c[0] in present]}


def thresholds_caption(rows: dict[str, Any]) -> str:
    """The thresholds that judged the figures shown, in words ("" when none apply)."""
    keys = {c[0] for c in rows.get("columns", [])}
    parts = []
    if keys & {"ssim", "psnr_db", "phash_bits"}:
        try:
            from broker.verification.comparators import load_image_thresholds
            t = load_image_thresholds()
            parts.append(f"Images match when SSIM ≥ {t.accept_ssim:g}, PSNR ≥ "
                         f"{t.accept_psnr_db:g} dB and pHash Δ ≤ {t.accept_phash_bits}; they "
                         f"mismatch when SSIM < {t.reject_ssim:g}, PSNR < {t.reject_psnr_db:g} "
                         f"dB or pHash Δ > {t.reject_phash_bits}; between is a tie-break.")
            if "trace" in keys and math.isfinite(t.reject_trace):
                parts.append(f"Their latent traces must lie within {t.accept_trace:g} of "
                             f"each other; beyond {t.reject_trace:g}, or of another schedule "
                             f"or size, is a mismatch.")
        except Exception:  # noqa: BLE001 - a caption, never an error page
            pass
    if keys & {"max_gap", "mean_gap", "tokens"}:
        try:
            from broker.verification.comparators import TextThresholds
            t = TextThresholds()
            parts.append(f"Tokens match within a {t.accept_gap:g}-nat log-prob gap; a gap over "
                         f"{t.reject_gap:g} nats is a mismatch.")
            if "sampling" in keys:
                parts.append(f"Sampled tokens are a mismatch when the evidence that they are "
                             f"no sample of the job's distribution reaches "
                             f"{1 / t.sampling.reject:.0e} (an honest run's chance: at most "
                             f"{t.sampling.reject:g}), a tie-break from "
                             f"{1 / t.sampling.doubt:.0e}.")
        except Exception:  # noqa: BLE001
            pass
    if "latent" in keys:
        parts.append("Runs of one reproducibility class (hardware, dtype, build) must have "
                     "equal final-latent hashes.")
    return " ".join(parts)


def image_calibration(path=None) -> dict[str, Any] | None:
    """What the image bounds were calibrated on (``thresholds.json``, written by
    ``bench/calibrate.py``), for the console: the bounds, the trace margin, and per group
    (honest pairs pooled, then each cheat) the quantiles of each distance. None when the
    file has none."""
    import json

    from broker.verification.comparators import THRESHOLDS_PATH
    try:
        image = json.loads((path or THRESHOLDS_PATH).read_text())["image"]
    except (OSError, ValueError, KeyError):
        return None
    dist = image.get("distributions")
    if not isinstance(dist, dict):
        return None

    def q(values) -> str:  # min / median / max of the recorded quantiles
        if not values or len(values) != 5:
            return "—"
        return " / ".join(f"{values[i]:.3g}" for i in (0, 2, 4))

    summary = image.get("summary") or {}

    def judged(name: str) -> dict[str, int | None]:
        parts = ([v for v in summary.values() if v.get("group") == "honest"]
                 if name == "honest" else [summary.get(name, {})])
        return {k: (sum(int(p.get(k) or 0) for p in parts) if any(k in p for p in parts)
                    else None) for k in ("match", "tiebreak", "mismatch")}

    groups = [{"name": name, "honest": name == "honest",
               "samples": d.get("samples", 0), "trace": q(d.get("trace")),
               "ssim_distance": q(d.get("ssim_distance")), "psnr_db": q(d.get("psnr_db")),
               "judged": judged(name)}
              for name, d in dist.items()]
    return {"thresholds": image.get("thresholds", {}),
            "trace": (image.get("basis") or {}).get("trace", {}),
            "calibrated_on": image.get("calibrated_on", {}), "groups": groups}


def ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None
