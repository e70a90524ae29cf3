"""The real SmolLM2-135M-Instruct (slow suite; issue 25): a tied Llama whose final gain is not
uniform, from a GGUF conversion (``"architectures": null``). R1 + R2 Hadamard are written
(untied, as QuaRot and SpinQuant do) and certified, with Hugging Face's float64 logits kept; a
permuted and value-rotated rewrite of it is aligned back onto it to rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def _logits(d: Path) -> torch.Tensor:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
    ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return m(input_ids=ids).logits


def test_r1_r2_hadamard_untied_certified(smollm2, tmp_path):
    from attnid.checkpoint.rewrite import Recipe, rewrite

    assert json.loads((smollm2 / "config.json").read_text())["architectures"] is None
    out = tmp_path / "r1r2"
    r = rewrite(smollm2, out, Recipe(fold_norms=True, rotate_residual="hadamard", rotate_values="hadamard",
                                     untie=True))
    assert r["certified"] and r["untied"] == "lm_head.weight", r
    assert r["max_residual"] <= r["tolerance"], r
    la, lb = _logits(smollm2), _logits(out)
    err = float((la - lb).abs().max() / la.abs().max())
    print(f"SmolLM2 R1+R2: certified residual {r['max_residual']:.2e}, float64 logits {err:.2e}")
    assert err < 1e-5, f"float64 logits moved by {err:.2e} (relative to the largest logit)"


def test_align_returns_a_permuted_rotated_rewrite(smollm2, tmp_path):
    from safetensors.torch import load_file

    from attnid.checkpoint.align import align_checkpoints
    from attnid.checkpoint.rewrite import Recipe, rewrite

    b = tmp_path / "b"
    rewrite(smollm2, b, Recipe(rotate_values="random", qk_planes=True, permute_mlp=True, permute_heads=True,
                               seed=3))
    out = tmp_path / "aligned"
    r = align_checkpoints(smollm2, b, out)
    assert r["certified"], r
    ta, tb, to = (load_file(d / "model.safetensors") for d in (smollm2, b, out))
    moved = max(float((tb[n].double() - ta[n].double()).norm() / ta[n].double().norm()) for n in ta)
    worst = max(float((to[n].double() - ta[n].double()).norm() / ta[n].double().norm()) for n in ta)
    print(f"SmolLM2 align: B differs by {moved:.2e}, aligned by {worst:.2e}")
    assert moved > 0.1, f"the rewrite barely moved the weights ({moved:.2e})"
    assert worst < 1e-5, f"aligned B is {worst:.2e} from A (relative, worst tensor)"
