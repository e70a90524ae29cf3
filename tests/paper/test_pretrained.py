"""The pretrained-model section: structure, every stated number in its tables, claims that can
fail, and the checkpoint left untouched."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch

from attnid.errors import AttnidError
from attnid.paper import pretrained as pt
from attnid.paper.document import Context, untabled
from attnid.paper.finetune import RUNS, Budget, FineTune, Interval, difference, stacked
from attnid.progress import Progress


def _stamps(d: Path) -> dict[str, str]:
    """sha256 of every file under ``d`` (the module-scoped twin of the ``digest`` fixture)."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def quick(minilm, tmp_path_factory):
    """The quick section, run once for this module; with the checkpoint's file stamps before."""
    pytest.importorskip("matplotlib")
    before = _stamps(minilm)
    return before, pt.run_section(pt.QUICK, tmp_path_factory.mktemp("pretrained"))


@pytest.mark.slow
def test_quick_section(quick, minilm):
    before, sec = quick
    assert _stamps(minilm) == before  # the checkpoint is only read
    tables = {t.stem: t.rows for t in sec.tables}
    rows = tables["pretrained_finetune"]
    assert [r["optimizer"] for r in rows] == ["pretrained (no fine-tune)"] + [r.label for r in RUNS.values()]
    for r in rows[1:]:
        assert 0.0 <= r["gauge_share"] <= 1.0 and 0.0 <= r["retrieval_accuracy"] <= 1.0, r
    assert len(tables["pretrained_audit"]) == 6 and len(tables["pretrained_seeds"]) == len(RUNS)
    # the CSV columns: the normalised value is the imbalance, never beta
    assert list(tables["pretrained_audit"][0]) == [
        "layer", "imbalance_qk_median", "imbalance_qk_max", "imbalance_vo_median", "imbalance_vo_max",
        "removable_share"]
    comparisons = [r["comparison"] for r in tables["pretrained_comparisons"]]
    assert comparisons[-2:] == [f"{RUNS[n].label} minus {RUNS['adamw'].label}"
                                for n in ("adamw_project", "adamw_rebalance")]
    assert "imbalance_qk median" in sec.text and "beta_qk" not in sec.text
    assert "not compared" in sec.text  # one seed and 3 steps: no claim on accuracy
    assert {f.path.name for f in sec.figures} == {"pretrained_finetune.png", "pretrained_audit.png"}
    assert all(f.path.stat().st_size > 10_000 and f.caption and f.alt for f in sec.figures)
    claims = {c.claim: c for c in sec.claims}
    assert all(isinstance(c.holds, bool) and c.evidence for c in claims.values())
    assert not any("retrieval" in c for c in claims)
    # the measurements that do not depend on the budget: SGD and projection leave rho at ~0
    for start in ("Projection removes", "AdamW's updates on the pretrained model"):
        claim = next(c for c in claims.values() if c.claim.startswith(start))
        assert claim.holds, claim


@pytest.mark.slow
def test_every_number_the_section_states_is_in_its_tables(quick):
    quick = quick[1]
    assert untabled(quick) == []
    caption = quick.figures[0].caption
    adamw = next(r for t in quick.tables for r in t.rows if r.get("optimizer", "").startswith("AdamW lr"))
    rho = f"{adamw['rho_max_side']:.3g}"
    assert f"AdamW {rho}" in caption, caption
    wrong = dataclasses.replace(quick.figures[0], caption=caption.replace(f"AdamW {rho}", "AdamW 0.777"))
    planted = dataclasses.replace(quick, figures=(wrong, *quick.figures[1:]))
    assert untabled(planted) == ["caption of pretrained_finetune.png: 0.777"]


# ---- the accuracy claims, on injected per-line hits ----------------------------------------------
N = 400


def _hits(p: float, seed: int) -> torch.Tensor:
    return torch.rand(N, generator=torch.Generator().manual_seed(seed)) < p


def _loss(hits: torch.Tensor) -> torch.Tensor:
    """A per-line held-out loss that follows the hits (low for a hit)."""
    return 2.0 - hits.double()


def _run(name: str, seed: int, hits: torch.Tensor) -> FineTune:
    zero = {"qk": [0.0], "vo": [0.0]}
    return FineTune(name, seed, [1.0], [1], zero, zero, [0.0], [1], [float(hits.double().mean())], [0.2],
                    hits, _loss(hits), zero, (1.0, 1.0, 0.0), 1.0, [])


@dataclasses.dataclass
class _Retrieval:
    hits: torch.Tensor

    def __post_init__(self) -> None:
        self.loss, self.mean_cosine, self.accuracy = _loss(self.hits), 0.2, float(self.hits.double().mean())


def _results(base: torch.Tensor, adamw: list, proj: list, reb: list | None = None) -> pt.Results:
    hits = {"adamw": adamw, "adamw_project": proj, "adamw_rebalance": reb or adamw, "sgd": [base]}
    runs = {n: [_run(n, s, h) for s, h in enumerate(hs)] for n, hs in hits.items()}
    data = {n: stacked(rs) for n, rs in runs.items()}
    gain = {n: difference(RUNS[n].label, "pretrained", *data[n], base.double(), _loss(base)) for n in runs}
    versus = {n: difference(RUNS[n].label, "AdamW", *data[n], *data["adamw"])
              for n in ("adamw_project", "adamw_rebalance")}
    return pt.Results(Budget(60, 16, N, seeds=len(adamw)), None, _Retrieval(base), runs,
                      {n: pt.Outcome.of(rs) for n, rs in runs.items()}, gain, versus,
                      {"adamw_project": 0.0, "adamw_rebalance": 0.0}, None)


def _verdicts(*args) -> list[bool]:
    return [c.holds for c in pt.accuracy_claims(_results(*args))]


def _improved(base: torch.Tensor, seed: int, share: float) -> torch.Tensor:
    """``base`` with a random ``share`` of its misses turned into hits."""
    return base | _hits(share, seed)


BASE = _hits(0.5, 0)
TUNED = [_improved(BASE, 10 + s, 0.4) for s in range(3)]


def test_the_accuracy_claims_hold_when_fine_tuning_helps_and_the_corrections_change_nothing():
    assert _verdicts(BASE, TUNED, TUNED) == [True, True, True]


def test_the_gain_claim_fails_when_the_fine_tune_does_not_move_the_task():
    assert _verdicts(BASE, [BASE] * 3, [BASE] * 3)[0] is False


@pytest.mark.parametrize("which", ["projection", "rebalancing"])
def test_a_correction_claim_fails_when_the_correction_costs_accuracy(which):
    worse = [t & _hits(0.85, 20 + s) for s, t in enumerate(TUNED)]  # about 10 points lost
    args = (BASE, TUNED, worse, TUNED) if which == "projection" else (BASE, TUNED, TUNED, worse)
    want = [True, False, True] if which == "projection" else [True, True, False]
    assert _verdicts(*args) == want


def test_the_projection_claim_fails_when_the_interval_is_too_wide_to_tell():
    shuffled = [_improved(_hits(0.5, 30 + s), 40 + s, 0.4) for s in range(3)]  # same rate, other lines
    assert _verdicts(BASE, TUNED, shuffled)[1] is False


def test_the_evidence_counts_the_lines_whose_hit_differs():
    one = [t.clone() for t in TUNED]
    one[0][0] = ~one[0][0]
    claim = pt.accuracy_claims(_results(BASE, TUNED, one))[1]
    assert f"the hit differs on 1 of {3 * N} (seed, line) pairs" in claim.evidence, claim.evidence


def test_small_intervals_print_in_scientific_notation_and_keep_their_signs():
    assert str(Interval(-3.8e-05, -7.1e-05, -1.1e-05)) == "-3.80e-05 [-7.10e-05, -1.10e-05]"
    assert str(Interval(0.076, 0.049, 0.107)) == "+0.076 [+0.049, +0.107]"
    assert str(Interval(0.0, 0.0, 0.0)) == "+0.000 [+0.000, +0.000]"


def test_a_budget_compares_accuracies_only_with_seeds_and_steps():
    assert pt.DEFAULT.compares and pt.FULL.compares and not pt.QUICK.compares
    assert not Budget(60, 16, 256, seeds=1).compares and not Budget(5, 16, 256, seeds=3).compares
    assert Budget(40, 16, 256, seeds=3, evals=4).eval_steps == [10, 20, 30, 40]
    with pytest.raises(AttnidError, match="positive"):
        Budget(0, 16, 256)


@pytest.mark.parametrize(("quick", "scale", "want"), [(True, None, "QUICK"), (False, None, "DEFAULT"),
                                                      (False, "full", "FULL"), (True, "quick", "QUICK")])
def test_the_size_follows_the_context(quick, scale, want):
    ctx = Context(Path("."), quick, Progress(enabled=False))
    if scale is not None:
        ctx = dataclasses.replace(ctx, scale=scale)
    assert pt.budget_for(ctx) is getattr(pt, want)


@pytest.mark.parametrize("n_eval", [32, 512, 1024])
def test_the_fine_tune_never_trains_on_a_held_out_line(n_eval):
    from attnid.paper.finetune import split

    pairs = split(n_eval)
    assert len(pairs.held_out) == n_eval and not set(pairs.held_out) & set(pairs.train)
