"""Layouts kept on disk (`attnid.whole.transforms.layout_store`): every catalogue case's layout
survives the JSON round trip; a stored layout is used without building the model; a damaged
entry, an entry of another shape, ``ATTNID_CACHE=0`` and a family registered from outside are
each handled (rebuilt, rebuilt, nothing kept, nothing kept)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from attnid.testing.catalogue import WHOLE_CASES
from attnid.whole.transforms import layout as L
from attnid.whole.transforms import layout_store


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNID_CACHE", str(tmp_path))
    monkeypatch.setattr(L, "_BUILT", {})  # this process's own memo: as a new process
    return tmp_path / "layouts"


@pytest.mark.parametrize("case", sorted(WHOLE_CASES))
def test_round_trip(case):
    lay = L.layout_for(WHOLE_CASES[case])
    back = layout_store.decode(json.loads(json.dumps(asdict(lay))))
    assert back == lay, f"{case}: {back} != {lay}"


def _no_build(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was built although its layout was stored")
    monkeypatch.setattr(L, "new_hf_model", refuse)


def test_stored_layout_is_used(store, monkeypatch):
    c = WHOLE_CASES["llama-tied"]
    lay, names = L.layout_for(c), L.state_names(c)
    files = list(store.glob("*.json"))
    assert len(files) == 1, files
    monkeypatch.setattr(L, "_BUILT", {})
    _no_build(monkeypatch)
    assert L.layout_for(c) == lay and L.state_names(c) == names


@pytest.mark.parametrize("damage", ["truncated", "unknown field"])
def test_damaged_entry_is_rebuilt(store, monkeypatch, damage):
    c = WHOLE_CASES["gpt2-tied"]
    lay = L.layout_for(c)
    (f,) = store.glob("*.json")
    data = json.loads(f.read_text())
    if damage == "truncated":
        f.write_text(f.read_text()[:40])
    else:
        data["layout"]["norms"][0]["new_field"] = 1
        f.write_text(json.dumps(data))
    monkeypatch.setattr(L, "_BUILT", {})
    assert L.layout_for(c) == lay
    assert layout_store.decode(json.loads(f.read_text())["layout"]) == lay  # written again, whole


def test_off(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # where it would go if "0" were ignored
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ATTNID_CACHE", "0")
    monkeypatch.setattr(L, "_BUILT", {})
    assert layout_store.directory() is None
    L.layout_for(WHOLE_CASES["llama-untied"])
    assert not list(tmp_path.rglob("*.json"))
    monkeypatch.delenv("ATTNID_CACHE")  # the same call with the store on writes there
    monkeypatch.setattr(L, "_BUILT", {})
    L.layout_for(WHOLE_CASES["llama-untied"])
    assert len(list(tmp_path.rglob("*.json"))) == 1


def test_outside_family_not_kept(store, monkeypatch):
    """A layout builder registered from outside attnid is code the key does not hash."""
    own = L.FAMILIES["llama"]
    monkeypatch.setattr(L, "FAMILIES", {**L.FAMILIES, "llama": lambda model: own(model)})  # defined here
    L.layout_for(WHOLE_CASES["llama-untied"])
    assert not store.exists() or not list(store.glob("*.json"))


def test_key_follows_the_config(store):
    L.layout_for(WHOLE_CASES["llama-untied"])
    L.layout_for(WHOLE_CASES["llama-tied"])
    assert len(list(store.glob("*.json"))) == 2
