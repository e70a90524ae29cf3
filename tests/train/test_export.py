"""The GPT-2- and Llama-style variants of the small GPT, and their Hugging Face export:
transformers' own class computes the model's logits, the tokenizer gives attnid's ids, the
checkpoint tools read it, and what HF cannot represent is refused before any work."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from attnid.arbiter.precision import Float64Mode
from attnid.cli import main
from attnid.errors import AttnidError
from attnid.testing import relative_error
from attnid.train.data import corpus, shakespeare
from attnid.train.export import export_hf, hf_style
from attnid.train.loop import ARCHS, TrainConfig, train
from attnid.train.model import GPT, GPTConfig

CHARS = shakespeare().chars
SMALL = dict(vocab_size=len(CHARS), n_layers=2, n_heads=4, d_model=32, block_size=16)
CASES = {
    "llama-gqa-untied": GPTConfig(**SMALL, **ARCHS["llama"], n_kv_heads=2),
    "llama-mha-tied-biased": GPTConfig(**{**SMALL, **ARCHS["llama"], "tie_weights": True,
                                          "attn_bias": "qkvo", "mlp_bias": True, "d_ff": 40}),
    "llama-mqa-theta": GPTConfig(**SMALL, **{**ARCHS["llama"], "rope_base": 500.0}, n_kv_heads=1),
    "llama-learned-positions": GPTConfig(**SMALL, **{**ARCHS["llama"], "rope": 0.0}, n_kv_heads=2),
    "llama-no-positions-tied": GPTConfig(**SMALL, **{**ARCHS["llama"], "rope": 0.0, "tie_weights": True},
                                         positions="none"),
    "gpt2-tied": GPTConfig(**SMALL, **ARCHS["gpt2"]),
    "gpt2-untied": GPTConfig(**SMALL, **{**ARCHS["gpt2"], "tie_weights": False, "d_ff": 48}),
}


def _trained_looking(cfg: GPTConfig, seed: int = 0) -> GPT:
    """A model whose norm gains, biases and positions are not at their init (else a wrong
    mapping of them would go unseen)."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def _hf(path, **config_changes):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    for k, v in config_changes.items():
        setattr(config, k, v)
    with Float64Mode():  # HF's rotary table and RMSNorm computed in float64, as attnid's
        return transformers.AutoModelForCausalLM.from_pretrained(path, config=config,
                                                                 dtype=torch.float64).eval()


def _logits(model, ids, hf: bool) -> torch.Tensor:
    with torch.no_grad(), Float64Mode():
        return model(input_ids=ids).logits if hf else model(ids)[0]


@pytest.mark.parametrize("case", list(CASES))
def test_hugging_face_class_computes_the_model(case, tmp_path):
    cfg = CASES[case]
    model = _trained_looking(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    done = export_hf(model, tmp_path / "hf", CHARS)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "export mutated the model"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [done.architecture] and config["tie_word_embeddings"] == cfg.tie_weights
    hf = _hf(tmp_path / "hf")
    assert type(hf).__name__ == done.architecture == (
        "GPT2LMHeadModel" if case.startswith("gpt2") else
        "PositionsLlamaForCausalLM" if "positions" in case else "LlamaForCausalLM")
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=torch.Generator().manual_seed(1))
    want = _logits(model.double(), ids, hf=False)
    err = relative_error(_logits(hf, ids, hf=True), want)
    assert err < 1e-10, f"{case}: HF's logits differ from attnid's by {err:.2e} (relative, float64)"
    n_ours = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in hf.parameters()) == n_ours, "HF holds other parameters"
    if case.startswith("llama") and cfg.rope:  # the RoPE base is part of what is checked
        wrong = relative_error(_logits(_hf(tmp_path / "hf", rope_parameters={
            "rope_type": "default", "rope_theta": 2 * cfg.rope_base}), ids, hf=True), want)
        assert wrong > 1e-3, f"{case}: another rope_theta agrees too ({wrong:.2e})"


@pytest.mark.parametrize("positions", ["learned", "none"])
def test_llama_without_rope_positions_are_what_they_say(positions, tmp_path):
    """Learned: the exported table is read (changing it changes the logits); none: no table,
    and in one layer a token's output depends on the earlier tokens as a set (causal NoPE still
    sees how many there are; from the second layer on, their order through each other)."""
    cfg = GPTConfig(**{**SMALL, "n_layers": 1}, **{**ARCHS["llama"], "rope": 0.0}, positions=positions)
    model = _trained_looking(cfg)
    export_hf(model, tmp_path / "hf", CHARS)
    hf = _hf(tmp_path / "hf")
    table = hf.model.embed_positions
    assert (table is None) == (positions == "none")
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    swapped = ids[:, [1, 0, *range(2, 8)]]  # the first two tokens in the other order
    last = relative_error(_logits(hf, swapped, hf=True)[:, -1], _logits(hf, ids, hf=True)[:, -1])
    if positions == "none":
        assert last < 1e-12, f"NoPE: the last token sees the order of the first two ({last:.2e})"
        return
    assert last > 1e-3, f"learned positions: the order of the first two is not seen ({last:.2e})"
    want = _logits(hf, ids, hf=True)
    with torch.no_grad():
        table.weight[3] += 1.0
    moved = relative_error(_logits(hf, ids, hf=True), want)
    assert moved > 1e-3, f"changing a position row changes nothing ({moved:.2e})"


def test_tokenizer_encodes_the_whole_corpus_to_attnids_ids(tmp_path):
    import transformers

    export_hf(_trained_looking(CASES["gpt2-tied"]), tmp_path / "hf", CHARS)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = corpus()
    data = shakespeare()
    ids = tok(text)["input_ids"]
    assert ids == torch.cat([data.train, data.val]).tolist()
    assert tok.decode(ids) == text and "\n" in text and tok.decode(tok(" a\n\nb ")["input_ids"]) == " a\n\nb "
    assert tok.model_max_length == CASES["gpt2-tied"].block_size


@pytest.mark.parametrize("case", ["llama-gqa-untied", "gpt2-untied"])
def test_checkpoint_tools_read_the_export(case, tmp_path, capsys):
    from attnid.checkpoint.load import open_checkpoint
    from attnid.weights import AttentionWeights

    cfg = CASES[case]
    model = _trained_looking(cfg)
    export_hf(model, tmp_path / "hf", CHARS)
    ck = open_checkpoint(tmp_path / "hf")
    spec = cfg.attention_spec()  # (the adapter reads the unused QK-norm eps from rms_norm_eps)
    assert [replace(s, qk_norm_eps=spec.qk_norm_eps) for s in ck.specs] == [spec] * cfg.n_layers
    for i, block in enumerate(model.blocks):
        ours = AttentionWeights.from_module(block.attn).to(torch.float64)
        assert (ck.layer(i) - ours).flat().abs().max() == 0, f"{case}: layer {i} read back differently"
    assert main(["diff", str(tmp_path / "hf"), str(tmp_path / "hf")]) == 0
    assert "CERTIFIED" in capsys.readouterr().out


@pytest.mark.parametrize(("changes", "words"), [
    (dict(**ARCHS["gpt2"], qk_norm="head"), "QK-norm"),
    (dict(**ARCHS["llama"], qk_norm="head"), "QK-norm"),
    (dict(**{**ARCHS["llama"], "rope": 0.5}), "rope=0.5"),
    (dict(**{**ARCHS["llama"], "attn_bias": "qk"}), "attention biases 'qk' as Llama"),
    (dict(**ARCHS["gpt2"], n_kv_heads=2), "GQA"),
    (dict(**{**ARCHS["gpt2"], "positions": "none"}), "without positions"),
    (dict(**{**ARCHS["gpt2"], "rope": 1.0}), "RoPE"),
    (dict(**{**ARCHS["gpt2"], "mlp_bias": False}), "without MLP biases"),
    (dict(ARCHS["nanogpt"]), "biases 'qk' as GPT-2"),
    (dict(norm="rmsnorm"), "norm=rmsnorm with mlp=gelu"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_hugging_face_cannot_hold_is_refused(changes, words, tmp_path):
    cfg = GPTConfig(**{**SMALL, **changes})
    with pytest.raises(AttnidError, match=words):
        hf_style(cfg)
    with pytest.raises(AttnidError, match=words):
        export_hf(GPT(cfg), tmp_path / "hf", CHARS)
    assert not (tmp_path / "hf").exists()


def test_export_is_all_or_nothing(tmp_path, monkeypatch):
    from attnid.train import export as export_mod

    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    model = _trained_looking(CASES["llama-gqa-untied"])
    with pytest.raises(AttnidError, match="not empty"):
        export_hf(model, out, CHARS)

    def broken(*a, **k):
        raise AttnidError("verification failed")

    monkeypatch.setattr(export_mod, "_verify", broken)
    with pytest.raises(AttnidError, match="verification failed"):
        export_hf(model, out, CHARS, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary left behind
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # the old directory untouched
    with pytest.raises(AttnidError, match="characters for a vocabulary"):
        export_hf(model, tmp_path / "other", CHARS[:-1])


def test_mlp_width_and_config_checks():
    assert GPTConfig(d_model=64).hidden == 256 and GPTConfig(d_model=64, mlp="swiglu").hidden == 192
    assert GPTConfig(d_model=64, mlp="swiglu", d_ff=100).hidden == 100
    for bad in (dict(norm="batchnorm"), dict(mlp="relu"), dict(d_ff=0), dict(norm_eps=0.0)):
        with pytest.raises(AttnidError):
            GPTConfig(**bad)
    model = GPT(GPTConfig(**SMALL, **ARCHS["llama"]))
    assert model.wpe is None and model.lm_head.weight is not model.wte.weight
    assert isinstance(model.ln_f, torch.nn.RMSNorm)
    assert {"gate", "up", "down"} <= set(dict(model.blocks[0].mlp.named_children()))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_new_variants_train_with_the_monitor(arch, tmp_path):
    model = GPTConfig(**{**SMALL, **ARCHS[arch], "n_layers": 1},
                      n_kv_heads=2 if arch == "llama" else None)
    cfg = TrainConfig(model=model, lr=1e-2, steps=40, batch_size=8, log_every=10, eval_every=20)
    summary = train(cfg, tmp_path / arch, progress=False, checkpoint=False, hf=True)
    records = [json.loads(ln) for ln in (tmp_path / arch / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]
    kv_groups = model.attention_spec().n_kv_heads  # the Monitor's metrics: one per key/value group
    assert len(records[-1]["rho_qk"][0]) == kv_groups and len(records[-1]["beta_vo"][0]) == kv_groups
    assert "val_loss" in records[-1] and all(r["rho_qk"][0][0] >= 0 for r in records)
    assert summary.hf is not None and summary.hf.error < 1e-10
    saved = json.loads((tmp_path / arch / "summary.json").read_text())
    assert saved["hf_architecture"] == summary.hf.architecture
    assert (tmp_path / arch / "hf" / "model.safetensors").exists()
    assert TrainConfig.from_dict(json.loads((tmp_path / arch / "config.json").read_text())).model == replace(
        model, vocab_size=len(CHARS))


def test_train_cli_arch_flags_and_refusal_before_work(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", str(out), "--arch", "llama", "--layers", "1", "--d-model", "32",
                 "--kv-heads", "2", "--d-ff", "48", "--seq-len", "16", "--steps", "4", "--hf",
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    model = TrainConfig.from_dict(json.loads((out / "config.json").read_text())).model
    got = (model.norm, model.mlp, model.rope, model.tie_weights, model.d_ff)
    assert got == ("rmsnorm", "swiglu", 1.0, False, 48)
    assert "LlamaForCausalLM" in capsys.readouterr().out
    hf_config = json.loads((out / "hf" / "config.json").read_text())
    assert hf_config["num_key_value_heads"] == 2 and hf_config["intermediate_size"] == 48
    code = main(["train", str(tmp_path / "no"), "--steps", "4", "--hf", "--no-progress"])
    assert code == 2 and capsys.readouterr().err.startswith("error: cannot export attention biases 'qk'")
    assert not (tmp_path / "no").exists()
