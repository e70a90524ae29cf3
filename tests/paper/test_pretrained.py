"""The pretrained-model section: structure, claims that can fail, and the checkpoint left untouched."""

from __future__ import annotations

import pytest
import torch

from attnid.paper import pretrained as pt


@pytest.mark.slow
def test_quick_section(minilm, digest, tmp_path):
    pytest.importorskip("matplotlib")
    from attnid.paper.pretrained import run_section

    before = digest(minilm)
    sec = run_section(3, 8, 32, tmp_path)
    assert digest(minilm) == before
    tables = {t.stem: t.rows for t in sec.tables}
    rows = tables["pretrained_finetune"]
    assert [r["optimizer"].split()[0] for r in rows] == ["AdamW", "SGD", "AdamW"]
    for r in rows:
        assert 0.0 <= r["gauge_share"] <= 1.0 and 0.0 <= r["retrieval_accuracy"] <= 1.0, r
        assert r["accuracy_low"] <= r["retrieval_accuracy"] <= r["accuracy_high"], r
    assert len(tables["pretrained_audit"]) == 6 and len(tables["pretrained_seeds"]) == 3
    # the CSV columns: the normalised value is the imbalance, never beta
    assert list(tables["pretrained_audit"][0]) == [
        "layer", "imbalance_qk_median", "imbalance_qk_max", "imbalance_vo_median", "imbalance_vo_max",
        "removable_share"]
    assert list(rows[0]) == ["optimizer", "seeds", "steps", "final_loss", "rho_qk_median", "rho_vo_median",
                             "drift_qk_median", "drift_vo_median", "weight_change", "aligned_change",
                             "gauge_share", "retrieval_accuracy", "accuracy_low", "accuracy_high",
                             "embedding_cosine", "seconds"]
    assert "imbalance_qk median" in sec.text and "beta_qk" not in sec.text
    assert "not compared" in sec.text  # one seed and 3 steps: no claim on accuracy
    assert {f.path.name for f in sec.figures} == {"pretrained_finetune.png", "pretrained_audit.png"}
    assert all(f.path.stat().st_size > 10_000 and f.caption and f.alt for f in sec.figures)
    claims = {c.claim: c for c in sec.claims}
    assert all(isinstance(c.holds, bool) and c.evidence for c in claims.values())
    assert not any("retrieval" in c for c in claims)
    # the measurements that do not depend on the budget: SGD and projection leave rho at ~0
    proj = next(c for c in claims.values() if c.claim.startswith("Projection removes"))
    assert proj.holds, proj
    sgd = next(c for c in claims.values() if c.claim.startswith("On the pretrained model SGD"))
    assert sgd.holds, sgd


# ---- the accuracy claims, on injected per-line hits ----------------------------------------------
N = 400


def _hits(p: float, seed: int) -> torch.Tensor:
    return torch.rand(N, generator=torch.Generator().manual_seed(seed)) < p


def _loss(hits: torch.Tensor) -> torch.Tensor:
    """A per-line held-out loss that follows the hits (low for a hit)."""
    return 2.0 - hits.double()


def _run(name: str, seed: int, hits: torch.Tensor) -> pt.FineTune:
    zero = {"qk": [0.0], "vo": [0.0]}
    return pt.FineTune(name, seed, [1.0], [1], zero, zero, [1], [float(hits.double().mean())], [0.2], hits,
                       _loss(hits), zero, (1.0, 1.0, 0.0), 1.0)


class _Retrieval:
    def __init__(self, hits: torch.Tensor) -> None:
        self.hits, self.loss, self.mean_cosine = hits, _loss(hits), 0.2
        self.accuracy = float(hits.double().mean())


def _verdicts(base: torch.Tensor, adamw: list[torch.Tensor], proj: list[torch.Tensor]) -> list[bool]:
    runs = {"adamw": [_run("adamw", s, h) for s, h in enumerate(adamw)],
            "sgd": [_run("sgd", s, base) for s in range(len(adamw))],
            "adamw_project": [_run("adamw_project", s, h) for s, h in enumerate(proj)]}
    outcomes = {n: pt.Outcome.of(rs, 60) for n, rs in runs.items()}
    cmp = pt.Comparison.of(runs, _Retrieval(base))
    return [c.holds for c in pt.accuracy_claims(outcomes, cmp, pt.Budget(60, 16, N, seeds=len(adamw)))]


def _improved(base: torch.Tensor, seed: int, share: float) -> torch.Tensor:
    """``base`` with a random ``share`` of its misses turned into hits."""
    return base | _hits(share, seed)


def test_the_accuracy_claims_hold_when_fine_tuning_helps_and_projection_changes_nothing():
    base = _hits(0.5, 0)
    tuned = [_improved(base, 10 + s, 0.4) for s in range(3)]
    assert _verdicts(base, tuned, tuned) == [True, True]


def test_the_gain_claim_fails_when_the_fine_tune_does_not_move_the_task():
    base = _hits(0.5, 0)
    assert _verdicts(base, [base, base, base], [base, base, base])[0] is False


def test_the_projection_claim_fails_when_projection_costs_accuracy():
    base = _hits(0.5, 0)
    tuned = [_improved(base, 10 + s, 0.4) for s in range(3)]
    worse = [t & _hits(0.85, 20 + s) for s, t in enumerate(tuned)]  # about 10 points lost
    assert _verdicts(base, tuned, worse) == [True, False]


def test_the_projection_claim_fails_when_the_interval_is_too_wide_to_tell():
    base = _hits(0.5, 0)
    tuned = [_improved(base, 10 + s, 0.4) for s in range(3)]
    shuffled = [_improved(_hits(0.5, 30 + s), 40 + s, 0.4) for s in range(3)]  # same rate, other lines
    assert _verdicts(base, tuned, shuffled)[1] is False


def test_a_budget_compares_accuracies_only_with_seeds_and_steps():
    assert pt.DEFAULT.compares and not pt.QUICK.compares
    assert not pt.Budget(60, 16, 256, seeds=1).compares and not pt.Budget(5, 16, 256, seeds=3).compares
    assert pt.Budget(40, 16, 256, seeds=3, evals=4).eval_steps == [10, 20, 30, 40]
