"""The never-dearer rule of the weights' defaults is one function, ``broker.jobs.service.
dearer``, which both a job's inputs and what ``GET /v1/plugins`` shows go through."""
from __future__ import annotations

from pathlib import Path

from broker.jobs.service import dearer
from sdk.protocol.manifest import load_manifest

SD15 = load_manifest(Path(__file__).resolve().parents[3] / "plugins" / "sd15")


def test_smaller_weights_defaults_are_not_dearer_and_larger_ones_are():
    asked = SD15.validate_inputs({"prompt": "a lighthouse"})
    assert dearer(SD15, asked, {**asked, "width": 64, "height": 64}) is False
    assert dearer(SD15, asked, {**asked, "width": 1024, "height": 1024}) is True


def test_a_formula_that_cannot_be_worked_out_judges_nothing():
    # the manifest's defaults alone lack an input its formula names: neither cheaper
    # nor dearer, so the caller keeps to the manifest (a job) or shows the report (a list)
    assert dearer(SD15, {"width": 512}, {"width": 64}) is None
