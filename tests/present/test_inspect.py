"""``reshard inspect`` and ``reshard plan SOURCE --tp T``: the printed figures against values
computed here from shapes, the pictures (size, and a replicated block carrying several ranks'
colours), layout families rebuilt at another TP degree, refusals, and the missing-matplotlib path."""

from __future__ import annotations

import json
import math
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from reshard import apply_plan
from reshard.cli import main as cli
from reshard.errors import ReshardError
from reshard.ir import maps_to_document
from reshard.layouts import (
    bigcode_mqa,
    codegen_qkv,
    conv2d_weight,
    padded_vocab,
    prescaled_bias,
    shared_qk_o_proj,
    sub_params,
)
from reshard.layouts.recognize import recognize
from reshard.plan.retarget import plan_topology
from reshard.present.inspected import open_source
from reshard.storage.safe_load import load
from tests.support.dsconv import FIXTURES
from tests.support.irgen import padded_vocab_map, replicated_map, segmented_map

# -- helpers ----------------------------------------------------------------------------------------


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(capsys, *argv: str) -> dict:
    rc, out, err = _run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


def _doc(tmp_path: Path, maps: dict, name: str = "maps.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(maps_to_document(maps)))
    return p


def _row(text: str, name: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return line.split()


def _model_shard_shapes(fixture: str) -> list[dict[str, tuple[int, ...]]]:
    """Per TP rank, ``{name: shard shape}`` as DeepSpeed recorded it in the model states."""
    tag = FIXTURES / fixture / (FIXTURES / fixture / "latest").read_text().strip()
    out = []
    for t in range(len(list(tag.glob("mp_rank_*_model_states.pt")))):
        groups = load(tag / f"mp_rank_{t:02d}_model_states.pt")["param_shapes"]
        groups = groups if isinstance(groups, list) else [groups]
        out.append({n: tuple(s) for g in groups for n, s in g.items()})
    return out


def _llama_full_shapes() -> dict[str, tuple[int, ...]]:
    """F of every llama fixture parameter, from its model config."""
    cfg = json.loads((FIXTURES / "llama_tp2" / "fixture.json").read_text())["model_config"]
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    return shapes


# -- inspect: seed-style layouts --------------------------------------------------------------------


def test_inspect_bigcode_mqa_tp4(tmp_path, capsys):
    # 48 x 8 fused c_attn: 32 query rows split over 4 ranks, 16 kv rows on every rank
    m = segmented_map((48, 8), 0, [(32, False), (16, True)], 4)
    path = _doc(tmp_path, {"c_attn.weight": m})
    doc = _json(capsys, "inspect", path)
    (p,) = doc["params"]
    per_rank = (32 // 4 + 16) * 8 * 4
    assert p["pieces_per_rank"] == {str(r): 2 for r in range(4)}
    assert p["bytes_per_rank"] == {str(r): per_rank for r in range(4)}
    assert p["replicated_elements"] == 16 * 8
    assert math.isclose(p["replicated_fraction"], 16 / 48)
    assert p["logical_shape"] == p["valid_shape"] == [48, 8]
    assert doc["totals"]["bytes_per_rank"] == {str(r): per_rank for r in range(4)}
    rc, text, _ = _run(capsys, "inspect", path)
    assert rc == 0
    assert _row(text, "c_attn.weight")[1:] == ["[48,", "8]", "=F", "2×4", "33.3%", "1", f"{per_rank}×4"]


def _yuan_expectations(heads: int, tp: int, head_dim: int, rows: int):
    """Pieces per rank and replicated heads of Yuan's o_proj, from the head rule: with
    ``per = heads / tp``, rank r takes ``ceil(per / 2)`` heads from ``floor(r * per / 2)`` in each half."""
    per = heads // tp
    held = {r: [h + half for half in (0, heads // 2) for h in range(r * per // 2, r * per // 2 + (per + 1) // 2)]
            for r in range(tp)}
    holders = {h: frozenset(r for r in held if h in held[r]) for h in range(heads)}
    pieces = {}
    for r, hs in held.items():
        runs = 1 + sum(1 for a, b in zip(hs, hs[1:]) if b != a + 1 or holders[a] != holders[b])
        pieces[r] = runs
    shared = sum(1 for h in holders if len(holders[h]) > 1)
    bytes_ = {r: len(hs) * head_dim * rows * 4 for r, hs in held.items()}
    return pieces, Fraction(shared, heads), bytes_


@pytest.mark.parametrize("heads,tp", [(8, 2), (6, 2), (12, 4)])
def test_inspect_yuan_o_proj(tmp_path, capsys, heads, tp):
    hd, rows = 4, 8
    m = shared_qk_o_proj((rows, heads * hd), tp, num_heads=heads)
    doc = _json(capsys, "inspect", _doc(tmp_path, {"o_proj.weight": m}))
    (p,) = doc["params"]
    pieces, repl, bytes_ = _yuan_expectations(heads, tp, hd, rows)
    assert p["pieces_per_rank"] == {str(r): n for r, n in pieces.items()}
    assert p["bytes_per_rank"] == {str(r): n for r, n in bytes_.items()}
    assert Fraction(p["replicated_elements"], rows * heads * hd) == repl


def test_inspect_padded_vocab_and_scaled_bias(tmp_path, capsys):
    vocab, hidden, tp = 45, 8, 4
    rows = -(-vocab // tp) * tp
    path = _doc(tmp_path, {"embed.weight": padded_vocab_map(vocab, hidden, tp),
                           "o_proj.bias": replicated_map((8,), tp, scale=0.25)})
    doc = _json(capsys, "inspect", path)
    emb, bias = doc["params"]
    assert emb["logical_shape"] == [rows, hidden] and emb["valid_shape"] == [vocab, hidden]
    assert emb["pieces_per_rank"] == {str(r): 1 for r in range(tp)}
    assert emb["bytes_per_rank"] == {str(r): rows // tp * hidden * 4 for r in range(tp)}
    assert emb["replicated_fraction"] == 0
    assert bias["replicated_fraction"] == 1 and bias["scales"] == [0.25]
    assert doc["totals"]["elements"] == rows * hidden + 8
    assert doc["totals"]["valid_elements"] == vocab * hidden + 8
    text = _run(capsys, "inspect", path, "--element-size", "2")[1]
    assert _row(text, "embed.weight")[3:5] == ["[45,", "8]"]
    assert _row(text, "embed.weight")[-1] == f"{rows // tp * hidden * 2}×4"
    assert _row(text, "o_proj.bias")[-4:] == ["1×4", "100%", "0.25", f"{8 * 2}×4"]


# -- inspect: DeepSpeed and universal checkpoints ------------------------------------------------------


@pytest.mark.parametrize("fixture", ["llama_tp2", "llama_tp2_dp2", "qwen2_tp2"])
def test_inspect_deepspeed_tp_maps(capsys, fixture):
    shards = _model_shard_shapes(fixture)
    doc = _json(capsys, "inspect", FIXTURES / fixture)
    tp = len(shards)
    assert doc["kind"] == "deepspeed" and doc["view"] == "tp" and doc["topology"]["tp"] == tp
    assert [p["name"] for p in doc["params"]] == list(shards[0])
    want = {str(t): 4 * sum(math.prod(s) for s in shards[t].values()) for t in range(tp)}
    assert doc["totals"]["bytes_per_rank"] == want
    if fixture.startswith("llama"):
        full = _llama_full_shapes()
        repl = sum(math.prod(full[n]) for n in full if all(shards[t][n] == full[n] for t in range(tp)))
        assert doc["totals"]["replicated_elements"] == repl
        assert doc["totals"]["elements"] == sum(math.prod(s) for s in full.values())
        assert all(p["pieces_per_rank"] == {"0": 1, "1": 1} for p in doc["params"])


def test_inspect_deepspeed_text(capsys):
    rc, text, _ = _run(capsys, "inspect", FIXTURES / "llama_tp2", "--param", "layers.0.mlp.down_proj.weight")
    assert rc == 0
    assert "DeepSpeed TP=2 DP=1 ZeRO-1" in text
    assert _row(text, "model.layers.0.mlp.down_proj.weight")[1:] == ["[32,", "88]", "=F", "1×2", "0%", "1",
                                                                     f"{32 * 44 * 4}×2"]
    assert "ZeRO-1 over DP=1" in text


def test_inspect_bigcode_fixture_empty_query_shard(capsys):
    # DeepSpeed gave TP rank 0 all 32 query rows and rank 1 none; both hold the 16 kv rows
    shards = _model_shard_shapes("gpt_bigcode_tp2")
    name = "transformer.h.0.attn.c_attn.weight"
    doc = _json(capsys, "inspect", FIXTURES / "gpt_bigcode_tp2", "--param", name)
    (p,) = doc["params"]
    kv = 48 - 32
    assert p["bytes_per_rank"] == {str(t): math.prod(shards[t][name]) * 4 for t in range(2)}
    assert p["pieces_per_rank"] == {str(t): 1 + (shards[t][name][0] > kv) for t in range(2)}
    assert math.isclose(p["replicated_fraction"], kv / 48)


def test_inspect_zero_split_and_composed_view(capsys):
    shards = _model_shard_shapes("llama_tp2_dp2")
    doc = _json(capsys, "inspect", FIXTURES / "llama_tp2_dp2")
    assert doc["zero"]["dp"] == 2 and doc["zero"]["stage"] == 1
    for t in range(2):
        assert sum(doc["zero"]["elements"][str(t)].values()) == sum(math.prod(s) for s in shards[t].values())
    comp = _json(capsys, "inspect", FIXTURES / "llama_tp2_dp2", "--composed")
    assert comp["view"] == "composed" and comp["ranks"] == [0, 1, 2, 3]
    per = comp["totals"]["bytes_per_rank"]
    for t in range(2):  # global rank = dp * 2 + tp: a TP shard's bytes spread over its DP ranks
        assert per[str(t)] + per[str(2 + t)] == doc["totals"]["bytes_per_rank"][str(t)]
    assert comp["totals"]["replicated_elements"] == doc["totals"]["replicated_elements"]
    assert _run(capsys, "inspect", FIXTURES / "llama_tp2", "--composed", "--param", "norm.weight")[0] == 0


def test_inspect_universal_checkpoint(tmp_path, capsys):
    from reshard.jobs.convert import convert

    convert(FIXTURES / "llama_tp2", tmp_path)
    full = _llama_full_shapes()
    for target in (tmp_path, tmp_path / "global_step3"):
        doc = _json(capsys, "inspect", target)
        assert doc["kind"] == "universal" and doc["ranks"] == [0]
        assert {p["name"] for p in doc["params"]} == set(full)
        for p in doc["params"]:
            assert p["pieces_per_rank"] == {"0": 1} and p["replicated_fraction"] == 0
            assert p["bytes_per_rank"] == {"0": 4 * math.prod(full[p["name"]])}


def test_inspect_param_selection_and_errors(tmp_path, capsys):
    path = _doc(tmp_path, {"a.norm.weight": replicated_map((4,), 2), "a.input_norm.weight": replicated_map((4,), 2)})
    assert [p["name"] for p in _json(capsys, "inspect", path, "--param", "norm.weight")["params"]] == ["a.norm.weight"]
    rc, _, err = _run(capsys, "inspect", path, "--param", "norm")
    assert rc == 2 and "matches 2 parameters" in err
    rc, _, err = _run(capsys, "inspect", path, "--param", "nope")
    assert rc == 2 and "no parameter 'nope'" in err
    rc, _, err = _run(capsys, "inspect", tmp_path / "missing.json")
    assert rc == 2 and "no such file" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"logical_shape": [4], "ranks": {"0": {"shard_shape": [2], "pieces": '
                   '[{"shape": [2], "source": [0, [1]], "dest": [0, [1]], "locations": [0]}]}}}')
    rc, _, err = _run(capsys, "inspect", bad)
    assert rc == 2 and "bad.json" in err and "P1" in err
    bad.write_text('{"logical_shape": [4], "ranks": {"0": {"shard_shape": [4], "pieces": [{"shape": [4.0]}]}}}')
    rc, _, err = _run(capsys, "inspect", bad)
    assert rc == 2 and "ranks.0.pieces.0" in err and "bad.json" in err


# -- pictures ------------------------------------------------------------------------------------------


def _png(path: Path):
    from matplotlib.image import imread

    img = imread(path)
    return img[..., :3]


def _pixel(shape2d: tuple[int, int], row: float, col: float, rect) -> tuple[int, int]:
    """Image (y, x) of the point (row, col) of the drawn grid of F."""
    from reshard.present.viz import MAP_PNG_SIZE

    w, h = MAP_PNG_SIZE
    rows, cols = shape2d
    x = (rect[0] + rect[2] * col / cols) * w
    y_up = (rect[1] + rect[3] * (1 - row / rows)) * h
    return int(h - y_up), int(x)


def _colours_in(img, shape2d, rows: tuple[float, float], cols: tuple[float, float], colours, rect) -> set[int]:
    """Ranks whose colour appears at a grid of sample points of a region of F."""
    found = set()
    for i in range(12):
        for j in range(12):
            r = rows[0] + (rows[1] - rows[0]) * (i + 0.5) / 12
            c = cols[0] + (cols[1] - cols[0]) * (j + 0.5) / 12
            y, x = _pixel(shape2d, r, c, rect)
            px = img[y, x]
            for rank, rgba in colours.items():
                if max(abs(float(px[k]) - rgba[k]) for k in range(3)) < 0.02:
                    found.add(rank)
    return found


def test_png_bigcode_replicated_block_carries_every_holder(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from reshard.present.viz import AXES_RECT, MAP_PNG_SIZE, rank_colors

    m = bigcode_mqa((48, 8), 4, n_embd=32)
    out = tmp_path / "bigcode.png"
    rc, text, err = _run(capsys, "inspect", _doc(tmp_path, {"c_attn.weight": m}), "--png", out)
    assert rc == 0, err
    assert f"wrote {out}" in text
    img = _png(out)
    assert img.shape[:2] == (MAP_PNG_SIZE[1], MAP_PNG_SIZE[0])
    colours = rank_colors(range(4))
    kv = _colours_in(img, (48, 8), (32.5, 47.5), (0.3, 7.7), colours, AXES_RECT)
    assert kv == {0, 1, 2, 3}  # the replicated kv rows show every holder's colour
    for r in range(4):  # each query block shows only its own rank
        assert _colours_in(img, (48, 8), (8 * r + 0.5, 8 * r + 3), (0.3, 7.7), colours, AXES_RECT) == {r}


def test_png_padding_greyed_and_1d(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from reshard.present.viz import AXES_RECT, AXES_RECT_1D, MAP_PNG_SIZE, rank_colors

    path = _doc(tmp_path, {"embed.weight": padded_vocab((45, 8), 4), "bias": prescaled_bias((8,), 2)})
    out = tmp_path / "vocab.png"
    assert _run(capsys, "inspect", path, "--png", out)[0] == 0  # the first parameter
    img = _png(out)
    assert img.shape[:2] == (MAP_PNG_SIZE[1], MAP_PNG_SIZE[0])
    y, x = _pixel((48, 8), 46.5, 2.1, AXES_RECT)
    px = img[y - 2 : y + 3, x - 2 : x + 3].reshape(-1, 3)
    spread = (px.max(axis=1) - px.min(axis=1)).min()
    assert spread < 0.08, "padding rows are grey"
    assert _colours_in(img, (48, 8), (0.5, 10), (0.3, 7.7), rank_colors(range(4)), AXES_RECT) == {0}
    out1 = tmp_path / "bias.png"
    assert _run(capsys, "inspect", path, "--param", "bias", "--png", out1)[0] == 0
    img1 = _png(out1)
    assert img1.shape[:2] == (MAP_PNG_SIZE[1], MAP_PNG_SIZE[0])
    assert _colours_in(img1, (1, 8), (0.1, 0.9), (0.2, 7.8), rank_colors(range(2)), AXES_RECT_1D) == {0, 1}


def test_png_deepspeed_composed_and_big_f(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import time

    from reshard.present.viz import MAP_PNG_SIZE, draw_map

    out = tmp_path / "zero.png"
    rc, _, err = _run(capsys, "inspect", FIXTURES / "llama_tp2_dp2", "--composed", "--param", "layers.0.mlp.down_proj.weight",
                      "--png", out)
    assert rc == 0, err
    assert _png(out).shape[:2] == (MAP_PNG_SIZE[1], MAP_PNG_SIZE[0])
    big = padded_vocab((151_936, 8192), 64, divisible_by=128)  # 1.2 G elements, drawn as 64 rectangles
    t = time.perf_counter()
    draw_map(big, tmp_path / "big.png", name="lm_head", topology="TP=64")
    assert time.perf_counter() - t < 5
    conv = conv2d_weight((16, 12, 3, 3), 4, shard_by_oc=False)  # 4-D: flattened with a note
    draw_map(conv, tmp_path / "conv.png", name="conv", topology="TP=4")
    assert _png(tmp_path / "conv.png").shape[:2] == (MAP_PNG_SIZE[1], MAP_PNG_SIZE[0])


def test_png_without_matplotlib_says_how_to_install(tmp_path, capsys, monkeypatch):
    path = _doc(tmp_path, {"w": replicated_map((4, 4), 2)})
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for argv in (["inspect", path, "--png", tmp_path / "a.png"],
                 ["plan", FIXTURES / "llama_tp2", "--tp", "4", "--png", tmp_path / "b.png"],
                 ["plan", path, "--to", path, "--png", tmp_path / "c.png"]):
        rc, out, err = _run(capsys, *argv)
        assert rc == 2
        assert "pip install 'reshard[plot]'" in err and err.count("\n") == 1
        assert out == ""
    assert not list(tmp_path.glob("*.png"))
    assert _run(capsys, "inspect", path)[0] == 0  # everything else still works


# -- plan to a topology ----------------------------------------------------------------------------


def test_plan_llama_tp2_to_tp4_bytes_from_shapes(capsys):
    full = _llama_full_shapes()
    shards = _model_shard_shapes("llama_tp2")
    repl = sum(math.prod(full[n]) for n in full if shards[0][n] == full[n])
    split = sum(math.prod(s) for s in full.values()) - repl
    doc = _json(capsys, "plan", FIXTURES / "llama_tp2", "--tp", "4", "--element-size", "2")
    # TP=2 -> 4: every target element is written once; target rank 0 (and only it) finds its split
    # block locally, target ranks 0 and 1 find replicated parameters locally.
    assert doc["local_bytes"] == 2 * (split // 4 + 2 * repl)
    assert doc["remote_bytes"] == 2 * (3 * split // 4 + 2 * repl)
    assert doc["source"]["tp"] == 2 and doc["target"] == {"tp": 4, "dp": 1}
    assert sum(doc["sent"].values()) == sum(doc["received"].values()) == doc["remote_bytes"]
    mat = doc["bytes_matrix"]
    assert mat["source_ranks"] == [0, 1] and mat["target_ranks"] == [0, 1, 2, 3]
    assert sum(map(sum, mat["bytes"])) == doc["local_bytes"] + doc["remote_bytes"]
    b = doc["busiest_link"]
    assert b["bytes"] == max(mat["bytes"][s][t] for s in range(2) for t in range(4) if s != t)
    fams = {v["family"] for v in doc["families"].values()}
    assert fams == {"split", "replicated"}
    rc, text, _ = _run(capsys, "plan", FIXTURES / "llama_tp2", "--tp", "4")
    assert rc == 0
    # the text form counts fp32 bytes by default, as inspect does: twice the 2-byte figures
    assert f"bytes local {2 * doc['local_bytes']}, remote {2 * doc['remote_bytes']} (element size 4)" in text
    assert f"busiest link: {b['src']} -> {b['dst']}, {2 * b['bytes']} bytes" in text


def test_plan_dp_replicas(capsys):
    shards = _model_shard_shapes("llama_tp2")
    per_rank = [4 * sum(math.prod(s) for s in shards[t].values()) for t in range(2)]  # fp32 bytes
    same = _json(capsys, "plan", FIXTURES / "llama_tp2_dp2", "--tp", "2")
    assert same["target"] == {"tp": 2, "dp": 2} and same["remote_bytes"] == 0
    assert same["local_bytes"] == 2 * sum(per_rank)
    wider = _json(capsys, "plan", FIXTURES / "llama_tp2", "--tp", "2", "--dp", "2")
    assert wider["local_bytes"] == wider["remote_bytes"] == sum(per_rank)
    assert wider["received"] == {"2": per_rank[0], "3": per_rank[1]}


def _families(tp: int):
    fams = {
        "bigcode": (bigcode_mqa((48, 8), 4, n_embd=32), lambda t: bigcode_mqa((48, 8), t, n_embd=32)),
        "yuan": (shared_qk_o_proj((8, 36), 2, num_heads=6), lambda t: shared_qk_o_proj((8, 36), t, num_heads=6)),
        "qkv": (sub_params((24, 4), [8, 8, 8], [[4, 4]] * 3),
                lambda t: sub_params((24, 4), [8, 8, 8], [[8 // t] * t] * 3)),
        "bias": (prescaled_bias((8,), 2), lambda t: prescaled_bias((8,), t)),
        "vocab": (padded_vocab((45, 8), 4), lambda t: padded_vocab((45, 8), t)),
    }
    if tp == 4:  # 6 shared-QK heads have no layout at TP=4
        del fams["yuan"]
    return fams


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_plan_rebuilds_each_family_and_moves_exactly(tmp_path, tp):
    fams = _families(tp)
    src = open_source(_doc(tmp_path, {k: m for k, (m, _) in fams.items()}))
    tplan = plan_topology(src.maps, tp, vocab_divisible_by=1)  # re-pad the vocabulary as padded_vocab does
    for name, (m, at) in fams.items():
        assert tplan.target_maps[name] == (m if len(m.ranks) == tp else at(tp)), name
        full = torch.randn(m.valid_shape, dtype=torch.float64)
        shards = {r: m.extract(full, r) for r in m.ranks}
        out = apply_plan(tplan.plan.params[name], shards)
        tgt = tplan.target_maps[name]
        for r in tgt.ranks:
            assert torch.equal(out[r], tgt.extract(full, r)), (name, r)


def test_plan_family_names_and_refusals(tmp_path, capsys):
    assert recognize(bigcode_mqa((48, 8), 4, n_embd=32)).name == "split+replicated"
    assert recognize(shared_qk_o_proj((8, 36), 2, num_heads=6)).name == "shared-qk"
    assert recognize(shared_qk_o_proj((8, 32), 2, num_heads=8)).name == "sub-params"
    assert recognize(segmented_map((10, 3), 1, [(3, False)], 3)).name == "split"
    vocab = _doc(tmp_path, {"embed": padded_vocab((45, 8), 4)}, "vocab.json")
    rc, _, err = _run(capsys, "plan", vocab, "--tp", "5")
    assert rc == 2 and "--vocab-divisible-by" in err
    assert _json(capsys, "plan", vocab, "--tp", "5", "--vocab-divisible-by", "2")["target"]["tp"] == 5
    rc, _, err = _run(capsys, "plan", _doc(tmp_path, {"qkv": codegen_qkv((96, 4), 4, num_kv_heads=16)}), "--tp", "2")
    assert rc == 2 and "'qkv'" in err and "not recognised" in err
    rc, _, err = _run(capsys, "plan", FIXTURES / "llama_zero1_dp2", "--tp", "2")
    assert rc == 2 and "one rank" in err
    rc, _, err = _run(capsys, "plan", _doc(tmp_path, {"b": prescaled_bias((8,), 2)}, "b.json"), "--tp", "3")
    assert rc == 2 and "power of two" in err
    for both in (["--to", vocab, "--tp", "2"], []):  # the two modes are explicit: exactly one of them
        with pytest.raises(SystemExit) as exit_:
            _run(capsys, "plan", vocab, *both)
        assert exit_.value.code == 2
        assert "--to" in capsys.readouterr().err


def test_plan_two_documents_form_still_works_and_draws(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from reshard.present.viz import PLAN_PNG_SIZE

    src = _doc(tmp_path, {"w": bigcode_mqa((48, 8), 4, n_embd=32)}, "src.json")
    tgt = _doc(tmp_path, {"w": bigcode_mqa((48, 8), 2, n_embd=32)}, "tgt.json")
    rc, out, _ = _run(capsys, "plan", src, "--to", tgt, "--json")
    assert rc == 0 and set(json.loads(out)["params"]) == {"w"}
    png = tmp_path / "heat.png"
    rc, out, _ = _run(capsys, "plan", src, "--to", tgt, "--png", png)
    assert rc == 0 and "1 parameter(s)" in out
    assert _png(png).shape[:2] == (PLAN_PNG_SIZE[1], PLAN_PNG_SIZE[0])
    png2 = tmp_path / "heat2.png"
    assert _run(capsys, "plan", FIXTURES / "gpt_bigcode_tp2", "--tp", "4", "--png", png2)[0] == 0
    assert _png(png2).shape[:2] == (PLAN_PNG_SIZE[1], PLAN_PNG_SIZE[0])


def test_plan_an_hf_folder_to_tp_through_transformers_tp_plan(capsys):
    """``reshard plan HF_FOLDER --tp T``: the targets are transformers' own TP plan for the
    architecture (``formats.hf.tp_plan``, handed to ``plan/retarget``), and the plan moves every
    tensor of the folder into them exactly."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from reshard.formats.hf.tp_plan import tp_plan
    from reshard.present.inspected import hf_plan_targets

    folder = FIXTURES.parent / "hf" / "pretrained_llama"
    doc = _json(capsys, "plan", folder, "--tp", "2")
    assert doc["target"] == {"tp": 2, "dp": 1} and doc["source"]["tp"] == 1
    texts = {v["text"] for v in doc["families"].values()}
    assert {"transformers' TP plan: colwise", "transformers' TP plan: rowwise",
            "transformers' TP plan: embedding_rowwise"} <= texts
    src = open_source(folder)
    tplan = plan_topology(src.maps, 2, given=hf_plan_targets(src, 2))
    shapes = {n: tuple(m.logical_shape) for n, m in src.maps.items()}
    assert tplan.target_maps == tp_plan(folder, shapes).maps(shapes, 2)
    full = load_file(folder / "model.safetensors")
    for name, tgt in tplan.target_maps.items():
        out = apply_plan(tplan.plan.params[name], {0: full[name]})
        for r in tgt.ranks:
            assert torch.equal(out[r], tgt.extract(full[name], r)), (name, r)
    with pytest.raises(ReshardError, match=r"'w'.*given target map is of F \[4, 2\]"):
        plan_topology({"w": replicated_map((2, 4), 1)}, 2, given={"w": (replicated_map((4, 2), 2), "mine")})


# -- inspect: the header says what the checkpoint stores ----------------------------------------------

MEGATRON = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"


def _header(text: str) -> list[str]:
    return text.split("\n\n", 1)[0].splitlines()[1:]


def _fixture_world(name: str) -> int:
    return json.loads((MEGATRON / name / "fixture.json").read_text())["topology"]["world"]


def _storage_ranks(name: str) -> set[int]:
    """The R of every ``__R_N.distcp`` file: the ranks that wrote a torch_dist checkpoint's chunks."""
    return {int(p.name[2:].split("_")[0]) for p in (MEGATRON / name).glob("iter_*/__*_*.distcp")}


def test_inspect_megatron_weights_only_bf16_says_so(capsys):
    """--no-save-optim, --bf16, TP=2: no optimizer state, 2-byte elements, and the columns are the
    2 storage ranks of a world of 2 (fc1's gate and up chunks, two per TP rank, summed on theirs)."""
    name = "torch_dist_tp2_qwen2_vllm"
    rc, text, _ = _run(capsys, "inspect", MEGATRON / name)
    assert rc == 0
    first = text.splitlines()[0]
    assert "no optimizer state" in first and "optimizer adam" not in first
    assert _header(text) == [
        "storage ranks 0-1 (the rank that wrote each shard's file: each parameter's shards summed on it); "
        "saved by 2 rank(s)",
        "element size 2 bytes (bfloat16)",
        "stored: weight bfloat16; no optimizer state (the table shows weight)",
        "lists per storage rank are in storage rank order, a×n = a on each of n storage ranks"]
    assert _fixture_world(name) == 2 and _storage_ranks(name) == {0, 1}
    fc1 = _row(text, "decoder.layers.mlp.linear_fc1.weight")
    assert fc1[-5:] == ["=F", "2×2", "0%", "1", f"{128 * 256 // 2 * 2}×2"]  # [1, 128, 256] bf16, half per TP rank
    doc = _json(capsys, "inspect", MEGATRON / name)
    assert doc["unit"] == "storage rank" and doc["world"] == 2 and doc["element_size"] == 2 and doc["ranks"] == [0, 1]
    assert doc["states"] == {"weight": ["bfloat16"]}
    assert all(p["dtype"] == "bfloat16" for p in doc["params"])
    assert doc["totals"]["bytes_per_rank"] and sum(doc["totals"]["bytes_per_rank"].values()) == 2 * doc["totals"]["elements"]


@pytest.mark.parametrize("name, optimizer, held", [
    ("torch_dist_dp2_distopt_bf16", "optimizer dp_reshardable",
     "stored: weight bfloat16, fp32 masters float32, exp_avg float32, exp_avg_sq float32 (the table shows weight)"),
    ("torch_dist_tp2_dp2_distopt", "optimizer dp_reshardable",
     "stored: weight float32, fp32 masters float32, exp_avg float32, exp_avg_sq float32 (the table shows weight)"),
    ("legacy_tp2_pp2", "optimizer adam",
     "stored: weight float32, exp_avg float32, exp_avg_sq float32 (the table shows weight)"),
    ("torch_dist_moe_ep2", "optimizer adam",
     "stored: weight float32, exp_avg float32, exp_avg_sq float32 (the table shows weight)"),
])
def test_inspect_megatron_headers(capsys, name, optimizer, held):
    text = _run(capsys, "inspect", MEGATRON / name)[1]
    assert f", {optimizer}, " in text.splitlines()[0]
    head = _header(text)
    world = _fixture_world(name)
    # fully parallel save: every rank of the world writes some chunks; legacy: each file's saving rank (args.rank)
    assert head[0].startswith(f"storage ranks 0-{world - 1} (") and head[0].endswith(f"; saved by {world} rank(s)")
    if not name.startswith("legacy"):
        assert _storage_ranks(name) == set(range(world))
    size = 2 if "bf16" in name else 4
    assert head[1] == f"element size {size} bytes ({'bfloat16' if size == 2 else 'float32'})"
    assert head[2] == held
    doc = _json(capsys, "inspect", MEGATRON / name)
    tot = doc["totals"]  # F once, its replicated elements (legacy norms, on both TP ranks' labels) twice
    assert sum(tot["bytes_per_rank"].values()) == size * (tot["elements"] + tot["replicated_elements"])
    assert _run(capsys, "inspect", MEGATRON / name, "--element-size", "8")[1].splitlines()[2] == \
        "element size 8 bytes (--element-size)"


def test_inspect_other_formats_headers(capsys):
    ds = _header(_run(capsys, "inspect", FIXTURES / "llama_tp2_dp2")[1])
    assert ds[:2] == ["ranks 0-1; saved by 4 rank(s)", "element size 4 bytes (float32)"]
    hf = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
    bf16 = _header(_run(capsys, "inspect", hf / "pretrained_llama_bf16")[1])
    assert bf16[:3] == ["ranks 0", "element size 2 bytes (bfloat16)",
                        "stored: weight bfloat16; no optimizer state (the table shows weight)"]
    dcp = _header(_run(capsys, "inspect", Path(__file__).resolve().parents[1] / "fixtures" / "dcp" / "llama_fsdp2_ws2")[1])
    assert dcp[:3] == ["storage ranks 0-1 (the R of __R_N.distcp)", "element size 4 bytes (float32)",
                       "stored: weight float32, exp_avg float32, exp_avg_sq float32"]


def test_inspect_deepspeed_bf16_weights_and_the_composed_fp32_split(capsys):
    """bf16 module weights at 2 bytes in the TP view; the composed view is the ZeRO split of the
    fp32 masters, at 4 bytes, over the 2 saving ranks."""
    fixture = FIXTURES / "llama_zero1_dp2_bf16"
    held = "fp32 masters float32, exp_avg float32, exp_avg_sq float32"
    tp = _header(_run(capsys, "inspect", fixture)[1])
    assert tp[:3] == ["ranks 0; saved by 2 rank(s)", "element size 2 bytes (bfloat16)",
                      f"stored: weight bfloat16, {held} (the table shows weight)"]
    comp = _header(_run(capsys, "inspect", fixture, "--composed")[1])
    assert comp[:3] == ["ranks 0-1; saved by 2 rank(s)", "element size 4 bytes (float32)",
                        f"stored: weight bfloat16, {held} (the table shows fp32 masters)"]
    doc = _json(capsys, "inspect", fixture, "--composed")
    assert sum(doc["totals"]["bytes_per_rank"].values()) == 4 * doc["totals"]["elements"]


def test_inspect_map_document_says_its_element_size_is_assumed(tmp_path, capsys):
    path = _doc(tmp_path, {"w": replicated_map((4,), 2)})
    assert _header(_run(capsys, "inspect", path)[1])[:2] == ["ranks 0-1", "element size 4 bytes (assumed float32: no dtype recorded)"]
