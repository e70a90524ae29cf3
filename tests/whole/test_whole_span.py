"""The listed whole-model symmetries are complete on a tiny untied Llama: the span of their
generators equals the whole-model arbiter's null space (Hugging Face's own class, float64)."""

import pytest
import torch

pytest.importorskip("transformers")

from attnid.whole import transforms as T
from attnid.whole.check import arbiter_whole, tiny_model

CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8,
              num_attention_heads=2, num_key_value_heads=2, intermediate_size=6,
              num_hidden_layers=1, vocab_size=12, max_position_embeddings=16, rms_norm_eps=1e-2,
              tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
D, H, DK, F = 8, 2, 4, 6


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])


def tangent(model, transform, t=1e-5) -> torch.Tensor:
    """Central difference of ``transform(model, t)`` at t = 0 (error ~ t^2)."""
    return (flat(transform(model, t)) - flat(transform(model, -t))) / (2 * t)


def delta(model, changes: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([changes.get(n, torch.zeros_like(p)).reshape(-1)
                      for n, p in model.named_parameters()])


def generators(model) -> list[torch.Tensor]:
    out = []
    e = torch.eye(D, dtype=torch.float64)
    for norm in ("model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                 "model.norm"):
        out += [tangent(model, lambda m, t, i=i, n=norm: T.norm_gain_transfer(
            m, n, torch.exp(t * e[i]))) for i in range(D)]
    for i in range(D):
        for j in range(i + 1, D):
            A = torch.zeros(D, D, dtype=torch.float64)
            A[i, j], A[j, i] = 1.0, -1.0
            out.append(tangent(model, lambda m, t, A=A: T.residual_rotation(
                m, torch.linalg.matrix_exp(t * A))))
    out += [tangent(model, lambda m, t, j=j: T.mlp_scaling(
        m, 0, torch.exp(t * torch.eye(F, dtype=torch.float64)[j]))) for j in range(F)]
    out += [tangent(model, lambda m, t, k=k: T.logit_shift(m, t * e[k])) for k in range(D)]
    a = model.model.layers[0].self_attn
    Wq, Wk, Wv, Wo = (x.weight.detach() for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
    pre = "model.layers.0.self_attn."
    for h in range(H):
        rows = slice(h * DK, (h + 1) * DK)
        for i in range(DK // 2):  # rotate_half pairs dim i with i + DK/2: a complex scalar each
            p, q = h * DK + i, h * DK + i + DK // 2
            dq, dk = torch.zeros_like(Wq), torch.zeros_like(Wk)
            dq[[p, q]], dk[[p, q]] = Wq[[p, q]], -Wk[[p, q]]
            out.append(delta(model, {pre + "q_proj.weight": dq, pre + "k_proj.weight": dk}))
            dq, dk = torch.zeros_like(Wq), torch.zeros_like(Wk)
            dq[p], dq[q], dk[p], dk[q] = -Wq[q], Wq[p], -Wk[q], Wk[p]
            out.append(delta(model, {pre + "q_proj.weight": dq, pre + "k_proj.weight": dk}))
        for r in range(DK):  # GL(d_v) between values and output
            for c in range(DK):
                E = torch.zeros(DK, DK, dtype=torch.float64)
                E[r, c] = 1.0
                dv, do = torch.zeros_like(Wv), torch.zeros_like(Wo)
                dv[rows] = E @ Wv[rows]
                do[:, rows] = -Wo[:, rows] @ E
                out.append(delta(model, {pre + "v_proj.weight": dv, pre + "o_proj.weight": do}))
    return out


def test_generators_span_the_arbiter_null_space():
    model = tiny_model(CONFIG, seed=0)
    found = arbiter_whole(CONFIG, seed=0, near=False, return_null_space=True)
    N = found.result.null_space  # [P, nullity], orthonormal
    G = torch.stack(generators(model), dim=1)  # [P, n_generators]
    G = G / G.norm(dim=0, keepdim=True)
    rank_g = int(torch.linalg.matrix_rank(G, rtol=1e-8))
    outside = G - N @ (N.T @ G)  # each generator's part outside the null space
    worst = float(outside.norm(dim=0).max())
    assert worst < 1e-6, f"a generator leaves the null space by {worst:.2e}"
    assert rank_g == N.shape[1] == 106, f"generators span {rank_g}, arbiter null space {N.shape[1]}"
