"""``make demo``: a newcomer's tour of reshard, one line per step and its proof.

1. derive   the seed's hard layouts from plain partition functions; bf16 round trips bit-exact.
2. plan     a move between two TP degrees (target ∘ source⁻¹), applied: exact.
3. reshard  a checkpoint DeepSpeed itself wrote (Llama, TP=2 x DP=2, ZeRO-1, committed under
            tests/fixtures/deepspeed/llama_tp2_dp2) to TP=1 x DP=4, checksums verified.
4. convert  the source and the result to universal checkpoints: the same tensors, bit for bit.
5. hf       both to Hugging Face folders: ``from_pretrained`` loads them, and their logits equal
            those of the model holding the universal checkpoint's masters, bit for bit.
6. names    a Megatron-Core and a PyTorch DCP (FSDP2) checkpoint to the same HF names; the
            Megatron export's logits against Megatron's own forward pass.
7. picture  the plan of step 3 drawn: bytes each source rank sends to each target rank.

Everything is written under ./demo-out/ (its folders are replaced on every run). A step that
cannot run (a fixture, transformers or matplotlib missing) or whose check fails raises
``DemoFailed``: ``make demo`` never passes by skipping.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from .. import ParamMap, apply_plan, convert, derive, plan, reshard, verify
from ..plan.retarget import plan_topology
from .describe import stats_lines, write_plan_png
from .inspected import open_source

ELEMENT_SIZE = 4  # the fixture is fp32

# the committed fixtures, in a source checkout (make demo runs from one)
FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
FIXTURE = FIXTURES / "deepspeed" / "llama_tp2_dp2"
MEGATRON = FIXTURES / "megatron" / "torch_dist_tp2_pp2"
DCP = FIXTURES / "dcp" / "llama_fsdp2_ws2"
MEGATRON_ATOL = 1e-5  # two implementations' fp32 forward passes sum in different orders (tests/formats/megatron)
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


def step(verb: str, text: str) -> None:
    print(f"  {verb:<8} {text}")


def need(path: Path) -> Path:
    if not path.exists():
        raise DemoFailed(f"{path}: the committed fixture is missing; run make demo from a reshard source checkout")
    return path


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
        if not round_trip(m):
            raise DemoFailed(f"{name}: rebuild(extract(F)) is not F")
        pieces = "; ".join(p.describe() for p in m.shard(m.ranks[-1]).pieces)
        step("derive", f"{name}: F {list(m.logical_shape)}, {m.num_pieces} pieces; check() ok; bf16 "
                       f"rebuild(extract) bit-exact. Rank {m.ranks[-1]}: {pieces}")
    for name, src, tgt in [
        ("GPT-BigCode TP=4 -> TP=2", cases["GPT-BigCode MQA fused QKV, TP=4"], derive(gpt_bigcode(2), (48, 8), 2)),
        ("pre-divided bias TP=4 -> TP=2", cases["pre-divided bias, TP=4"], derive(divided_bias(2), (8,), 2)),
    ]:
        p = plan(src, tgt)
        full = torch.randn(src.logical_shape)
        out = apply_plan(p, {r: src.extract(full, r) for r in src.ranks})
        if not all(torch.equal(out[r], tgt.extract(full, r)) for r in tgt.ranks):
            raise DemoFailed(f"{name}: the plan's result differs from the target's shards")
        st = p.stats(element_size=4)
        scaled = sum(s.factor != 1 for s in p.segments)
        step("plan", f"{name} (target ∘ source⁻¹, F never built): {len(p.segments)} segments"
                     f"{f' ({scaled} rescaled)' if scaled else ''}, {st.local_bytes} B local, {st.remote_bytes} B "
                     "remote; applied to random shards: exact")


# -- a real checkpoint: reshard, convert, export, and prove nothing changed ----------------------


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


def _transformers():
    try:
        import transformers
    except ImportError:
        raise DemoFailed("transformers is not installed: the demo's HF steps need it (make demo installs it)") from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


def per_layer(names: list[str]) -> list[str]:
    """Names with their layer index as ``N``: models of other depths, one naming."""
    return sorted({re.sub(r"\.\d+\.", ".N.", n) for n in names})


def llama_config(fixture: Path, out: Path) -> Path:
    """The model's ``config.json`` as the training job had it (the fixture's recipe), in a folder
    for ``--hf-config``: DeepSpeed and DCP checkpoints do not carry one."""
    full = json.loads((fixture / "fixture.json").read_text())["model_config_full"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**full, "architectures": ["LlamaForCausalLM"]}, indent=1))
    return out


def probe_logits(model: Any, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.eval()(ids).logits


def hf_tour(source_ucp: Path, config_dir: Path, sources: dict[str, Path], out: Path) -> list[str]:
    """Export each source to an HF folder; every folder loads with ``from_pretrained`` and gives the
    logits of the model built from the config holding the universal checkpoint's fp32 masters."""
    tr = _transformers()
    config = tr.AutoConfig.from_pretrained(config_dir)
    reference = tr.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    masters = {k.rsplit("/", 1)[0]: v for k, v in load_universal(source_ucp).items() if k.endswith("/fp32")}
    missing, unexpected = reference.load_state_dict(masters, strict=False)
    if missing or unexpected:
        raise DemoFailed(f"the universal masters do not fit the config: missing {missing}, unexpected {unexpected}")
    want = probe_logits(reference, config.vocab_size)
    names = []
    for label, src in sources.items():
        report = convert(src, out / f"hf_{label}", fmt="hf", hf_config=config_dir, overwrite=True, progress=False)
        model = tr.AutoModelForCausalLM.from_pretrained(report.out_dir, attn_implementation="eager")
        if not torch.equal(bits(probe_logits(model, config.vocab_size)), bits(want)):
            raise DemoFailed(f"{report.out_dir}: its logits differ from the universal masters' model")
        names = sorted(model.state_dict())
        step("hf", f"{label} -> {report.out_dir}: from_pretrained loads {type(model).__name__} "
                   f"({len(names)} tensors); logits on a probe equal the universal masters' model's, bit for bit")
    return names


def names_tour(hf_names: list[str], out: Path, config_dir: Path) -> None:
    """A Megatron-Core and a DCP checkpoint exported under the same HF names; Megatron's export
    gives Megatron's own forward pass (recorded by Megatron when the fixture was made)."""
    tr = _transformers()
    from safetensors.torch import load_file

    mg = convert(need(MEGATRON), out / "hf_megatron", fmt="hf", overwrite=True, progress=False)
    model = tr.AutoModelForCausalLM.from_pretrained(mg.out_dir)
    fwd = load_file(str(MEGATRON / "oracle" / "forward.safetensors"))
    with torch.no_grad():
        logits = model.eval()(fwd["input_ids"]).logits
    diff = float((logits - fwd["logits"][..., :logits.shape[-1]]).abs().max())
    if diff >= MEGATRON_ATOL:
        raise DemoFailed(f"{mg.out_dir}: logits differ from Megatron's forward by {diff:g}")
    mg_names = per_layer(list(model.state_dict()))
    if mg_names != per_layer(hf_names):
        raise DemoFailed(f"Megatron's export names {mg_names} differ from the DeepSpeed export's {per_layer(hf_names)}")
    step("names", f"Megatron-Core torch_dist TP=2 x PP=2 (4 layers) -> {mg.out_dir}: the same HF names "
                  f"({len(mg_names)} per layer N or model-wide); logits vs Megatron's own forward: max |diff| "
                  f"{diff:.1e} (< {MEGATRON_ATOL:g})")
    dcp = convert(need(DCP), out / "hf_dcp", fmt="hf", hf_config=config_dir, overwrite=True, progress=False)
    dcp_names = sorted(tr.AutoModelForCausalLM.from_pretrained(dcp.out_dir).state_dict())
    if dcp_names != hf_names:
        raise DemoFailed(f"the DCP export's names {dcp_names} differ from the DeepSpeed export's {hf_names}")
    step("names", f"PyTorch DCP (FSDP2, 2 ranks) -> {dcp.out_dir}: the same {len(dcp_names)} HF names; "
                  "from_pretrained loads it")


def reshard_tour(out: Path = OUT) -> None:
    """Phase 2's main job on a checkpoint DeepSpeed wrote: TP=2 x DP=2 -> TP=1 x DP=4, then every
    check a newcomer would make of it."""
    need(FIXTURE)
    tp, dp = 1, 4
    print(f"\nA checkpoint DeepSpeed itself wrote: tests/fixtures/deepspeed/{FIXTURE.name}; outputs under "
          f"{out.resolve()}/")

    # Rewrite the checkpoint at the new topology, as DeepSpeed would have saved it there
    # (engine.load_checkpoint loads it natively). TP=1 needs no target layout.
    resharded = reshard(FIXTURE, out / f"tp{tp}_dp{dp}", tp=tp, dp=dp, overwrite=True)
    verify(resharded.out_dir)  # re-reads every file written against its checksum manifest
    step("reshard", f"{topology(resharded.source)} -> {topology(resharded.target)}: {resharded.params} parameters, "
                    f"{resharded.files} files, {size(resharded.bytes_written)}, {resharded.segments} plan segments "
                    f"-> {resharded.out_dir}; checksums verified")

    # Both to universal checkpoints: one full tensor per parameter and state, whatever the topology.
    ucp_src = convert(FIXTURE, out / "ucp_source", overwrite=True, progress=False)
    ucp_tgt = convert(resharded.out_dir, out / "ucp_resharded", overwrite=True, progress=False)
    compared = compare_universal(ucp_src.out_dir, ucp_tgt.out_dir)
    states = sorted({name.split("/")[1] for name in compared})
    step("convert", f"source and result -> universal ({ucp_src.out_dir.parent.name}, {ucp_tgt.out_dir.parent.name}):"
                    f" {len(compared)} tensors ({ucp_src.params} parameters x {{{', '.join(states)}}}) compared "
                    "bit for bit: all identical")

    config_dir = llama_config(FIXTURE, out / "llama_config")
    names = hf_tour(ucp_src.out_dir, config_dir, {"source": FIXTURE, "resharded": resharded.out_dir}, out)
    names_tour(names, out, config_dir)

    # The plan behind the reshard, as a picture: bytes each source rank sends to each target rank.
    src = resharded.source
    png = out / f"plan_tp{src['tp']}_dp{src['dp']}_to_tp{tp}_dp{dp}.png"
    lines = draw_plan(FIXTURE, tp, dp, png)
    step("picture", f"{png}: " + "; ".join(line.strip() for line in lines
                                            if not line.startswith(("wrote ", " ")) and "rank " not in line))


def main() -> None:
    layouts_tour()
    reshard_tour()
    print("\nEvery step ran and every check held.")


if __name__ == "__main__":
    main()
