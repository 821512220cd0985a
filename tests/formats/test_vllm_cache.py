"""The cache of learned vLLM maps (``reshard.formats.vllm.cache``), without vLLM: the key (what
changes it and what does not), a document's round trip through the disk (every map, offset and
shape equal), and entries that must not be used (another key, other parameters, a broken file)
ignored rather than trusted. The maps here are ``layouts.arch``'s vLLM layouts of a toy Qwen2 at
TP 2 (what the workers would have learned); the real engine's cache is checked in
``tests_vllm/test_live.py``. Well under a second."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from reshard.formats.vllm import cache, wire
from reshard.layouts.arch import LLAMA_VLLM, inference_targets

SHAPES = {"model.embed_tokens.weight": (100, 16), "lm_head.weight": (100, 16),
          "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (8, 16),
          "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.layers.0.self_attn.q_proj.bias": (16,),
          "model.layers.0.self_attn.k_proj.bias": (8,), "model.layers.0.self_attn.v_proj.bias": (8,),
          "model.layers.0.self_attn.o_proj.weight": (16, 16), "model.layers.0.mlp.gate_proj.weight": (24, 16),
          "model.layers.0.mlp.up_proj.weight": (24, 16), "model.layers.0.mlp.down_proj.weight": (16, 24),
          "model.layers.0.input_layernorm.weight": (16,), "model.norm.weight": (16,)}
CONFIG = {"model_type": "qwen2", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 100, "_name_or_path": "/a/folder", "transformers_version": "5.0.0"}


def key(**change) -> cache.MapsKey:
    k = cache.MapsKey("Qwen2ForCausalLM", cache.config_digest(CONFIG), "None", 2, 1, 1, 1, "0.32.0",
                      cache.shapes_digest(SHAPES))
    return replace(k, **change)


@pytest.fixture
def maps():
    return inference_targets(LLAMA_VLLM, SHAPES, tp=2, num_heads=4, num_kv_heads=2)


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path))
    cache.clear_memory()
    yield tmp_path
    cache.clear_memory()


def entry(maps, rank=0) -> cache.CachedMaps:
    return cache.CachedMaps(maps, tuple(sorted({p.into for p in maps.values() if rank in p.shapes})), 1234)


def test_the_key_follows_the_model_not_the_folder():
    moved = dict(CONFIG, _name_or_path="/another/folder", transformers_version="5.1.0")
    assert cache.config_digest(moved) == cache.config_digest(CONFIG)
    assert cache.config_digest(dict(CONFIG, hidden_size=32)) != cache.config_digest(CONFIG)
    assert cache.shapes_digest({**SHAPES, "lm_head.weight": (101, 16)}) != cache.shapes_digest(SHAPES)
    assert cache.shapes_digest(dict(reversed(SHAPES.items()))) != cache.shapes_digest(SHAPES)  # the order plans follow
    digests = {key().digest} | {key(**{f: v}).digest for f, v in (
        ("model_class", "LlamaForCausalLM"), ("config", "0" * 64), ("quantization", "fp8"), ("tp", 4), ("pp", 2),
        ("dp", 2), ("ep", 2), ("vllm", "0.33.0"), ("shapes", "1" * 64))}
    assert len(digests) == 10


def test_an_entry_round_trips_through_the_disk(root, maps):
    path = cache.put(key(), 1, entry(maps, 1))
    assert path == root / "vllm-maps" / f"{key().digest}.w1.json"
    assert cache.get(key(), 1, SHAPES).source == "memory"
    cache.clear_memory()
    got = cache.get(key(), 1, SHAPES)
    assert got is not None and got.source == "disk"
    assert wire.encode_targets(got.maps) == wire.encode_targets(maps)  # maps, engine tensors, offsets, shapes
    assert cache.maps_digest(got.maps) == cache.maps_digest(maps)
    assert (got.engine_tensors, got.placed_elements) == (entry(maps, 1).engine_tensors, 1234)
    assert cache.get(key(), 1, SHAPES).source == "memory"  # read once, then kept in the process
    assert cache.get(key(), 0, SHAPES) is None  # another worker's entry is its own


def test_entries_for_something_else_are_not_used(root, maps):
    cache.put(key(), 0, entry(maps))
    cache.clear_memory()
    assert cache.get(key(tp=4), 0, SHAPES) is None
    assert cache.get(key(), 0, {**SHAPES, "model.extra.weight": (4,)}) is None  # other parameters than cached
    path = root / "vllm-maps" / f"{key().digest}.w0.json"
    doc = json.loads(path.read_text())
    # a file copied under another key's name
    (root / "vllm-maps" / f"{key(vllm='9').digest}.w0.json").write_text(json.dumps(doc))
    assert cache.get(key(vllm="9"), 0, SHAPES) is None
    # a broken map inside (a part that does not fit its engine tensor), a truncated file
    bad = json.loads(json.dumps(doc))
    name = "model.layers.0.self_attn.k_proj.weight"
    bad["maps"][name]["offsets"]["0"] = 10**6
    path.write_text(json.dumps(bad))
    assert cache.get(key(), 0, SHAPES) is None
    path.write_text(json.dumps(doc)[:100])
    assert cache.get(key(), 0, SHAPES) is None
    cache.put(key(), 0, entry(maps))  # relearned over
    cache.clear_memory()
    assert cache.get(key(), 0, SHAPES).source == "disk"


def test_where_the_cache_lives(monkeypatch, tmp_path, maps):
    monkeypatch.delenv("RESHARD_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "reshard"
    monkeypatch.setenv("RESHARD_CACHE_DIR", "off")
    cache.clear_memory()
    assert cache.put(key(), 0, entry(maps)) is None and not (tmp_path / "xdg").exists()
    assert cache.get(key(), 0, SHAPES).source == "memory"
    cache.clear_memory()
    assert cache.get(key(), 0, SHAPES) is None
    monkeypatch.setenv("RESHARD_CACHE_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a folder")
    assert cache.put(key(), 0, entry(maps)) is None  # an unwritable cache never fails the transfer
    cache.clear_memory()
