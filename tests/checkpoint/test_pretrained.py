"""The pretrained-model section: structure, claims, and the checkpoint left untouched."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_quick_section(minilm, digest):
    pytest.importorskip("matplotlib")
    from attnid.report.pretrained import pretrained_section

    before = digest(minilm)
    sec = pretrained_section(quick=True)
    assert digest(minilm) == before
    assert set(sec) == {"title", "markdown", "tables", "figures", "claims"}
    rows = sec["tables"]["pretrained_finetune"]
    assert [r["optimizer"].split()[0] for r in rows] == ["AdamW", "SGD", "AdamW"]
    for r in rows:
        assert 0.0 <= r["gauge_share"] <= 1.0 and 0.0 <= r["retrieval_accuracy"] <= 1.0, r
    assert len(sec["tables"]["pretrained_audit"]) == 6
    assert {"pretrained_finetune.png", "pretrained_audit.png"} <= set(sec["figures"])
    claims = {c["claim"]: c for c in sec["claims"]}
    assert all(isinstance(c["holds"], bool) and c["evidence"] for c in claims.values())
    # the measurements that do not depend on the budget: SGD and projection leave rho at ~0
    proj = next(c for c in claims.values() if c["claim"].startswith("Projection removes"))
    assert proj["holds"], proj
    sgd = next(c for c in claims.values() if c["claim"].startswith("On the pretrained model SGD"))
    assert sgd["holds"], sgd
