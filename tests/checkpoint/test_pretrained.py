"""The pretrained-model section: structure, claims, and the checkpoint left untouched."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_quick_section(minilm, digest, tmp_path):
    pytest.importorskip("matplotlib")
    from attnid.report.pretrained import run_section

    before = digest(minilm)
    sec = run_section(3, 8, 32, tmp_path)
    assert digest(minilm) == before
    tables = {t.stem: t.rows for t in sec.tables}
    rows = tables["pretrained_finetune"]
    assert [r["optimizer"].split()[0] for r in rows] == ["AdamW", "SGD", "AdamW"]
    for r in rows:
        assert 0.0 <= r["gauge_share"] <= 1.0 and 0.0 <= r["retrieval_accuracy"] <= 1.0, r
    assert len(tables["pretrained_audit"]) == 6
    # the CSV columns: the normalised value is the imbalance, never beta
    assert list(tables["pretrained_audit"][0]) == [
        "layer", "imbalance_qk_median", "imbalance_qk_max", "imbalance_vo_median", "imbalance_vo_max",
        "removable_share"]
    assert list(rows[0]) == ["optimizer", "steps", "final_loss", "rho_qk_median", "rho_vo_median",
                             "drift_qk_median", "drift_vo_median", "weight_change", "aligned_change",
                             "gauge_share", "retrieval_accuracy", "seconds"]
    assert "imbalance_qk median" in sec.text and "beta_qk" not in sec.text
    assert {f.path.name for f in sec.figures} == {"pretrained_finetune.png", "pretrained_audit.png"}
    assert all(f.path.stat().st_size > 10_000 and f.caption for f in sec.figures)
    claims = {c.claim: c for c in sec.claims}
    assert all(isinstance(c.holds, bool) and c.evidence for c in claims.values())
    # the measurements that do not depend on the budget: SGD and projection leave rho at ~0
    proj = next(c for c in claims.values() if c.claim.startswith("Projection removes"))
    assert proj.holds, proj
    sgd = next(c for c in claims.values() if c.claim.startswith("On the pretrained model SGD"))
    assert sgd.holds, sgd
