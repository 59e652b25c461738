"""Verification by spot redundancy (DESIGN §6), the pure domain part.

* ``sampling``: how likely a job is to be re-run on a second provider, and the draw;
* ``comparators``: does a check run agree with the run it checks (images, text);
* ``rescoring``: the checker's teacher-forced re-scoring of claimed text (torch);
* ``outcomes``: the 2-of-3 majority and what it does to each provider.

Nothing here imports Flask, grpc or SQLAlchemy, or touches storage: the job lifecycle
applies these decisions through the ledger and the provider registry.
"""
from broker.verification.comparators import (ImageComparison, ImageResult, ImageThresholds,
                                             ReproClass, Rescore, TextClaim, TextComparison,
                                             TextThresholds, TokenScore, Verdict,
                                             compare_images, compare_text,
                                             load_image_thresholds)
from broker.verification.outcomes import (Outcome, Party, Penalty, PenaltyPolicy, Role,
                                          Status, resolve_pair, resolve_three)
from broker.verification.sampling import (CheckDecision, SamplingKey, SamplingPolicy,
                                          Standing, check_probability, decide_check,
                                          economic_floor)

__all__ = [
    "CheckDecision", "ImageComparison", "ImageResult", "ImageThresholds", "Outcome", "Party",
    "Penalty", "PenaltyPolicy", "ReproClass", "Rescore", "Role", "SamplingKey",
    "SamplingPolicy", "Standing", "Status", "TextClaim", "TextComparison", "TextThresholds",
    "TokenScore", "Verdict", "check_probability", "compare_images", "compare_text",
    "decide_check", "economic_floor", "load_image_thresholds", "resolve_pair",
    "resolve_three",
]
