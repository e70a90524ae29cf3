"""`attnid.readahead`: the spans asked for are read (this process's read-byte count grows by
them), each once; a span of a missing file is passed over; ``ATTNID_READAHEAD=0`` reads
nothing; and a checkpoint's read order puts the tensors outside the layers first, then the
layers in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnid import readahead
from attnid.checkpoint.load import open_checkpoint
from attnid.testing.catalogue import WHOLE_CASES


def _read_bytes() -> int:
    """Bytes this process's threads read through read calls (``rchar``), summed."""
    total = 0
    for t in Path("/proc/self/task").iterdir():
        for line in (t / "io").read_text().splitlines():
            if line.startswith("rchar:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc needed")
def test_spans_are_read_once(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 40_000)  # 10 MB
    assert readahead.idle()
    before = _read_bytes()
    asked = readahead.ahead([(p, 1000, 9_000_000), (p, 1000, 9_000_000)])  # the second: a repeat
    assert asked == 9_000_000
    assert readahead.idle(), "the reader did not finish"
    got = _read_bytes() - before
    assert 9_000_000 <= got < 9_500_000, f"read {got} bytes for a 9,000,000-byte span"
    assert readahead.ahead([(p, 1000, 9_000_000)]) == 0


def test_missing_file_passed_over(tmp_path):
    assert readahead.ahead([(tmp_path / "gone.bin", 0, 100)]) == 100
    assert readahead.idle()
    assert readahead.ahead([(tmp_path / "gone2.bin", 0, 0)]) == 0  # nothing to read


def test_off(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNID_READAHEAD", "0")
    assert readahead.ahead([(tmp_path / "x.bin", 0, 100)]) == 0


def test_read_order(tmp_path):
    from attnid.adapters.base import build_hf_model

    c = {**WHOLE_CASES["llama-gqa-2layers"]}
    model = build_hf_model(c, head=True).to(torch.float32)
    model.save_pretrained(tmp_path)
    ck = open_checkpoint(tmp_path)
    order = ck.read_order()
    assert sorted(order) == sorted(ck.index)
    layer = [next((i for i in range(2) if f"layers.{i}." in n), -1) for n in order]
    assert layer == sorted(layer), order  # outside the layers first, then layer 0, then 1
    assert layer[0] == -1 and {"model.embed_tokens.weight", "lm_head.weight"} <= set(order[:layer.count(-1)])
    first = ck.read_order(layers=1)
    assert first == [n for n, i in zip(order, layer, strict=True) if i < 1]
    assert ck.read_ahead(first) == sum(ck.index[n].span(n)[2] for n in first)
    assert readahead.idle()


def test_checkpoint_from_headers(tmp_path):
    """`readahead.checkpoint` asks, from the headers alone, for the tensors outside the layers
    and the first layer; a damaged file or a missing path is passed over."""
    from attnid.adapters.base import build_hf_model

    model = build_hf_model({**WHOLE_CASES["llama-gqa-2layers"]}, head=True).to(torch.float32)
    model.save_pretrained(tmp_path / "m")
    ck = open_checkpoint(tmp_path / "m")
    want = sum(ck.index[n].span(n)[2] for n in ck.read_order(layers=1))
    assert readahead.checkpoint(tmp_path / "m") == want
    assert readahead.checkpoint(tmp_path / "m" / "model.safetensors") == 0  # asked already
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\xff" * 20)
    assert readahead.checkpoint(tmp_path / "bad") == 0
    assert readahead.checkpoint(tmp_path / "nowhere") == 0
    assert readahead.idle()


def test_layer_of():
    names = ("model.layers.12.mlp.up_proj.weight", "transformer.h.0.attn.c_attn.weight",
             "model.embed_tokens.weight", "lm_head.weight")
    assert [readahead.layer_of(n) for n in names] == [12, 0, -1, -1]


DAMAGED = {"list": b"[1, 2]", "no offsets": b'{"w": 3}', "text offsets": b'{"w": {"data_offsets": ["a", 2]}}',
           "reversed": b'{"w": {"data_offsets": [9, 2]}}', "float": b'{"w": {"data_offsets": [0, 1e30]}}',
           "not json": b"{not json", "empty": b"", "deep": b"[" * 200_000}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_checkpoint_damaged_header(tmp_path, case):
    """A header `readahead.checkpoint` cannot use is passed over: nothing asked for, no
    exception (the command's own reading names what is wrong)."""
    import struct

    header = DAMAGED[case]
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    assert readahead.checkpoint(tmp_path) == 0
    assert readahead.idle(5)


def test_span_past_any_file_end(tmp_path):
    """Offsets no file reaches (the seek overflows) leave the reader alive: later spans are read."""
    import struct

    header = b'{"w": {"data_offsets": [1000000000000000000000000, 2000000000000000000000000]}}'
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    assert readahead.checkpoint(tmp_path) > 0
    assert readahead.idle(5), "the reader thread died"
    p = tmp_path / "ok.bin"
    p.write_bytes(b"x" * 1000)
    assert readahead.ahead([(p, 0, 1000)]) == 1000 and readahead.idle(5)


def test_off_and_names(tmp_path, monkeypatch):
    assert readahead.checkpoint("gpt2") == 0  # a name, not a local path
    assert readahead.checkpoint(tmp_path / ("x" * 5000)) == 0  # a path the OS refuses
    monkeypatch.setenv("ATTNID_READAHEAD", "0")
    assert readahead.checkpoint(tmp_path) == 0
