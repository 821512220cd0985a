"""``WeightSync(..., quantize=Fp8Block(...))``: FSDP2 trainer shards pushed into an FP8 engine.

Real gloo processes (``tests/support/sync_fp8_job.py``): 2 FSDP2 trainer ranks whose dim-0 shard
boundary cuts a block, 2 engine TP ranks (column- and row-parallel, shapes not multiples of the
block). Every FP8 payload and ``weight_scale_inv`` an engine rank receives equals, bit for bit, its
slice of ``fp8_block_encode`` of the full bf16 weight -- and of transformers' ``Fp8Quantize`` of it
(zero-padded to whole blocks and cropped where the shape is not a multiple of the block) -- and the
wire carries only the covers (the whole blocks each engine rank's shard touches), not whole tensors.
The in-process tests cover the pure parts (the cover and scale placements, fused parts, refusals).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard import Fp8Block
from reshard.errors import MapError
from reshard.execute.sync_program import simulate
from reshard.execute.sync_quant import compile_rank, quantize_rank, quantized_targets
from reshard.ir.apply import extract
from reshard.ir.blocks import coarsen, cover
from reshard.ir.codec import SCALE_FORMATS, fp8_block_encode
from reshard.layouts.inference import (
    column_parallel,
    merged_column_parts,
    placed,
    row_parallel,
    vocab_parallel_padded,
)
from reshard.layouts.tp import replicated, split
from tests.support import sync_fp8_job as J
from tests.support.spawn import run_ranks

SMALL = {"trainer": [0, 1], "engine": [2, 3], "hidden": 48, "inter": 44, "vocab": 50, "block": [16, 16], "seed": 3}
# 3 trainer ranks (FSDP2 chunks 234/234/232 of 700 rows), DeepSeek's 128 x 128 blocks
LARGE = {"trainer": [0, 1, 2], "engine": [3, 4], "hidden": 384, "inter": 700, "vocab": 300, "block": [128, 128],
         "seed": 4}
TIMEOUT_S = 180


def _job(tmp_path_factory, cfg: dict) -> dict:
    workdir = tmp_path_factory.mktemp("fp8sync")
    (workdir / "job.json").write_text(json.dumps(cfg))
    job = run_ranks(J.worker, len(cfg["trainer"]) + len(cfg["engine"]), workdir, TIMEOUT_S, "phase")
    crashed = job["records"].get("crashed", {})
    assert not crashed, f"ranks crashed: {crashed}"
    assert not job["hung"], f"ranks {job['hung']} hung"
    return {**job, "workdir": workdir, "cfg": cfg}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict:
    return _job(tmp_path_factory, SMALL)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """The bits, in an integer dtype of the element's size (so shapes are kept)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _transformers(x: torch.Tensor, block: tuple[int, int], fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``Fp8Quantize`` of ``x``, zero-padded to whole blocks and cropped (codec's rule)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    rows, cols = x.shape
    pr, pc = -(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1]
    padded = torch.nn.functional.pad(x.float(), (0, pc - cols, 0, pr - rows)).to(x.dtype)
    config = FineGrainedFP8Config(weight_block_size=list(block), scale_fmt={"float32": "float", "ue8m0": "ue8m0"}[fmt])
    out = Fp8Quantize(SimpleNamespace(quantization_config=config)).convert({"m.weight": padded})
    assert out["m.weight"].dtype == torch.float8_e4m3fn
    return out["m.weight"][:rows, :cols], out["m.weight_scale_inv"]


def _check_phase(job: dict, tag: str, fmt: str, oracle: bool, engine: list[int] | None = None) -> dict[str, int]:
    """Every engine tensor of phase ``tag`` (engine ranks ``engine``, else the job's) against the
    full masters; the quantized names."""
    cfg, workdir = job["cfg"], job["workdir"]
    cfg = {**cfg, "engine": engine or cfg["engine"]}
    block = tuple(cfg["block"])
    full = torch.load(workdir / f"full-{tag}.pt", weights_only=True)
    tg = J.targets(cfg)
    quant = set(job["records"][tag][cfg["engine"][0]]["quantized"])
    for r in cfg["engine"]:
        got = torch.load(workdir / f"engine-{tag}-{r}.pt", weights_only=True)
        for n, m in tg.items():
            w = full[n].to(torch.bfloat16)
            if n not in quant:
                assert torch.equal(_u8(got[n]), _u8(extract(m, w, r))), f"rank {r}: {n} (bf16)"
                continue
            q, s = fp8_block_encode(w, block, fmt)
            assert got[n].dtype == torch.float8_e4m3fn and got[n + "_scale_inv"].dtype == SCALE_FORMATS[fmt]
            assert torch.equal(_u8(got[n]), extract(m, _u8(q), r)), f"rank {r}: {n} payload"
            assert torch.equal(_u8(got[n + "_scale_inv"]), extract(coarsen(m, block), _u8(s), r)), f"rank {r}: {n} scales"
            if oracle:  # transformers' own quantizer of the same bf16 weight
                tq, ts = _transformers(w, block, fmt)
                assert torch.equal(_u8(tq), _u8(q)) and torch.equal(_u8(ts), _u8(s)), n
    return {n: 1 for n in quant}


def _moved(cfg: dict, quant: set[str]) -> tuple[int, int, int]:
    """(bytes the engine ranks must receive: every target shard, a quantized one's cover, in bf16;
    of which the quantized weights'; what all-gathering the quantized weights to each engine rank moves)."""
    block = tuple(cfg["block"])
    total = ours = gather = 0
    for n, m in J.targets(cfg).items():
        shards = cover(m, block).shards if n in quant else m.shards
        got = sum(s.numel for s in shards.values()) * 2
        total += got
        if n in quant:
            ours += got
            gather += len(cfg["engine"]) * m.numel * 2
    return total, ours, gather


def test_fp8_push_equals_quantizing_the_full_masters(small):
    quant = _check_phase(small, "float32", "float32", oracle=True)
    assert set(quant) == {f"model.layers.0.{m}.weight" for m in ("self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")}


def test_ue8m0_push_with_a_predicate(small):
    quant = _check_phase(small, "ue8m0", "ue8m0", oracle=True)
    assert "lm_head.weight" in quant and "model.embed_tokens.weight" not in quant


def test_only_the_covers_travel(small):
    cfg = small["cfg"]
    recs = small["records"]["float32"]
    quant = set(recs[cfg["engine"][0]]["quantized"])
    total, ours, gather = _moved(cfg, quant)
    received = sum(recs[r]["stats"]["received_bytes"] for r in cfg["engine"])
    sent = sum(recs[r]["stats"]["sent_bytes"] for r in cfg["trainer"])
    assert received == sent == total, (received, sent, total)
    # 3 quantized weights: 7040 bytes of covers against 12416 all-gathered to each of 2 ranks
    assert ours < gather, (ours, gather)
    print(f"fp8 sync: quantized weights moved {ours} bytes vs {gather} all-gathered ({ours / gather:.2f})")


def test_a_nan_block_is_refused_on_every_rank_and_nothing_is_written(small):
    recs = small["records"]["nan"]
    msgs = {rec["message"] for rec in recs.values()}
    assert len(msgs) == 1, msgs
    (msg,) = msgs
    assert all(rec["is_quantized_error"] and rec["kept"] for rec in recs.values()), recs
    for r in (2, 3):  # row-parallel: the cut block is quantized on both engine ranks, both refuse it
        assert f"rank {r}: 'model.layers.0.mlp.down_proj.weight': element [47, 20] is nan: block [2, 1]" in msg, msg
    assert all(rec["after"]["raised"] is None for rec in recs.values()), recs


def test_colocated_engine_quantizes_local_and_received_covers(small):
    trainer = small["cfg"]["trainer"]
    _check_phase(small, "colocated", "float32", oracle=False, engine=trainer[:2])
    stats = {r: small["records"]["colocated"][r]["stats"] for r in trainer}
    assert all(s["local_bytes"] > 0 and s["received_bytes"] > 0 for s in stats.values()), stats


@pytest.mark.slow
def test_large_fp8_push_three_trainers_128_blocks(tmp_path_factory):
    job = _job(tmp_path_factory, LARGE)
    _check_phase(job, "float32", "float32", oracle=True)
    _check_phase(job, "ue8m0", "ue8m0", oracle=False)
    recs = job["records"]["float32"]
    total, ours, gather = _moved(LARGE, set(recs[LARGE["engine"][0]]["quantized"]))
    assert sum(recs[r]["stats"]["received_bytes"] for r in LARGE["engine"]) == total and ours < gather


# -- in process: the pure parts ---------------------------------------------------------------------


def test_fused_parts_on_block_rows_quantize_in_place():
    """``gate_up_proj`` at TP 2 (``[gate_r; up_r]``, 24 rows each: whole 8-row blocks) from one
    source rank: every part's payload and scales land at their places in the fused tensors."""
    block = (8, 16)
    shapes = {"g": (48, 40), "u": (48, 40)}
    src = {n: replicated(s, [0]) for n, s in shapes.items()}
    parts = dict(zip(("g", "u"), merged_column_parts([shapes["g"], shapes["u"]], 2, ranks=[1, 2])))
    fused = {n: p.named("gate_up.weight") for n, p in parts.items()}
    fp8 = Fp8Block(block, "float32", weights=lambda n, s: True)
    moved, quant = quantized_targets(fused, {"g", "u"}, fp8)
    full = {n: (torch.randn(s, generator=torch.Generator().manual_seed(k)) * (k + 1)).to(torch.bfloat16)
            for k, (n, s) in enumerate(shapes.items())}
    staged = {r: {t.into: torch.empty(t.shapes[r], dtype=torch.bfloat16) for t in moved.values()} for r in (1, 2)}
    simulate(src, moved, torch.bfloat16, {0: full}, staged)
    for r in (1, 2):
        into = {"gate_up.weight": torch.empty(48, 40, dtype=torch.float8_e4m3fn).view(-1),
                "gate_up.weight_scale_inv": torch.empty(6, 3).view(-1)}
        plans = [compile_rank(quant[n], r, block) for n in ("g", "u")]
        assert quantize_rank([p for p in plans if p], {n: staged[r][n + "#cover"].view(-1) for n in shapes}, into, fp8,
                             r) == []
        k = r - 1
        want = [fp8_block_encode(full[n], block) for n in ("g", "u")]
        assert torch.equal(_u8(into["gate_up.weight"]),
                           _u8(torch.cat([q[24 * k:24 * k + 24] for q, _ in want])).view(-1))
        assert torch.equal(into["gate_up.weight_scale_inv"], torch.cat([s[3 * k:3 * k + 3] for _, s in want]).view(-1))


def test_a_fused_part_off_a_block_row_or_a_padded_target_is_refused():
    shapes = [(44, 40), (44, 40)]
    parts = merged_column_parts(shapes, 2, ranks=[0, 1])
    fused = {n: p.named("gate_up.weight") for n, p in zip(("g", "u"), parts)}
    # rank 1's gate rows start at row 22 of the weight: vLLM's blocks of its fused tensor are not the weight's
    with pytest.raises(MapError, match=r"'g'.*rank 1: its part \(rows from 22 of the weight\).*block of 16 rows"):
        quantized_targets(fused, {"g", "u"}, Fp8Block((16, 16)))
    head = {"lm_head.weight": placed(vocab_parallel_padded((50, 48), 2, ranks=[0, 1]), "lm_head.weight")}
    with pytest.raises(MapError, match="'lm_head.weight'.*padded"):
        quantized_targets(head, {"lm_head.weight"}, Fp8Block((16, 16)))
    with pytest.raises(MapError, match="block"):
        Fp8Block((16,))
    with pytest.raises(MapError, match="scale"):
        Fp8Block((16, 16), "e4m3")


def test_cover_is_the_whole_blocks_a_shard_touches():
    m = column_parallel((44, 40), 2, ranks=[2, 3])
    c = cover(m, (16, 16))
    assert c.shards[2].shape == (32, 40) and c.shards[3].shape == (28, 40)  # block row 1 on both
    full = torch.arange(44 * 40).reshape(44, 40)
    assert torch.equal(extract(c, full, 2), full[:32]) and torch.equal(extract(c, full, 3), full[16:])
    r = row_parallel((40, 44), 2, ranks=[0, 1])
    assert torch.equal(extract(cover(r, (16, 16)), full.T.contiguous()[:40], 1), full.T.contiguous()[:40, 16:])


def test_default_choice_is_the_weights_transformers_quantized():
    """With the model's config, the sync quantizes exactly the weights transformers' FP8 quantizer
    quantized in the committed fixture (``fp8_qwen2``: its payloads beside a ``weight_scale_inv``)."""
    import struct

    from tests.support.paths import HF

    folder = HF / "fp8_qwen2"
    config = json.loads((folder / "config.json").read_text())
    raw = (folder / "model.safetensors").read_bytes()
    doc = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    header = {n: tuple(e["shape"]) for n, e in doc.items() if n != "__metadata__"}
    quantized = {n[:-len("_scale_inv")] for n in header if n.endswith("_scale_inv")}
    shapes = {n: s for n, s in header.items() if not n.endswith("_scale_inv")}
    assert quantized and Fp8Block((16, 32), hf_config=config).chosen(shapes) == quantized
    assert Fp8Block((16, 32)).chosen(shapes) == quantized  # by name: the same here


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_split_encodes_as_the_full_weight_sliced(data):
    """Any uneven row or column split, any block: a rank's cover, encoded and cropped, is its slice
    of the full weight's encoding (payload and scales), bit for bit -- the engine side of a push
    without the wire (the cover's values are what the sync moves)."""
    rows, cols = data.draw(st.integers(1, 70)), data.draw(st.integers(1, 70))
    block = (data.draw(st.integers(1, 24)), data.draw(st.integers(1, 24)))
    dim = data.draw(st.sampled_from([0, 1]))
    n = (rows, cols)[dim]
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=1, max_size=3)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    m = split((rows, cols), dim, sizes, ranks=list(range(len(sizes))))
    fmt = data.draw(st.sampled_from(sorted(SCALE_FORMATS)))
    fp8 = Fp8Block(block, fmt, weights=lambda n_, s: True)
    g = torch.Generator().manual_seed(rows * 100 + cols)
    full = (torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 10).to(torch.bfloat16)
    _, quant = quantized_targets({"w": placed(m, "w")}, {"w"}, fp8)
    q_full, s_full = fp8_block_encode(full, block, fmt)
    c = cover(m, block)
    for r in m.ranks:
        rq = compile_rank(quant["w"], r, block)
        if rq is None or not m.shards[r].numel:
            continue
        into = {"w": torch.empty(m.shards[r].shape, dtype=torch.float8_e4m3fn).view(-1),
                "w_scale_inv": torch.empty(quant["w"].scale.shapes[r], dtype=SCALE_FORMATS[fmt]).view(-1)}
        assert quantize_rank([rq], {"w": extract(c, full, r).reshape(-1)}, into, fp8, r) == []
        assert torch.equal(_u8(into["w"]), _u8(extract(m, _u8(q_full), r)).view(-1)), r
        assert torch.equal(_u8(into["w_scale_inv"]), _u8(extract(coarsen(m, block), _u8(s_full), r)).view(-1)), r
