"""Malformed checkpoints never give a traceback.

Starting from the real all-MiniLM-L6-v2 checkpoint (BERT, one file) and a tiny random Llama
saved in three shards, each mutation below breaks one thing (a safetensors header field, a
file, the shard index, a config field, the weights' values or dtype) and each checkpoint
command (`audit`, `diff` with the broken checkpoint on either side, `canonicalize`) must
answer with exit 2 and exactly one stderr line, ``error: ...``, that names the broken file
and, where there is one, the tensor or the field; nothing may appear at OUT_DIR and the
input must be left as it was. The table is the contract; the hypothesis tests below it
throw random values at header fields, config fields and bytes (a larger run under ``slow``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnid.cli import main
from attnid.testing.files import assert_one_error, fingerprint

INDEX = "model.safetensors.index.json"
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "intermediate_size": 64, "vocab_size": 64, "attention_bias": True,
         "tie_word_embeddings": True}


# ---- the two sources ---------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    name: str
    root: Path
    attention: str  # the first attention weight's tensor name
    other: str  # a tensor outside attention
    hidden: str  # the config key of the width
    layers: str  # the config key of the depth

    def file_of(self, tensor: str) -> str:
        """The file name of the shard holding ``tensor``."""
        index = self.root / INDEX
        if index.exists():
            return json.loads(index.read_text())["weight_map"][tensor]
        return "model.safetensors"


@pytest.fixture(scope="module")
def sources(minilm, tmp_path_factory) -> dict[str, Source]:
    import transformers

    root = tmp_path_factory.mktemp("fuzz-src")
    conf = transformers.AutoConfig.for_model("llama", **{k: v for k, v in LLAMA.items()
                                                         if k != "model_type"})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(conf)
    model.save_pretrained(root / "llama", max_shard_size="40KB")
    assert len(list((root / "llama").glob("*.safetensors"))) > 1  # really sharded
    return {
        "minilm": Source("minilm", minilm, "encoder.layer.0.attention.self.query.weight",
                         "embeddings.word_embeddings.weight", "hidden_size", "num_hidden_layers"),
        "llama": Source("llama", root / "llama", "model.layers.0.self_attn.q_proj.weight",
                        "model.embed_tokens.weight", "hidden_size", "num_hidden_layers"),
    }


def stage(src: Path, dst: Path) -> Path:
    """``dst`` as a copy of ``src`` made of links to its files (a mutation replaces one)."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).symlink_to(p.resolve(), target_is_directory=p.is_dir())
    return dst


def own(path: Path) -> Path:
    """Replace the link ``path`` by a private copy (safe to edit)."""
    target = path.resolve()
    path.unlink()
    shutil.copyfile(target, path)  # copy_file_range: cheap even for MiniLM's 90 MB
    return path


def read_header(path: Path) -> tuple[dict, int]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), n


NOT_JSON = object()  # a header that is not JSON at all


def write_header(path: Path, header: object) -> None:
    """Rewrite ``path``'s header (a JSON value, or ``NOT_JSON``); the data bytes stay."""
    source = path.resolve()
    _, n = read_header(source)
    blob = b"{not json" if header is NOT_JSON else json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    size = source.stat().st_size - 8 - n
    tmp = path.with_name(path.name + ".new")
    with source.open("rb") as fi, tmp.open("wb") as fo:
        fo.write(struct.pack("<Q", len(blob)) + blob)
        fo.flush()
        done = 0
        while done < size:  # the data, copied by the kernel
            done += os.copy_file_range(fi.fileno(), fo.fileno(), size - done, 8 + n + done)
    path.unlink()
    tmp.rename(path)


def edit_header(d: Path, file: str, fn: Callable[[dict], object]) -> None:
    header, _ = read_header(d / file)
    write_header(d / file, fn(header))


def entry(tensor: str, fn: Callable[[dict], None]) -> Callable[[dict], dict]:
    def edit(header: dict) -> dict:
        fn(header[tensor])
        return header

    return edit


def edit_json(d: Path, file: str, fn: Callable[[object], object]) -> None:
    data = json.loads((d / file).read_text())
    (d / file).unlink()
    (d / file).write_text(json.dumps(fn(data)))


def set_key(key: str, value: object) -> Callable[[dict], dict]:
    return lambda c: {**c, key: value}


def patch_values(d: Path, file: str, tensor: str, values: torch.Tensor) -> None:
    """Overwrite the first elements of ``tensor``'s stored bytes in place (a private copy)."""
    header, n = read_header(d / file)
    start = 8 + n + header[tensor]["data_offsets"][0]
    own(d / file)
    with (d / file).open("r+b") as f:
        f.seek(start)
        f.write(values.numpy().tobytes())


def restore(d: Path, file: str, tensor: str, dtype: torch.dtype) -> None:
    """Store ``tensor`` in ``dtype`` (the whole shard rewritten by the safetensors library)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / file)
    tensors[tensor] = tensors[tensor].to(dtype)
    (d / file).unlink()
    save_file(tensors, d / file, metadata={"format": "pt"})


# ---- the mutations ------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutation:
    """``apply(dir, source) -> (file, words)``: break the staged checkpoint; the error line
    must name ``file`` and contain every one of ``words``."""

    name: str
    apply: Callable[[Path, Source], tuple[str, list[str]]]
    commands: tuple[str, ...] = ("audit", "diff-b", "diff-a", "canonicalize")
    sources: tuple[str, ...] = ("minilm", "llama")


def header_edit(fn: Callable[[dict, str], object], *words: str) -> Callable:
    """A mutation of the header holding the first attention tensor."""
    def apply(d: Path, s: Source) -> tuple[str, list[str]]:
        file = s.file_of(s.attention)
        edit_header(d, file, lambda h: fn(h, s.attention))
        return file, [w.replace("TENSOR", s.attention) for w in words]

    return apply


def field_edit(field: str, value: object, *words: str) -> Callable:
    def fn(h: dict, t: str) -> dict:
        if value is DELETE:
            del h[t][field]
        else:
            h[t][field] = value(h[t][field]) if callable(value) else value
        return h

    return header_edit(fn, "TENSOR", *words)


DELETE = object()


def overlap(h: dict, t: str) -> dict:
    """Another tensor's bytes claimed by ``t`` as well (its own size kept)."""
    start, end = h[t]["data_offsets"]
    other = next(v for k, v in h.items()
                 if k not in (t, "__metadata__") and v["data_offsets"] != [start, end])
    o0 = other["data_offsets"][0]
    h[t]["data_offsets"] = [o0, o0 + end - start]
    return h


def whole_file(edit: Callable[[Path], None], *words: str) -> Callable:
    """A mutation of the whole shard holding the first attention tensor (``edit`` gets a
    private copy of it)."""
    def apply(d: Path, s: Source) -> tuple[str, list[str]]:
        file = s.file_of(s.attention)
        edit(own(d / file))
        return file, list(words)

    return apply


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size * 3 // 4)


def replace_with(data: bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data)


def header_length(n: Callable[[int], int]) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        with path.open("r+b") as f:
            f.write(struct.pack("<Q", n(path.stat().st_size)))

    return edit


def config_edit(fn: Callable[[Source], Callable[[object], object]], *words: str) -> Callable:
    def apply(d: Path, s: Source) -> tuple[str, list[str]]:
        edit_json(d, "config.json", fn(s))
        return "config.json", [w.replace("HIDDEN", s.hidden).replace("LAYERS", s.layers) for w in words]

    return apply


def config_text(text: str, *words: str) -> Callable:
    def apply(d: Path, s: Source) -> tuple[str, list[str]]:
        (d / "config.json").unlink()
        (d / "config.json").write_text(text)
        return "config.json", list(words)

    return apply


def index_edit(fn: Callable[[dict, Source], object], *words: str) -> Callable:
    def apply(d: Path, s: Source) -> tuple[str, list[str]]:
        edit_json(d, INDEX, lambda data: fn(data, s))
        return INDEX, list(words)

    return apply


def wrong_shard(data: dict, s: Source) -> dict:
    wm = data["weight_map"]
    others = sorted(set(wm.values()) - {wm[s.attention]})
    wm[s.attention] = others[0]
    return data


def missing_shard(d: Path, s: Source) -> tuple[str, list[str]]:
    file = s.file_of(s.attention)
    (d / file).unlink()
    return file, []


def values(v: float, tensor: str = "attention") -> Callable:
    def apply(d: Path, s: Source) -> tuple[str, list[str]]:
        name = getattr(s, tensor)
        file = s.file_of(name)
        patch_values(d, file, name, torch.full((4,), v, dtype=torch.float32))
        return file, [name, "NaN"]

    return apply


def dtype(to: torch.dtype, word: str) -> Callable:
    def apply(d: Path, s: Source) -> tuple[str, list[str]]:
        file = s.file_of(s.attention)
        own(d / file)
        restore(d, file, s.attention, to)
        return file, [s.attention, word]

    return apply


def renamed(d: Path, s: Source) -> tuple[str, list[str]]:
    """The first attention tensor is gone (stored under another name)."""
    file = s.file_of(s.attention)
    edit_header(d, file, lambda h: {(k + "_gone" if k == s.attention else k): v for k, v in h.items()})
    return file, [s.attention]


def no_config(d: Path, s: Source) -> tuple[str, list[str]]:
    (d / "config.json").unlink()
    return "config.json", []


MUTATIONS = [
    # safetensors headers
    Mutation("header-list", header_edit(lambda h, t: list(h.items()), "JSON list")),
    Mutation("header-not-json", header_edit(lambda h, t: NOT_JSON)),
    Mutation("entry-not-object", header_edit(lambda h, t: {**h, t: 7}, "TENSOR")),
    Mutation("offsets-reversed", field_edit("data_offsets", lambda o: o[::-1], "data_offsets")),
    Mutation("offsets-negative", field_edit("data_offsets", lambda o: [-8, o[1]], "data_offsets")),
    Mutation("offsets-overlap", header_edit(overlap, "TENSOR", "data_offsets")),
    Mutation("offsets-missing", field_edit("data_offsets", DELETE, "data_offsets")),
    Mutation("shape-mismatch", field_edit("shape", lambda s: [s[0] + 1, *s[1:]], "shape")),
    Mutation("shape-huge", field_edit("shape", [10**12, 10**6], "shape")),
    Mutation("shape-negative", field_edit("shape", lambda s: [-s[0], *s[1:]], "shape")),
    Mutation("shape-missing", field_edit("shape", DELETE, "shape")),
    Mutation("shape-str", field_edit("shape", "32x32", "shape")),
    Mutation("dtype-unknown", field_edit("dtype", "F33", "dtype")),
    Mutation("dtype-missing", field_edit("dtype", DELETE, "dtype")),
    # whole files
    Mutation("truncated", whole_file(truncate, "truncated")),
    Mutation("empty", whole_file(replace_with(b""), "0 bytes")),
    Mutation("garbage", whole_file(replace_with(bytes(range(256)) * 4), "header")),
    Mutation("header-length-huge", whole_file(header_length(lambda size: 2**60), "header")),
    Mutation("header-length-past-end", whole_file(header_length(lambda size: size), "header")),
    # the shard index
    Mutation("index-missing-shard", missing_shard, sources=("llama",)),
    Mutation("index-wrong-shard", index_edit(wrong_shard), sources=("llama",)),
    Mutation("index-list", index_edit(lambda data, s: [data]), sources=("llama",)),
    Mutation("index-no-map", index_edit(lambda data, s: {"metadata": {}}, "weight_map"),
             sources=("llama",)),
    Mutation("index-shard-outside", index_edit(
        lambda data, s: {**data, "weight_map": {**data["weight_map"], s.attention: "../x.safetensors"}},
        "../x.safetensors"), sources=("llama",)),
    # config.json
    Mutation("config-missing", no_config),
    Mutation("config-invalid-json", config_text("{\"hidden_size\": 32,", "JSON")),
    Mutation("config-list", config_edit(lambda s: lambda c: [c], "JSON list")),
    Mutation("config-hidden-missing", config_edit(
        lambda s: lambda c: {k: v for k, v in c.items() if k != s.hidden}, "HIDDEN")),
    Mutation("config-hidden-nan", config_edit(lambda s: set_key(s.hidden, float("nan")), "HIDDEN")),
    Mutation("config-hidden-negative", config_edit(lambda s: set_key(s.hidden, -32), "HIDDEN")),
    Mutation("config-hidden-zero", config_edit(lambda s: set_key(s.hidden, 0), "HIDDEN")),
    Mutation("config-hidden-str", config_edit(lambda s: set_key(s.hidden, "32"), "HIDDEN")),
    Mutation("config-hidden-fraction", config_edit(lambda s: set_key(s.hidden, 32.5), "HIDDEN")),
    Mutation("config-hidden-bool", config_edit(lambda s: set_key(s.hidden, True), "HIDDEN")),
    Mutation("config-heads-not-dividing", config_edit(
        lambda s: set_key("num_attention_heads", 5), "num_attention_heads")),
    Mutation("config-kv-heads-not-dividing", config_edit(
        lambda s: set_key("num_key_value_heads", 3), "num_key_value_heads"), sources=("llama",)),
    Mutation("config-layers-zero", config_edit(lambda s: set_key(s.layers, 0), "LAYERS")),
    Mutation("config-layers-missing", config_edit(
        lambda s: lambda c: {k: v for k, v in c.items() if k != s.layers}, "LAYERS")),
    Mutation("config-layers-too-many", config_edit(lambda s: lambda c: {**c, s.layers: c[s.layers] + 1},
                                                   "lacks")),
    Mutation("config-eps-str", config_edit(lambda s: set_key("rms_norm_eps", "small"), "rms_norm_eps"),
             sources=("llama",)),
    Mutation("config-rope-theta-str", config_edit(
        lambda s: lambda c: {**c, "rope_parameters": {"rope_theta": "big", "rope_type": "default"}},
        "rope_theta"), sources=("llama",)),
    Mutation("config-unknown-architecture", config_edit(
        lambda s: lambda c: {**c, "architectures": ["MambaForCausalLM"], "model_type": "mamba"},
        "MambaForCausalLM")),
    Mutation("config-architectures-not-list", config_edit(
        lambda s: set_key("architectures", 7), "architectures")),
    # the weights
    Mutation("nan-attention", values(float("nan"))),
    Mutation("inf-attention", values(float("inf"))),
    Mutation("inf-outside-attention", values(float("-inf"), "other"),
             commands=("diff-b", "diff-a", "canonicalize")),  # audit reads attention only
    Mutation("attention-int32", dtype(torch.int32, "I32")),
    Mutation("attention-float8", dtype(torch.float8_e4m3fn, "F8_E4M3")),
    Mutation("attention-missing", renamed),
]

PAIRS = [(m, src) for m in MUTATIONS for src in m.sources]
# The default run gives each (mutation, source) one command, in turn (each command meets a
# quarter of the mutations); the full product runs under ``slow``.
CASES = [pytest.param(m, src, cmd, id=f"{m.name}-{src}-{cmd}",
                      marks=() if cmd == m.commands[k % len(m.commands)] else pytest.mark.slow)
         for k, (m, src) in enumerate(PAIRS) for cmd in m.commands]


@pytest.fixture(scope="module")
def broken(sources, tmp_path_factory) -> Callable[[Mutation, str], tuple[Path, str, list[str]]]:
    """The staged, mutated checkpoint of a (mutation, source), made once and shared by the
    commands (each of which must leave it as it was)."""
    made: dict[tuple[str, str], tuple[Path, str, list[str]]] = {}

    def get(m: Mutation, src: str) -> tuple[Path, str, list[str]]:
        if (m.name, src) not in made:
            d = stage(sources[src].root, tmp_path_factory.mktemp("fuzz") / f"{m.name}-{src}")
            file, words = m.apply(d, sources[src])
            made[m.name, src] = (d, file, words)
        return made[m.name, src]

    return get


def argv(cmd: str, bad: Path, good: Path, out: Path) -> list[str]:
    return {"audit": ["audit", str(bad)], "diff-b": ["diff", str(good), str(bad)],
            "diff-a": ["diff", str(bad), str(good)],
            "canonicalize": ["canonicalize", str(bad), str(out)]}[cmd]


@pytest.mark.parametrize(("mutation", "src", "cmd"), CASES)
def test_malformed_checkpoint(mutation, src, cmd, sources, broken, tmp_path, capsys):
    d, file, words = broken(mutation, src)
    good = sources[src].root
    before, good_before = fingerprint(d), fingerprint(good)
    out = tmp_path / "out"
    code = main(argv(cmd, d, good, out))
    assert_one_error(code, capsys.readouterr().err, file, words)
    assert not out.exists(), "canonicalize left something at OUT_DIR"
    assert not [p.name for p in tmp_path.iterdir()], "a temporary sibling was left behind"
    assert fingerprint(d) == before and fingerprint(good) == good_before, "an input was modified"


CONFIG_CASES = [pytest.param(m, cmd, id=f"{m.name}-{cmd}")
                for m in MUTATIONS if m.name.startswith("config-") and m.name != "config-layers-too-many"
                for cmd in ("report", "verify-hf")]


@pytest.mark.parametrize(("mutation", "cmd"), CONFIG_CASES)
def test_malformed_config_elsewhere(mutation, cmd, broken, capsys):
    """The commands that read a config without weights (`report`, `verify --hf-config`)."""
    d, file, words = broken(mutation, "llama")
    before = fingerprint(d)
    args = ["report", str(d)] if cmd == "report" else ["verify", "--hf-config", str(d)]
    assert_one_error(main(args), capsys.readouterr().err, file, words)
    assert fingerprint(d) == before


@pytest.mark.parametrize("cmd", ["audit", "diff-b", "canonicalize"])
@pytest.mark.parametrize("src", ["minilm", "llama"])
def test_sources_are_sound(src, cmd, sources, tmp_path, capsys):
    """The control: unbroken, both sources pass every command (so a refusal above is the
    mutation's doing). MiniLM's canonicalize is tested in test_canonicalize.py."""
    if (src, cmd) == ("minilm", "canonicalize"):
        pytest.skip("covered by test_canonicalize.py")
    root = sources[src].root
    before = fingerprint(root)
    code = main([*argv(cmd, root, root, tmp_path / "out"), "--json"])
    assert code == 0, capsys.readouterr().err
    assert fingerprint(root) == before


# ---- random mutations (hypothesis) -------------------------------------------------------
SCALARS = st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=8)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)
FAST = settings(max_examples=20, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SLOW = settings(FAST, max_examples=200)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """A tiny random Llama in one file (the source of the random mutations)."""
    import transformers

    conf = transformers.AutoConfig.for_model("llama", **{k: v for k, v in LLAMA.items()
                                                         if k != "model_type"})
    torch.manual_seed(1)
    d = tmp_path_factory.mktemp("fuzz-single") / "llama"
    transformers.AutoModelForCausalLM.from_config(conf).save_pretrained(d)
    return d


def refuses_or_works(d: Path, file: str, cmd: str, capsys, tmp_path_factory) -> None:
    """``cmd`` on the mutated checkpoint ``d`` either works (exit 0) or refuses in one
    ``error:`` line naming ``file``, writing nothing."""
    out = tmp_path_factory.mktemp("hyp-out") / "out"
    code = main([*argv(cmd, d, d, out), "--json"])
    err = capsys.readouterr().err
    if code != 0:
        assert_one_error(code, err, file, [])
        assert not out.exists()


def _random_header_field(single, tmp_path_factory, capsys, data, cmd) -> None:
    header, _ = read_header(single / "model.safetensors")
    names = sorted(k for k in header if k != "__metadata__")
    tensor = data.draw(st.sampled_from(names), label="tensor")
    field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]), label="field")
    value = data.draw(JSON, label="value")
    d = stage(single, tmp_path_factory.mktemp("hyp") / "m")
    header[tensor][field] = value
    write_header(d / "model.safetensors", header)
    refuses_or_works(d, "model.safetensors", cmd, capsys, tmp_path_factory)


def _random_config_field(single, tmp_path_factory, capsys, data, cmd) -> None:
    config = json.loads((single / "config.json").read_text())
    key = data.draw(st.sampled_from(sorted(config)), label="key")
    value = data.draw(JSON, label="value")
    d = stage(single, tmp_path_factory.mktemp("hyp") / "m")
    edit_json(d, "config.json", set_key(key, value))
    refuses_or_works(d, "config.json", cmd, capsys, tmp_path_factory)


def _random_bytes(single, tmp_path_factory, capsys, data, cmd) -> None:
    raw = (single / "model.safetensors").read_bytes()
    _, n = read_header(single / "model.safetensors")
    d = stage(single, tmp_path_factory.mktemp("hyp") / "m")
    edits = data.draw(st.lists(st.tuples(st.integers(0, 8 + n - 1), st.integers(0, 255)),
                               min_size=1, max_size=4), label="edits")
    cut = data.draw(st.none() | st.integers(0, len(raw)), label="cut")
    b = bytearray(raw)
    for i, v in edits:
        b[i] = v
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").write_bytes(bytes(b[:cut]))
    refuses_or_works(d, "model.safetensors", cmd, capsys, tmp_path_factory)


RANDOM = {"header-field": _random_header_field, "config-field": _random_config_field,
          "bytes": _random_bytes}


@pytest.mark.parametrize("kind", sorted(RANDOM))
@FAST
@given(data=st.data())
def test_random_mutation(kind, single, tmp_path_factory, capsys, data):
    RANDOM[kind](single, tmp_path_factory, capsys, data, "audit")


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(RANDOM))
@SLOW
@given(data=st.data())
def test_random_mutation_every_command(kind, single, tmp_path_factory, capsys, data):
    cmd = data.draw(st.sampled_from(["audit", "diff-a", "canonicalize"]), label="command")
    RANDOM[kind](single, tmp_path_factory, capsys, data, cmd)


def test_what_the_random_fuzz_found(single, tmp_path_factory, capsys):
    """Three cases the random mutations found (both A and B the broken checkpoint): a space in
    the token table's name (diff gave a TypeError deep in the fit), a null boolean field (the
    error said "the config" instead of naming the file), and ``mlp_bias: true`` on a model
    without MLP biases (canonicalize's transformers load named only the weights file); and a
    layer count near 10^9 (canonicalize's list of per-layer specs took 22 GB before any file
    was read: refused above `MAX_LAYERS`)."""
    d = stage(single, tmp_path_factory.mktemp("found") / "table")
    edit_header(d, "model.safetensors",
                lambda h: {k.replace("embed_tokens", "embed tokens"): v for k, v in h.items()})
    code = main(["diff", str(d), str(d), "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "model.safetensors" in err and "model.embed_tokens.weight" in err, err
    assert err.count("\n") == 1 and err.startswith("error:"), err
    d = stage(single, tmp_path_factory.mktemp("found") / "config")
    edit_json(d, "config.json", set_key("attention_bias", None))
    code = main(["diff", str(d), str(d), "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "config.json" in err and "attention_bias" in err, err
    d = stage(single, tmp_path_factory.mktemp("found") / "mlp-bias")
    edit_json(d, "config.json", set_key("mlp_bias", True))
    out = tmp_path_factory.mktemp("found-out") / "out"
    code = main([*argv("canonicalize", d, d, out), "--json"])
    assert_one_error(code, capsys.readouterr().err, "config.json",
                     ["model.safetensors", "mlp.down_proj.bias"])
    assert not out.exists()
    d = stage(single, tmp_path_factory.mktemp("found") / "layers")
    edit_json(d, "config.json", set_key("num_hidden_layers", 1_073_741_824))
    for cmd in ("audit", "diff-a", "canonicalize"):
        out = tmp_path_factory.mktemp("found-out") / "out"
        code = main([*argv(cmd, d, d, out), "--json"])
        assert_one_error(code, capsys.readouterr().err, "config.json", ["num_hidden_layers", "65,536"])
        assert not out.exists()


# ---- audit --plot: the format is checked before the work ---------------------------------
@pytest.mark.parametrize("name", ["map.txt", "map", "map.PNGX"])
def test_plot_format_refused_before_any_work(name, sources, tmp_path, capsys, monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("audit ran before --plot was checked")

    monkeypatch.setattr("attnid.checkpoint.audit.audit", no_work)
    code = main(["audit", str(sources["llama"].root), "--plot", str(tmp_path / name)])
    assert_one_error(code, capsys.readouterr().err, name, ["suffix", ".png", ".svg"])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["map.png", "map.svg", "map.PDF"])
def test_plot_formats_matplotlib_writes(name, sources, tmp_path, capsys):
    assert main(["audit", str(sources["llama"].root), "--plot", str(tmp_path / name)]) == 0
    head = (tmp_path / name).read_bytes()[:8]
    assert head.startswith({".png": b"\x89PNG", ".svg": b"<?xml", ".pdf": b"%PDF"}[Path(name).suffix.lower()])
