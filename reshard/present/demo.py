"""``make demo``: a newcomer's tour of reshard, in two parts.

1. Layouts: derive the seed's hard layouts from plain partition functions, print their maps,
   round-trip random bf16 data bit-exactly, and plan a move between two TP degrees.
2. Phase 2 on a checkpoint DeepSpeed itself wrote (Llama, TP=2 x DP=2, ZeRO-1, committed under
   tests/fixtures/deepspeed/llama_tp2_dp2): reshard it to TP=1 x DP=4, convert both the source and
   the result to universal checkpoints, and check bit for bit that they hold the same tensors.
   The plan's picture (bytes moved between source and target ranks) is drawn to a PNG.

Part 2 writes under ./demo-out/ in the current directory (its folders are replaced on every run).
Any difference raises, so the demo exits non-zero.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import ParamMap, apply_plan, convert, derive, plan, reshard, verify
from ..plan.retarget import plan_topology
from .describe import stats_lines, write_plan_png
from .inspected import open_source

ELEMENT_SIZE = 4  # the fixture is fp32

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "deepspeed" / "llama_tp2_dp2"
OUT = Path("demo-out")
STATES = ("fp32", "exp_avg", "exp_avg_sq")  # what a universal checkpoint keeps per parameter


class DemoFailed(RuntimeError):
    """Something the tour shows turned out false."""


# -- part 1: layouts ------------------------------------------------------------------------------


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


def layouts_tour() -> None:
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
        out = apply_plan(p, {r: src.extract(full, r) for r in src.ranks})
        exact = all(torch.equal(out[r], tgt.extract(full, r)) for r in tgt.ranks)
        st = p.stats(element_size=4)
        print(f"  {name}: {len(p.segments)} segments, {st.local_bytes} B local, {st.remote_bytes} B remote, "
              f"exact: {exact}")
        for s in p.segments:
            f = f" x{s.factor:g}" if s.factor != 1 else ""
            print(f"    rank {s.src_rank} @{s.src.offset}{list(s.src.strides)} -> rank {s.dst_rank} "
                  f"@{s.dst.offset}{list(s.dst.strides)} shape {list(s.shape)}{f}")


# -- part 2: reshard a real checkpoint, and prove nothing changed ---------------------------------


def topology(t: dict[str, int]) -> str:
    return f"TP={t['tp']} x DP={t['dp']} ZeRO-{t['zero_stage']}"


def size(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def draw_plan(source: Path, tp: int, dp: int, png: Path) -> list[str]:
    """What ``reshard plan SOURCE --tp T --dp D --png FILE`` does, through the library: rebuild the
    source's layouts at the target, plan the move without moving data, and draw the bytes each
    source rank sends to each target rank. Returns the plan's figures as text lines."""
    src = open_source(source)
    tplan = plan_topology(src.maps, tp, dp, source_dp=src.dp, where=src.path)
    write_plan_png(tplan.plan, tplan.source_maps, tplan.target_maps, str(png), ELEMENT_SIZE,
                   f"plan: {source.name} (TP={tplan.source_tp} DP={tplan.source_dp}) → TP={tp} DP={dp}")
    if not png.is_file():
        raise DemoFailed(f"the plan picture {png} was not written")
    return [f"source: {src.description}; target: TP={tp} DP={dp}"] + stats_lines(tplan.plan, ELEMENT_SIZE)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes: torch.equal on these is bit for bit (NaN == NaN, -0.0 != 0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def load_universal(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a universal checkpoint: ``zero/<param>/<state>.pt`` -> {"<param>/<state>": tensor}.
    A state file is a dict whose ``param`` is the full, unsharded tensor (``step.pt`` is a bare tensor)."""
    tensors = {}
    for f in sorted((tag_dir / "zero").glob("*/*.pt")):
        obj = torch.load(f, map_location="cpu", weights_only=True)
        # Only the tensor is compared: metadata beside it (``cat_dim``) follows how the source
        # recorded its TP layout (the TP=2 fixture carries an affine map, a TP=1 checkpoint none).
        tensors[f"{f.parent.name}/{f.stem}"] = obj["param"] if isinstance(obj, dict) else obj
    return tensors


def compare_universal(a: Path, b: Path) -> list[str]:
    """Check that two universal checkpoints hold the same logical tensors, bit for bit; return the
    ``<param>/<state>`` names compared. Raises DemoFailed listing every difference."""
    ta, tb = load_universal(a), load_universal(b)
    problems = [f"{k}: only in {a}" for k in sorted(ta.keys() - tb.keys())]
    problems += [f"{k}: only in {b}" for k in sorted(tb.keys() - ta.keys())]
    params = {k.split("/")[0] for k in ta}
    problems += [f"{p}/{s}: missing" for p in sorted(params) for s in STATES if f"{p}/{s}" not in ta]
    for k in sorted(ta.keys() & tb.keys()):
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            problems.append(f"{k}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}")
        elif not torch.equal(bits(x), bits(y)):
            diff = (x.double() - y.double()).abs().nan_to_num(nan=float("inf")).max().item()
            problems.append(f"{k}: values differ (max |diff| {diff:g})")
    if problems or not ta:
        raise DemoFailed(f"universal checkpoints {a} and {b} differ:\n  " + "\n  ".join(problems or ["empty"]))
    return sorted(ta)


def reshard_tour(out: Path = OUT) -> None:
    """Phase 2's main job on a checkpoint DeepSpeed wrote: TP=2 x DP=2 -> TP=1 x DP=4."""
    if not FIXTURE.is_dir():
        print(f"\n(no committed fixture at {FIXTURE}: skipping the resharding tour)")
        return
    tp, dp = 1, 4
    print(f"\nResharding a checkpoint DeepSpeed wrote: tests/fixtures/deepspeed/{FIXTURE.name} -> TP={tp} x DP={dp}")
    print(f"  outputs under {out.resolve()}/")

    # 1. Rewrite the checkpoint at the new topology, as DeepSpeed would have saved it there
    #    (engine.load_checkpoint loads it natively). TP=1 needs no target layout: every
    #    parameter is whole on its one TP rank.
    resharded = reshard(FIXTURE, out / f"tp{tp}_dp{dp}", tp=tp, dp=dp, overwrite=True)
    verify(resharded.out_dir)  # re-reads every file written against its checksum manifest
    print(f"  reshard  {topology(resharded.source)} -> {topology(resharded.target)}: "
          f"{resharded.params} parameters, {resharded.files} files, {size(resharded.bytes_written)} "
          f"written to {resharded.out_dir}, {resharded.segments} plan segments; checksums verified")

    # 2. Convert both to universal checkpoints: one full, unsharded tensor per parameter and state,
    #    whatever the topology it came from.
    ucp_src = convert(FIXTURE, out / "ucp_source", overwrite=True, progress=False)
    ucp_tgt = convert(resharded.out_dir, out / "ucp_resharded", overwrite=True, progress=False)
    for label, report in (("source", ucp_src), ("resharded", ucp_tgt)):
        print(f"  convert  {label:<9} -> {report.out_dir}: {report.files} files, {size(report.bytes_written)}")

    # 3. The same logical tensors, bit for bit: every parameter's fp32 master, exp_avg,
    #    exp_avg_sq (and step).
    compared = compare_universal(ucp_src.out_dir, ucp_tgt.out_dir)
    states = sorted({name.split("/")[1] for name in compared})
    print(f"  compare  {len(compared)} tensors ({ucp_src.params} parameters x {{{', '.join(states)}}}) "
          "with torch.equal, bit for bit: all identical")

    # 4. The plan behind step 1, as a picture: bytes each source rank sends to each target rank.
    src = resharded.source
    png = out / f"plan_tp{src['tp']}_dp{src['dp']}_to_tp{tp}_dp{dp}.png"
    lines = draw_plan(FIXTURE, tp, dp, png)
    print("  plan     " + "\n           ".join(line for line in lines if not line.startswith("wrote ")))
    print(f"  picture  {png}")


def main() -> None:
    layouts_tour()
    reshard_tour()


if __name__ == "__main__":
    main()
