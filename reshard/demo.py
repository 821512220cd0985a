"""``make demo``: derive the seed's hard layouts from plain partition functions, print their maps,
round-trip random bf16 data bit-exactly, and plan a move between two TP degrees."""

from __future__ import annotations

import torch

from . import ParamMap
from .derive import derive
from .planner import plan


def gpt_bigcode(tp: int):
    """MQA fused QKV: query rows split over ranks, the shared kv rows held whole by every rank."""
    def fn(full: torch.Tensor, rank: int) -> torch.Tensor:
        q, kv = full[:32], full[32:]
        return torch.cat([q.chunk(tp)[rank], kv])
    return fn


def yuan_value(full: torch.Tensor, rank: int) -> torch.Tensor:
    """Shared-QK value rows: a rank takes head groups r and r+2 (two separate runs)."""
    blocks = full.chunk(4, dim=0)
    return torch.cat([blocks[rank], blocks[rank + 2]])


def yuan_o_proj(full: torch.Tensor, rank: int) -> torch.Tensor:
    """The matching o_proj columns: strided column blocks."""
    blocks = full.chunk(4, dim=1)
    return torch.cat([blocks[rank], blocks[rank + 2]], dim=1)


def divided_bias(tp: int):
    """A row-parallel layer's bias, replicated and pre-divided by the world size."""
    return lambda full, rank: full / tp


def show(name: str, m: ParamMap) -> None:
    print(f"\n{name}: F {list(m.logical_shape)}, {len(m.ranks)} ranks, {m.num_pieces} pieces")
    for rank, shard in m.shards.items():
        print(f"  rank {rank} shard {list(shard.shape)}")
        for p in shard.pieces:
            print(f"    {p.describe()}")


def round_trip(m: ParamMap) -> bool:
    full = torch.randn(m.logical_shape, dtype=torch.bfloat16)
    shards = {r: m.extract(full, r) for r in m.ranks}
    return torch.equal(m.rebuild(shards).view(torch.int16), full.view(torch.int16))


def convert_fixture() -> None:
    """Phase 1 on a real checkpoint DeepSpeed wrote (Llama, TP=2 x DP=2, ZeRO-1)."""
    import tempfile
    from pathlib import Path

    from .convert import convert, summary
    from .formats.output import verify

    fixture = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspeed" / "llama_tp2_dp2"
    if not fixture.is_dir():
        print("\n(no committed fixture found next to the package: skipping the conversion demo)")
        return
    print(f"\nPhase 1: converting the DeepSpeed checkpoint {fixture.name} (TP=2 x DP=2, ZeRO-1)")
    with tempfile.TemporaryDirectory() as out:
        report = convert(fixture, out, progress=False)
        print("  " + summary(report).replace("\n", "\n  "))
        doc = verify(report.out_dir)
        print(f"  verify: {len(doc['files'])} files match their checksums")
        from .formats.safe_load import load

        f = load(Path(report.out_dir) / "zero" / "model.layers.0.self_attn.q_proj.weight" / "fp32.pt")["param"]
        print(f"  model.layers.0.self_attn.q_proj.weight: full fp32 {list(f.shape)}, rebuilt from 4 rank files")


def main() -> None:
    print("reshard demo: layouts derived by running their partition functions on marker tensors")
    cases = {
        "GPT-BigCode MQA fused QKV, TP=4": derive(gpt_bigcode(4), (48, 8), 4),
        "Yuan shared-QK value, TP=2": derive(yuan_value, (32, 8), 2),
        "Yuan o_proj, TP=2": derive(yuan_o_proj, (8, 32), 2),
        "pre-divided bias, TP=4": derive(divided_bias(4), (8,), 4),
    }
    for name, m in cases.items():
        m.check()
        show(name, m)
        print(f"  check() ok; bf16 rebuild(extract) bit-exact: {round_trip(m)}")

    print("\nPlans (target ∘ source⁻¹), F never materialised:")
    for name, src, tgt in [
        ("GPT-BigCode TP=4 -> TP=2", cases["GPT-BigCode MQA fused QKV, TP=4"], derive(gpt_bigcode(2), (48, 8), 2)),
        ("pre-divided bias TP=4 -> TP=2", cases["pre-divided bias, TP=4"], derive(divided_bias(2), (8,), 2)),
    ]:
        p = plan(src, tgt)
        full = torch.randn(src.logical_shape)
        out = p.apply({r: src.extract(full, r) for r in src.ranks})
        exact = all(torch.equal(out[r], tgt.extract(full, r)) for r in tgt.ranks)
        st = p.stats(element_size=4)
        print(f"  {name}: {len(p.segments)} segments, {st.local_bytes} B local, {st.remote_bytes} B remote, "
              f"exact: {exact}")
        for s in p.segments:
            f = f" x{s.factor:g}" if s.factor != 1 else ""
            print(f"    rank {s.src_rank} @{s.src.offset}{list(s.src.strides)} -> rank {s.dst_rank} "
                  f"@{s.dst.offset}{list(s.dst.strides)} shape {list(s.shape)}{f}")
    convert_fixture()


if __name__ == "__main__":
    main()
