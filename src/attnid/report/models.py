"""`attnid report`: identification counts for real model families, per layer and in total."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from attnid.adapters.base import Adapter
from attnid.adapters.config import bundled, load_config
from attnid.adapters.registry import adapter_for
from attnid.spec import AttentionSpec
from attnid.theory import count

if TYPE_CHECKING:
    from attnid.adapters.base import Adapter
    from attnid.progress import Progress


def model_params(config: dict[str, Any]) -> int | None:
    """The whole model's parameter count, from its config (built on the meta device: no
    memory; tied weights counted once); None when transformers refuses the config (said as
    an AttnidError by `attnid.adapters.base.hf_config`): its attention is still countable."""
    import torch

    from attnid.adapters.base import new_hf_model
    from attnid.errors import AttnidError

    try:
        with torch.device("meta"):
            model = new_hf_model(config)
    except AttnidError:
        return None
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def whole_model(config: dict[str, Any]) -> dict[str, Any]:
    """``count_model`` as a dict (closed form, or numeric on a reduced config, said in
    ``method``)."""
    from attnid.errors import AttnidError
    from attnid.whole.model import count_model

    try:
        return count_model(config).to_dict()
    except AttnidError as e:  # said in the report, not fatal for the attention counts
        return {"total": model_params(config), "identified": None, "unidentified": None,
                "near_unidentified": None, "ratio": None, "components": {},
                "method": f"not counted: {e}"}


def _layers(per_layer: list[dict[str, Any]]) -> dict[str, Any]:
    same = all(x == per_layer[0] for x in per_layer)
    return {"layers": per_layer, "layers_identical": same}


def _numeric_report(name: str, config: dict[str, Any], adapter: Adapter, with_params: bool
                    ) -> dict[str, Any]:
    """Families without a closed form: full-size parameter counts, and the arbiter's count of
    one layer at a reduced config of Hugging Face's own class."""
    import torch

    from attnid.adapters.base import build_hf_model, find_first
    from attnid.adapters.reduced import numeric_hf_count

    with torch.device("meta"):
        attn = find_first(build_hf_model({**config, "model_type": adapter.model_type,
                                          "num_hidden_layers": 1}), "Attention")
    per_layer = sum(p.numel() for p in attn.parameters())
    n = adapter.n_layers(config)
    return {
        "model": name, "architecture": (config.get("architectures") or [config.get("model_type")])[0],
        "family": adapter.family, "n_layers": n, "closed_form": False,
        "note": f"no closed form: attnid lacks {adapter.missing}; 'numeric_reduced' is the arbiter's "
                "exact count of one layer at a reduced config of the same structure",
        "attention": {"total": per_layer * n, "unidentified": None, "ratio": None,
                      "near_unidentified": None},
        "numeric_reduced": numeric_hf_count(adapter, config),
        "model_params": model_params(config) if with_params else None,
        "whole_model": whole_model(config) if with_params else None,
        **_layers([{"total": per_layer, "unidentified": None, "near_unidentified": None,
                    "method": "numeric on a reduced config only"}] * n),
    }


def model_report(model: str, *, with_params: bool = True) -> dict[str, Any]:
    name, config = load_config(model)
    adapter = adapter_for(config)
    if not adapter.closed_form:
        return _numeric_report(name, config, adapter, with_params)
    specs = adapter.specs(config)
    layers = [count(s) for s in specs]
    total = sum(c.total for c in layers)
    unid = sum(c.unidentified for c in layers)
    near = sum(c.near_unidentified for c in layers)
    first = specs[0]
    def qk_null(spec: AttentionSpec) -> int:
        return count(spec).components["qk_gauge"].unidentified

    qk = qk_null(first)
    mha = qk_null(replace(first, n_kv_heads=first.n_heads))
    plain = replace(first, rope=0.0, qk_norm="none")  # the paper's counting (no RoPE, no norm)
    return {
        "model": name,
        "architecture": (config.get("architectures") or [config.get("model_type")])[0],
        "family": adapter.family,
        "n_layers": len(specs),
        "closed_form": True,
        "spec": first.to_dict(),
        "attention": {"total": total, "unidentified": unid, "ratio": unid / total,
                      "near_unidentified": near},
        "qk_unidentified_per_layer": qk,
        "qk_unidentified_per_layer_if_mha": mha,
        "qk_unidentified_per_layer_without_rope": qk_null(plain),
        "qk_unidentified_per_layer_without_rope_if_mha": qk_null(replace(plain, n_kv_heads=first.n_heads)),
        "model_params": model_params(config) if with_params else None,
        "whole_model": whole_model(config) if with_params else None,
        **_layers([c.to_dict() for c in layers]),
    }


def all_reports(progress: Progress | None = None) -> list[dict[str, Any]]:
    """``model_report`` of every bundled model (``progress`` shows each as a run)."""
    names = bundled()
    out = []
    for i, name in enumerate(names):
        if progress is not None:
            progress.run(i + 1, len(names), name)
        out.append(model_report(name))
    return out


def _whole_cells(r: dict[str, Any]) -> dict[str, Any]:
    w = r.get("whole_model")
    if not w:
        return {"whole_unidentified": None, "whole_ratio": None}
    if w["unidentified"] is None:
        return {"whole_unidentified": None, "whole_ratio": None}
    if w["method"] != "closed form":
        return {"whole_unidentified": f"{w['unidentified']} of {w['total']} (reduced)",
                "whole_ratio": None}
    if not w.get("exact", True):  # a lower bound (docs/theory.md §13.17)
        return {"whole_unidentified": f">= {w['unidentified']}", "whole_ratio": None}
    return {"whole_unidentified": w["unidentified"], "whole_ratio": float(f"{w['ratio']:.3g}")}


def summary_row(r: dict[str, Any]) -> dict[str, Any]:
    """One row of ``report --all``: the same columns for every model (None where a number
    is not known in closed form)."""
    if not r["closed_form"]:
        nr = r["numeric_reduced"]
        return {"model": r["model"], "family": r["family"], "layers": r["n_layers"],
                "d_model": None, "heads": None, "kv_heads": None, "head_dim": None, "bias": None,
                "rope": None, "qk_norm": None,
                "attention_params": r["attention"]["total"], "unidentified": None, "ratio": None,
                "qk_unid_per_layer": None, "qk_unid_per_layer_if_mha": None,
                "qk_unid_no_rope": None, "qk_unid_no_rope_if_mha": None,
                "numeric_reduced":
                    f"{nr['unidentified']} of {nr['params']} (+{nr['near_unidentified']} near)",
                "model_params": r["model_params"], **_whole_cells(r)}
    s = r["spec"]
    return {
        "model": r["model"], "family": r["family"], "layers": r["n_layers"],
        "d_model": s["d_model"], "heads": s["n_heads"], "kv_heads": s["n_kv_heads"],
        "head_dim": s["head_dim"], "bias": s["bias"] or "-", "rope": s["rope"],
        "qk_norm": s["qk_norm"],
        "attention_params": r["attention"]["total"], "unidentified": r["attention"]["unidentified"],
        "ratio": round(r["attention"]["ratio"], 6),
        "qk_unid_per_layer": r["qk_unidentified_per_layer"],
        "qk_unid_per_layer_if_mha": r["qk_unidentified_per_layer_if_mha"],
        "qk_unid_no_rope": r["qk_unidentified_per_layer_without_rope"],
        "qk_unid_no_rope_if_mha": r["qk_unidentified_per_layer_without_rope_if_mha"],
        "numeric_reduced": None,
        "model_params": r["model_params"], **_whole_cells(r),
    }


def narrow_row(r: dict[str, Any]) -> dict[str, Any]:
    """One row of ``report --all``'s default table, what fits 100 columns: the unidentified
    ratio of attention and of the whole model, and attention's near-unidentified count (all
    layers). Families without a closed form show the arbiter's count on a reduced layer or
    model, marked "(reduced)"."""
    w = r.get("whole_model") or {}
    if r["closed_form"]:
        a = r["attention"]
        ratio, near = a["ratio"], a["near_unidentified"]
    else:
        nr = r["numeric_reduced"]
        ratio = f"{nr['unidentified'] / nr['params']:.4g} (reduced)"
        near = f"{nr['near_unidentified']} (reduced)"
    whole = None
    if w.get("unidentified") is not None:
        whole = w["ratio"] if w["method"] == "closed form" else (
            f"{w['unidentified'] / w['total']:.4g} (reduced)")
    return {"model": r["model"], "layers": r["n_layers"], "attention ratio": ratio,
            "whole-model ratio": whole, "near-unidentified": near}
