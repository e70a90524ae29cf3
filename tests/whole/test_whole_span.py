"""The listed whole-model symmetries are complete: on each tiny config the span of their
generators (every transform in ``attnid.whole.transforms``, attention's orbit tangents,
unread parameters) equals the whole-model arbiter's null space (Hugging Face's own class,
float64): same dimension, every principal angle ~0."""

import pytest

pytest.importorskip("transformers")

from attnid.testing.catalogue import WHOLE_CASES as CASES
from attnid.whole.check import arbiter_whole, tiny_model
from attnid.whole.transforms.span import compare_span, symmetry_directions

COMPLETE = ["llama-untied", "qwen3-qk-norm", "gpt2-tied", "gpt2-untied", "neox-parallel",
            "neox-partial-rotary-no-attn-bias", "bert-mlm-tied", "bert-bare-model",
            "roberta-mlm-tied"]
SLOW = ["gemma-tied", "gemma-untied", "llama-tied", "llama-bare-model", "mistral-mqa",
        "qwen2-qkv-bias", "qwen2-tied", "phi3", "falcon-parallel-mqa-tied", "falcon-sequential-bias",
        "falcon-sequential-mha-untied", "falcon-parallel-bias-untied", "falcon-new-decoder",
        "gpt2-relu", "neox-sequential", "neox-tied-no-attn-bias", "bert-mlm-one-token-type",
        "bert-mlm-untied", "roberta-mlm-untied", "roberta-bare-model", "roberta-padding-idx-3",
        "llama-gqa-2layers", "gpt2-2layers", "bert-2layers", "llama-learned-positions",
        "llama-no-positions-tied"]  # the default run keeps it short


def test_every_tiny_config_is_checked():
    assert sorted(COMPLETE + SLOW) == sorted(CASES)


@pytest.mark.parametrize("name", COMPLETE + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW])
def test_generators_span_the_arbiter_null_space(name):
    config = CASES[name]
    dirs = symmetry_directions(tiny_model(config, seed=0), config)
    null = arbiter_whole(config, seed=0, near=False, return_null_space=True).result.null_space
    c = compare_span(dirs.matrix(), null)
    parts = {k: v.shape[1] for k, v in dirs.parts.items()}
    assert c.leak < 1e-6, f"{name}: a generator leaves the null space by {c.leak:.2e} ({parts})"
    assert c.rank == c.nullity, f"{name}: generators span {c.rank}, null space {c.nullity} ({parts})"
    assert c.max_sine < 1e-6, f"{name}: largest principal-angle sine {c.max_sine:.2e}"
