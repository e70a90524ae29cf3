"""`attnid rewrite`: the function-preserving rewrites quantization and merging tools apply, on a
real checkpoint, verified before anything is written.

Steps (any subset; docs/theory.md §13): fold the norm gains into their readers; rotate the
residual stream (QuaRot's and SpinQuant's R1: a Hadamard matrix or a random rotation; under
LayerNorm one that fixes all-ones); rotate each key/value group's values (R2, value biases
included); transform each kv group's queries and keys inside the RoPE commutant (FPTQuant-style
per-plane scaled rotations, any invertible map on pass-through dims); scale MLP neurons (ReLU:
positive; gated: the up half); permute MLP neurons, and heads within and across key/value
groups. The random parts are drawn from ``seed`` into one
`attnid.whole.transforms.element.GroupElement`, applied with
`attnid.whole.transforms.apply_element` one unit (a layer) at a time (float64; float32 for
bfloat16 and float16 checkpoints, whose rounding is a thousand times coarser) and stored in the
checkpoint's dtype, shard by shard (`attnid.io.write_streaming`).

What is no symmetry of the architecture is refused before any work, in one line: a residual
rotation of a post-LN model (BERT), of a bare model, or of a tied model whose final gain is not
uniform unless ``untie`` (QuaRot's and SpinQuant's way: the head becomes a tensor of its own,
``lm_head.weight``, which takes the final gain while the token table rotates; the config says
``tie_word_embeddings: false``; docs/theory.md §13.21); Q/K transforms under QK-norm; MLP
scaling of GELU/SiLU MLPs. The output goes to a temporary sibling of OUT_DIR and is verified by
`attnid diff` against the input (the whole-model invariants, every layer, at the dtype's
rounding: certified) and, for checkpoints up to 2 GiB, end to end with transformers; only then
is it moved into place. The input is never modified.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from attnid.checkpoint.load import open_checkpoint
from attnid.checkpoint.output import check_out_dir, write_certified
from attnid.checkpoint.units import Units, open_units
from attnid.errors import AttnidError
from attnid.progress import Progress
from attnid.whole.transforms.element import GroupElement
from attnid.whole.transforms.state import ModelTensors

Rotation = Literal["hadamard", "random"]


@dataclass(frozen=True)
class Recipe:
    """Which rewrites to apply (each random part drawn from ``seed``)."""

    fold_norms: bool = False
    rotate_residual: Rotation | None = None
    rotate_values: Rotation | None = None
    qk_planes: bool = False
    scale_mlp: bool = False
    permute_mlp: bool = False
    permute_heads: bool = False
    untie: bool = False  # a tied head written as a tensor of its own
    seed: int = 0

    def any(self) -> bool:
        return any(v for k, v in asdict(self).items() if k != "seed")


def draw(units: Units, recipe: Recipe):
    """The group element of ``recipe`` for this checkpoint (refusing what is no symmetry)."""
    from attnid.whole.transforms.element import GroupElement, LayerElement
    from attnid.whole.transforms.orthogonal import (
        fixing_ones,
        hadamard,
        random_commutant,
        random_head_permutation,
        random_orthogonal,
        random_rotation_fixing_ones,
    )
    from attnid.whole.transforms.residual import rotation_refusal

    lay, ck = units.layout, units.ck
    gen = torch.Generator().manual_seed(recipe.seed)
    specs = ck.specs
    Q = None
    if recipe.rotate_residual:
        final = None
        if lay.final is not None and f"{lay.final.path}.weight" in units.to_ck:
            final = ck.tensor(units.to_ck[f"{lay.final.path}.weight"]).double() + lay.final.offset
        why = rotation_refusal(lay, final)
        if why and lay.tied:
            why += ("; give --untie to write a separate lm_head.weight that takes it (QuaRot's and "
                    "SpinQuant's way)")
        if why:
            raise AttnidError(f"--rotate-residual: {why}")
        d = specs[0].d_model
        layer_norm = lay.norm == "layer"
        if recipe.rotate_residual == "hadamard":
            Q = fixing_ones(hadamard(d)) if layer_norm else hadamard(d)
        else:
            Q = random_rotation_fixing_ones(d, gen) if layer_norm else random_orthogonal(d, gen)
    if recipe.qk_planes and any(s.qk_norm != "none" for s in specs):
        raise AttnidError("--qk-planes: under QK-norm the queries and keys are normalised per head, "
                          "so only the norm gains trade (no Q/K transform is a symmetry)")
    if recipe.scale_mlp and lay.mlp == "other":
        raise AttnidError("--scale-mlp: only ReLU and gated MLPs scale per neuron (GELU and SiLU are "
                          "not homogeneous)")
    layers = []
    for i, s in enumerate(specs):
        f = ck.info(units.to_ck[f"{lay.mlps[i][1].path}.weight"]).shape[-1]  # down: [d, f]
        if lay.mlps[i][1].conv1d:
            f = ck.info(units.to_ck[f"{lay.mlps[i][1].path}.weight"]).shape[0]
        layers.append(LayerElement(
            heads=random_head_permutation(s, gen) if recipe.permute_heads else None,
            qk=random_commutant(s, gen) if recipe.qk_planes else None,
            vo=_values(recipe.rotate_values, s, gen),
            neurons=torch.randperm(f, generator=gen) if recipe.permute_mlp else None,
            mlp=torch.exp(0.5 * torch.randn(f, generator=gen, dtype=torch.float64))
            if recipe.scale_mlp else None))
    return GroupElement(rotation=Q, layers=tuple(layers))


def _values(kind: Rotation | None, s, gen: torch.Generator) -> torch.Tensor | None:
    """R2: one orthogonal ``[dv, dv]`` per key/value group (Hadamard: the same for all)."""
    from attnid.whole.transforms.orthogonal import hadamard, random_orthogonal

    if kind is None:
        return None
    if kind == "hadamard":
        return hadamard(s.v_head_dim).expand(s.n_kv_heads, -1, -1).clone()
    return torch.stack([random_orthogonal(s.v_head_dim, gen) for _ in range(s.n_kv_heads)])


def rewrite(in_dir: str | Path, out_dir: str | Path, recipe: Recipe, *, force: bool = False,
            end_to_end_max_bytes: int = 2 * 1024**3, progress: Progress | None = None) -> dict[str, Any]:
    """Rewrite a checkpoint directory by ``recipe``; returns its JSON. See the module."""
    start = time.perf_counter()
    if not recipe.any():
        raise AttnidError("nothing to do: give at least one of --fold-norms, --rotate-residual, "
                          "--rotate-values, --qk-planes, --scale-mlp, --permute-mlp, --permute-heads, "
                          "--untie")
    src, dst = check_out_dir(in_dir, out_dir, force)
    ck = open_checkpoint(src, purpose="rewrite")
    units = open_units(ck, untie=recipe.untie)
    element = draw(units, recipe)
    shown = progress if progress is not None else Progress(enabled=False)
    check, e2e = write_certified(ck, units, changes(recipe, element), dst, shown, end_to_end_max_bytes)
    worst = max([row["residual"] for row in check["layers"]] + [check["other"]["residual"]])
    return {"architecture": ck.adapter.family, "layers": ck.n_layers,
            "operations": {k: v for k, v in asdict(recipe).items() if k != "seed"}, "seed": recipe.seed,
            "untied": units.untied, "certified": True, "max_residual": worst, "tolerance": check["tolerance"],
            "end_to_end_rel_diff": e2e, "seconds": time.perf_counter() - start, "out_dir": str(dst)}


def changes(recipe: Recipe, element: GroupElement) -> Callable[[ModelTensors], ModelTensors]:
    """The change `write_certified` makes to each unit: the norms folded when ``recipe`` says so,
    then ``element`` applied."""
    from attnid.whole.transforms.element import apply_element
    from attnid.whole.transforms.norms import fold_norm_gains

    return lambda m: apply_element(fold_norm_gains(m) if recipe.fold_norms else m, element)
