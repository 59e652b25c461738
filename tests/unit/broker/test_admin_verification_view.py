"""The console's view of verification figures (broker/admin/verification_view.py): the
stored comparison shapes become readable table rows."""
from __future__ import annotations

from broker.admin.verification_view import comparison_rows, pair_label, thresholds_caption


def _keys(table):
    return [c[0] for c in table["columns"]]


def test_image_figures_from_a_2_of_3_become_one_row_per_pair_in_order():
    mismatch = {"verdict": "mismatch", "method": "structural", "reasons": ["ssim 0.43 < 0.998"],
                "ssim": 0.4302, "psnr_db": 9.2, "phash_bits": 33}
    same = {"verdict": "match", "method": "structural", "reasons": [], "ssim": 1.0,
            "psnr_db": 99.0, "phash_bits": 0}
    table = comparison_rows({
        "checker~tiebreaker": {"verdict": "match", "method": "image", "reasons": [],
                               "outputs": [same]},
        "primary~checker": {"verdict": "mismatch", "method": "image",
                            "reasons": mismatch["reasons"], "outputs": [mismatch]},
        "primary~tiebreaker": {"verdict": "mismatch", "method": "image",
                               "reasons": mismatch["reasons"], "outputs": [mismatch]}})
    assert [r["pair"] for r in table["rows"]] == [
        "primary ↔ checker", "primary ↔ tiebreaker", "checker ↔ tiebreaker"]
    assert _keys(table) == ["ssim", "psnr_db", "phash_bits"]
    first, last = table["rows"][0], table["rows"][2]
    assert first["cells"] == {"ssim": "0.4302", "psnr_db": "9.2 dB", "phash_bits": "33 / 64"}
    assert first["verdict"] == "mismatch" and first["reasons"] == ["ssim 0.43 < 0.998"]
    assert last["cells"]["psnr_db"] == "identical" and last["verdict"] == "match"
    assert "SSIM ≥" in thresholds_caption(table)


def test_latent_hash_text_and_exact_figures():
    table = comparison_rows({
        "primary~checker": {"verdict": "mismatch", "method": "image", "reasons": [],
                            "outputs": [{"verdict": "mismatch", "method": "latent_hash",
                                         "reasons": ["final-latent hashes differ within one "
                                                     "reproducibility class"]}]}})
    assert table["rows"][0]["cells"] == {"latent": "differ"}
    text = comparison_rows({"primary~checker": {
        "verdict": "match", "method": "text_rescore", "reasons": [],
        "outputs": [{"verdict": "match", "reasons": [], "tokens": 12, "checked_tokens": 12,
                     "max_gap": 0.0123, "mean_gap": 0.004, "grey_tokens": 0,
                     "bad_positions": [], "continue_log": 0.0}]}})
    cells = text["rows"][0]["cells"]
    assert cells == {"tokens": "12 / 12", "max_gap": "0.012", "mean_gap": "0.004",
                     "grey_tokens": "0", "bad_positions": "none"}
    assert "nats" in thresholds_caption(text)
    exact = comparison_rows({"primary~checker": {
        "verdict": "mismatch", "method": "exact", "reasons": ["outputs differ byte for byte"],
        "outputs": [{"index": 0, "equal": False}]}})
    row = exact["rows"][0]
    assert row["cells"] == {"exact": "no"} and row["method"] == "exact bytes"
    assert row["reasons"] == ["outputs differ byte for byte"]


def test_text_figures_show_the_ending_and_the_sampling_test():
    table = comparison_rows({"primary~checker": {
        "verdict": "mismatch", "method": "text_rescore", "reasons": [],
        "outputs": [{"verdict": "mismatch", "reasons": ["the tokens do not look sampled"],
                     "tokens": 32, "checked_tokens": 32, "max_gap": 0.0, "mean_gap": 0.0,
                     "grey_tokens": 0, "bad_positions": [], "end": "length",
                     "sampling": {"verdict": "reject", "tested": 32, "log_e": 150.25,
                                  "log_e_greedy": 150.3, "power": "enough",
                                  "alternative": "greedy", "mean_u": 0.002}}]}})
    cells = table["rows"][0]["cells"]
    assert cells["end"] == "length" and cells["sampling"] == "reject (e^150.2, 32 tested)"
    assert _keys(table)[-2:] == ["end", "sampling"]
    assert "1e+09" in thresholds_caption(table)


def test_a_flat_or_empty_figure_dict_still_renders():
    flat = comparison_rows({"ssim": 0.41, "psnr_db": 12.3, "phash_distance": 22})
    assert len(flat["rows"]) == 1
    assert flat["rows"][0]["cells"] == {"ssim": "0.4100", "psnr_db": "12.3 dB",
                                        "phash_bits": "22 / 64"}
    assert comparison_rows({}) == {"rows": [], "columns": []}
    assert comparison_rows(None)["rows"] == []
    count = comparison_rows({"primary~checker": {"verdict": "mismatch", "method": "count",
                                                 "reasons": ["1 outputs claimed, the check "
                                                             "made 2"]}})
    assert count["rows"][0]["reasons"] == ["1 outputs claimed, the check made 2"]
    assert pair_label("primary~checker") == "primary ↔ checker"


def test_trace_figures_and_the_calibration_the_console_shows(tmp_path):
    """Issue #20: the latent trace distance is a column, and the verification page shows
    the honest and cheating distributions the bounds were set between."""
    import json

    from broker.admin.verification_view import image_calibration

    table = comparison_rows({"primary~checker": {
        "verdict": "mismatch", "method": "image", "reasons": [], "outputs": [
            {"verdict": "mismatch", "method": "structural", "ssim": 0.9997, "psnr_db": 49.0,
             "phash_bits": 0, "trace_distance": 0.21,
             "reasons": ["latent trace distance 0.2100 > 0.0500"]}]}})
    assert table["rows"][0]["cells"]["trace"] == "0.2100"
    assert "trace" in _keys(table)
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps({"image": {
        "thresholds": {"reject_trace": 0.05},
        "basis": {"trace": {"worst_honest": 0.02, "nearest_cheat": 0.125, "margin": 2.5}},
        "summary": {"bf16": {"group": "honest", "match": 3, "tiebreak": 0, "mismatch": 0},
                    "repeat": {"group": "honest", "match": 3, "tiebreak": 0, "mismatch": 0},
                    "fewer-steps": {"group": "cheat", "match": 0, "tiebreak": 0,
                                    "mismatch": 3}},
        "distributions": {"honest": {"samples": 6, "trace": [0, 0, 0.01, 0.02, 0.02]},
                          "fewer-steps": {"samples": 3, "trace": [0.125, 0.13, 0.2, 0.3,
                                                                  0.3]}}}}))
    cal = image_calibration(path)
    honest, cheat = cal["groups"]
    assert honest["honest"] and honest["judged"] == {"match": 6, "tiebreak": 0, "mismatch": 0}
    assert cheat["name"] == "fewer-steps" and cheat["trace"] == "0.125 / 0.2 / 0.3"
    assert cal["trace"]["margin"] == 2.5
    assert image_calibration(tmp_path / "missing.json") is None
