"""The training section's claims can fail, and its captions follow the data: each claim is
checked on the smoke experiment as measured and again with data injected to violate it; each
caption quotes numbers computed from the data, and changes its words when the data does."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from attnid.paper import second_order as so
from attnid.paper import training as tr
from attnid.paper.document import Claim, quoted_numbers, table_values, untabled


def _claims(fn, data, *args) -> list[Claim]:
    out: list[Claim] = []
    fn(data, *args, lambda claim, holds, evidence: out.append(Claim("T", claim, bool(holds), evidence)))
    return out


def _with_run(data, name: str, **sides):
    """``data`` with run ``name`` changed: ``qk=dict(beta=...)`` replaces fields of a side,
    other keywords fields of the run."""
    run = data.runs[name]
    changes = {k: v for k, v in sides.items() if k not in ("qk", "vo")}
    for side in ("qk", "vo"):
        if side in sides:
            changes[side] = dataclasses.replace(run.side(side), **sides[side])
    return dataclasses.replace(data, runs={**data.runs, name: dataclasses.replace(run, **changes)})


def _with_same_point(data, prefix: str = "", **fields):
    sp = dataclasses.replace(data.same_point[prefix], **fields)
    return dataclasses.replace(data, same_point={**data.same_point, prefix: sp})


def _moved_beyond_bound(data, side: str):
    """The last logged beta of one head moved by twice its bound (plus rounding)."""
    run = data.runs["sgd"]
    s = run.side(side)
    beta = s.beta.copy()
    bound = so.bound_series(run, side)[-1, 0] + so.rounding_allowance(data, "", side)
    beta[-1, 0] = beta[0, 0] + 2 * bound + 1e-6
    return _with_run(data, "sgd", **{side: {"beta": beta}})


@pytest.mark.parametrize("side", ["qk", "vo"])
def test_the_second_order_bound_holds_and_fails_when_a_head_moves_too_far(smoke, side):
    good = _claims(so.bound_claim, smoke, "", side)
    assert good[0].holds, good
    bad = _claims(so.bound_claim, _moved_beyond_bound(smoke, side), "", side)
    assert not bad[0].holds and "ratio 2" in bad[0].evidence, bad


def test_the_tau_identity_holds_for_sgd_and_fails_for_a_wrong_sum_or_an_obedient_adamw(smoke):
    assert _claims(so.tau_claim, smoke, "")[0].holds, _claims(so.tau_claim, smoke, "")
    run = smoke.runs["sgd"]
    off = run.vo.update_tau.copy()
    off[-1] += 0.01 * np.abs(off[1:].sum(0)).max()  # one logged interval's sum off by 1% of the largest
    assert not _claims(so.tau_claim, _with_run(smoke, "sgd", vo={"update_tau": off}), "")[0].holds
    adam = smoke.runs["adamw"]
    obeys = np.zeros_like(adam.vo.update_tau)
    obeys[1:] = np.diff(adam.vo.tau, axis=0)  # as if AdamW's steps were gradient steps
    assert not _claims(so.tau_claim, _with_run(smoke, "adamw", vo={"update_tau": obeys}), "")[0].holds


def test_the_decay_balance_holds_and_fails_without_its_decay_term(smoke):
    assert _claims(so.decay_claim, smoke)[0].holds, _claims(so.decay_claim, smoke)
    run = smoke.runs["sgd_wd"]
    t = so.tau_balance(run, "vo", 0.25, 4e-4)
    shifted = run.vo.update_tau.copy()
    shifted[-1] -= t.decay  # the steps account for the whole change: no room left for the decay
    assert not _claims(so.decay_claim, _with_run(smoke, "sgd_wd", vo={"update_tau": shifted}))[0].holds


@pytest.mark.parametrize("prefix", ["", "rope_"])
def test_the_one_step_claim_fails_for_a_first_order_slope_or_a_drift_above_its_bound(smoke, prefix):
    assert _claims(so.same_point_claim, smoke, prefix)[0].holds
    sp = smoke.same_point[prefix]
    first_order = {**sp.drift, "vo": [d * 0.25 / lr for d, lr in zip(sp.drift["vo"], sp.lr, strict=True)]}
    bad = _claims(so.same_point_claim, _with_same_point(smoke, prefix, drift=first_order), prefix)
    assert not bad[0].holds, bad
    above = {**sp.drift, "vo": [2 * b for b in sp.step_sq["vo"]]}  # slope 2, but over the bound
    assert not _claims(so.same_point_claim, _with_same_point(smoke, prefix, drift=above), prefix)[0].holds


def test_the_gradient_flow_claim_fails_when_a_fixed_time_drifts_like_lr_squared(smoke):
    assert _claims(so.flow_claim, smoke)[0].holds, _claims(so.flow_claim, smoke)
    f = smoke.same_point[""].flow
    squared = dataclasses.replace(f, drift={s: [lr**2 for lr in f.lr] for s in ("qk", "vo")})
    assert not _claims(so.flow_claim, _with_same_point(smoke, flow=squared))[0].holds


def test_the_rounding_floor_claim_fails_when_the_floor_is_not_rounding(smoke):
    assert _claims(so.floor_claim, smoke)[0].holds, _claims(so.floor_claim, smoke)
    sp = smoke.same_point[""]
    real = {s: sp.floor32[s] / 2 for s in ("qk", "vo")}  # the float64 truth as large as the floor
    assert not _claims(so.floor_claim, _with_same_point(smoke, tiny64=real))[0].holds
    far = {s: 100 * sp.floor_eps[s] for s in ("qk", "vo")}  # a floor far above eps32 * Gram norms
    assert not _claims(so.floor_claim, _with_same_point(smoke, floor32=far))[0].holds


def test_the_anatomy_claims_fail_for_an_orbit_heavy_momentum_or_a_wrong_isotropic_share(smoke):
    assert all(c.holds for c in tr.anatomy_claims(smoke)), tr.anatomy_claims(smoke)
    a = smoke.anatomy
    heavy = dataclasses.replace(a, rho={**a.rho, "momentum": dict(a.rho["AdamW update"])})
    assert [c.holds for c in tr.anatomy_claims(dataclasses.replace(smoke, anatomy=heavy))] == [True, False]
    wrong = dataclasses.replace(a, rho={**a.rho, "isotropic": {"qk": 0.5, "vo": 0.5}})
    assert [c.holds for c in tr.anatomy_claims(dataclasses.replace(smoke, anatomy=wrong))] == [False, True]


# ---- captions ---------------------------------------------------------------------------------
def test_fig2_captions_quote_the_measured_medians_and_shares(smoke):
    from attnid.stats import median

    text = tr.caption_fig2_qk(smoke)
    rho = median(smoke.runs["adamw"].qk.rho[1:])
    share = tr.tangent_share(smoke.configs["adamw"].model.attention_spec(), "qk")
    assert f"median rho_qk is {rho:.3g}" in text and f"{rho / share:.2f} of the share" in text, text
    assert "sits near 1/(2H)" not in text
    assert f"rescaling alone gives rho {smoke.anatomy.rho['preconditioned gradient']['qk']:.3g}" in text


def test_fig2_vo_caption_says_flat_only_when_beta_vo_is_flat(smoke):
    run = smoke.runs["sgd"]
    flat = np.repeat(run.vo.beta[:1], len(run.step), axis=0)
    assert "stays flat" in tr.caption_fig2_vo(_with_run(smoke, "sgd", vo={"beta": flat}))
    grown = flat * np.linspace(1, 1.2, len(run.step))[:, None]
    text = tr.caption_fig2_vo(_with_run(smoke, "sgd", vo={"beta": grown}))
    assert "is not flat" in text and "(+20.0%" in text and "same pattern" not in text, text


def test_fig4_caption_names_the_series_at_the_rounding_floor(smoke):
    sweep = [n for n in smoke.runs if n.startswith("sweep_")]
    floor = smoke.same_point[""].floor_eps["qk"]
    run = smoke.runs["sweep_lr0.0625"]
    at_floor = _with_run(smoke, "sweep_lr0.0625", qk={"drift": np.full_like(run.qk.drift, floor)})
    text = tr.caption_fig4(at_floor, sweep, "qk", 2.0)
    assert re.search(r"the whole [^;]*SGD lr 0\.0625 curves? sit within 3× of it", text), text
    high = {n: dataclasses.replace(r, qk=dataclasses.replace(r.qk, drift=1e3 * floor + 0 * r.qk.drift))
            for n, r in smoke.runs.items()}
    text = tr.caption_fig4(dataclasses.replace(smoke, runs=high), sweep, "qk", 2.0)
    assert "every series stays above it" in text and f"= {floor:.2g}" in text, text


def test_variant_caption_names_a_spike_only_when_there_is_one(smoke):
    run = smoke.runs["rope_sgd"]
    n = len(run.step)
    beta = np.repeat(run.qk.beta[:1], n, axis=0)
    beta[n // 2:] *= 3  # one interval holds all of the change ...
    norm = np.full_like(run.update_norm_max, 0.1)
    norm[n // 2] = 5.0  # ... and one update 50x the others
    spiked = _with_run(smoke, "rope_sgd", qk={"beta": beta}, update_norm_max=norm)
    text = tr.caption_variant(spiked, "rope_")
    where = f"between steps {int(run.step[n // 2 - 1])} and {int(run.step[n // 2])}"
    assert where in text and "50×" in text, text
    steady = np.repeat(run.qk.beta[:1], n, axis=0) * np.linspace(1, 1.1, n)[:, None]
    calm = _with_run(smoke, "rope_sgd", qk={"beta": steady}, update_norm_max=np.full_like(norm, 0.1))
    assert "spike" not in tr.caption_variant(calm, "rope_")


def test_fig5_caption_quotes_what_its_right_panel_checks(smoke):
    text = tr.caption_fig5(smoke)
    worst = max(so.second_order_ratio(smoke.runs[p + "sgd"], "vo", so.rounding_allowance(smoke, p, "vo"))[2]
                for p in ("", "rope_", "gqa_"))
    assert f"VO {worst:.2g})" in text and "own layer" in text, text


def test_the_section_text_describes_each_run_from_its_numbers(smoke):
    run = smoke.runs["gqa_sgd"]
    n = len(run.step)
    beta = np.repeat(run.vo.beta[:1], n, axis=0)
    beta[n // 2:] *= 2
    norm = np.full_like(run.update_norm_max, 0.1)
    norm[n // 2] = 3.0
    text = so.text(_with_run(smoke, "gqa_sgd", vo={"beta": beta}, update_norm_max=norm))
    gqa_vo = next(ln for ln in text.splitlines() if ln.startswith("- GQA, SGD lr 0.25, VO"))
    assert "(+100.0%)" in gqa_vo and "a spike, one update 30× the usual size" in gqa_vo, gqa_vo
    b0 = smoke.runs["sgd"].vo.beta[0].mean()
    ratio = smoke.runs["sgd"].vo.update_sq[1:].sum(0).mean() / b0
    assert f"summed squared VO steps are {ratio:.2g}× its starting beta_vo" in text


def test_the_section_draws_and_claims_without_the_runs_beyond_the_paper(smoke, tmp_path):
    """`attnid experiment paper --paper-only` has no RoPE, GQA or projection runs."""
    beyond = ("rope_", "gqa_", "adamw_project")
    runs = {k: v for k, v in smoke.runs.items() if not k.startswith(beyond)}
    data = dataclasses.replace(smoke, runs=runs, same_point={"": smoke.same_point[""]})
    section = tr.training_section(data, tmp_path)
    assert section.claims and not any(c.claim.startswith(("[RoPE]", "[GQA]")) for c in section.claims)
    assert {f.path.name for f in section.figures} >= {"fig5_second_order.png", "fig6_vo_drift.png"}
    assert untabled(section) == []  # the tables follow the runs there are


# ---- the reference line, the signs, the rebalancing claims ---------------------------------------
@pytest.mark.parametrize("prefix", ["", "rope_", "gqa_"])
def test_fig2_draws_each_variants_own_tangent_share(smoke, prefix, tmp_path, monkeypatch):
    """The dashed line on the rho panels is the variant's tangent share (RoPE and GQA: not 1/(2H))."""
    drawn = []
    monkeypatch.setattr(tr, "_save", lambda fig, path: drawn.append(fig) or path)
    cases = [prefix + c for c in ("sgd", "sgd_wd", "adamw", "adamw_rebalance")]
    tr.fig2(smoke, cases, "qk", tmp_path / "f.png", "t")
    share = tr.tangent_share(smoke.configs[prefix + "adamw"].model.attention_spec(), "qk")
    rho_axes = [ax for ax in drawn[0].axes if ax.get_yscale() == "log" and ax.get_title().startswith("rho")]
    lines = [ln for ax in drawn[0].axes for ln in ax.get_lines()
             if ln.get_label().startswith("tangent share")]
    assert rho_axes and len(lines) == len(cases), [ln.get_label() for ln in lines]
    assert all(ln.get_ydata()[0] == pytest.approx(share, rel=1e-12) for ln in lines), (share, lines)
    if prefix:
        n_heads = smoke.configs[prefix + "adamw"].model.n_heads
        assert abs(share - 1 / (2 * n_heads)) > 0.01, share  # the variants' shares differ from 1/(2H)


@pytest.mark.parametrize("prefix", ["rope_", "gqa_"])
def test_variant_claims_quote_their_own_share_not_one_over_2h(smoke, prefix):
    spec = smoke.configs[prefix + "adamw"].model.attention_spec()
    claim = next(c for c in tr.claims(smoke, prefix, share=tr.qk_share(spec)) if "tangent share" in c.claim)
    assert "1/(2H) =" not in claim.evidence and f"tangent share {tr.qk_share(spec):.3g}" in claim.evidence


def test_the_sweep_keeps_the_sign_of_beta_vos_change(smoke, tmp_path):
    run = smoke.runs["sweep_lr0.0625"]
    falling = run.vo.beta * np.linspace(1, 0.9, len(run.step))[:, None]  # beta_vo falls 10%
    data = _with_run(smoke, "sweep_lr0.0625", vo={"beta": falling})
    lrs, per_time = so.sweep_per_time(data, "vo")
    assert per_time[lrs.index(0.0625)] < 0, per_time
    quoted = f"{per_time[lrs.index(0.0625)]:+.2g} at lr 0.0625"
    assert quoted.startswith("-") and quoted in tr.caption_fig6(data), tr.caption_fig6(data)
    assert f"{per_time[-1]:+.2g}" in so.text(data)


def test_the_rebalancing_loss_claim_fails_beyond_its_share_of_the_loss_drop(smoke):
    adam, reb = smoke.runs["adamw"], smoke.runs["adamw_rebalance"]
    assert tr.rebalance_loss_claim(adam, reb)[1]
    drop = tr.loss_gap(adam, reb)[2]
    worse = reb.loss.copy()
    worse[-1] += 2 * tr.LIMITS.loss_share * drop  # one logged step off by twice the margin
    bad = tr.rebalance_loss_claim(adam, dataclasses.replace(reb, loss=worse))
    assert not bad[1] and "margin" in bad[2], bad


def test_the_sawtooth_claim_fails_without_a_reset_or_without_regrowth(smoke):
    adam, reb = smoke.runs["adamw"], smoke.runs["adamw_rebalance"]
    correct = smoke.configs["adamw_rebalance"].correct
    assert tr.sawtooth_claim(adam, reb, correct)[1], tr.sawtooth_claim(adam, reb, correct)
    no_reset = dataclasses.replace(reb, qk=dataclasses.replace(reb.qk, beta=adam.qk.beta.copy()))
    assert not tr.sawtooth_claim(adam, no_reset, correct)[1]
    flat = reb.qk.beta.copy()
    at = (reb.step % 10 == 0)
    flat[~at & (reb.step > 10)] = 2 * flat[at].max()  # between resets: only rounding-level regrowth
    bad = tr.sawtooth_claim(adam, dataclasses.replace(reb, qk=dataclasses.replace(reb.qk, beta=flat)),
                            correct)
    assert not bad[1], bad
    assert re.search(r"regrows to [0-9.]+× its largest reset value \(margin 100×\)", bad[2]), bad


def test_fig9_alt_text_says_which_panels_are_log_log(training):
    figures = training.figures
    fig = next(f for f in figures if f.path.name == "fig5_second_order.png")
    assert "three log-log panels" not in fig.alt and "(linear)" in fig.alt, fig.alt


# ---- every number the section states is in its tables -----------------------------------------
def test_every_number_of_the_training_section_is_in_its_tables(training, checks_every_number):
    checks_every_number(training)


def test_a_wrong_digit_or_sign_in_a_training_caption_is_found(training):
    """The caption's signed numbers (beta's and tau's signed changes) with the sign flipped:
    each is reported, unless a table happens to hold the opposite value too."""
    values = table_values(training.tables)
    fig = next(f for f in training.figures if f.path.name == "fig2_vo.png")
    checked = 0
    for q in quoted_numbers(fig.caption)[:6]:
        if q.sign not in ("+", "-"):
            continue
        flipped = ("-" if q.sign == "+" else "+") + q.text[1:]
        if any(quoted_numbers(flipped)[0].matches(v) for v in values):
            continue  # a table holds the opposite value too: not a planted error
        wrong = dataclasses.replace(fig, caption=fig.caption.replace(q.text, flipped, 1))
        figures = tuple(wrong if f is fig else f for f in training.figures)
        section = dataclasses.replace(training, figures=figures)
        assert f"caption of fig2_vo.png: {flipped}" in untabled(section), (q.text, flipped)
        checked += 1
    assert checked, quoted_numbers(fig.caption)  # not vacuous


@pytest.mark.parametrize("stem", ["training_second_order", "training_same_point", "training_fits",
                                  "training_flow", "training_sweep", "training_anatomy",
                                  "training_rebalancing", "training_bias_gradients", "training_variants",
                                  "training_limits"])
def test_each_training_table_holds_numbers_that_only_it_holds(training, stem):
    """Without the table some stated number is untabled: no table is there for nothing."""
    assert stem in {t.stem for t in training.tables}
    rest = tuple(t for t in training.tables if t.stem != stem)
    assert untabled(dataclasses.replace(training, tables=rest))
