"""Peak memory of a DeepSeek-V3-shaped checkpoint at full widths, HF -> Megatron -> HF (issue 35 item 5;
issue 33's "Speed and memory" for the FP8 variant): each command's peak RSS at two layer counts, to
show that it is flat in model size (the goal: <= 512 MiB).

The source: an HF ``DeepseekV3ForCausalLM`` folder with DeepSeek-V3's widths (hidden 7168, vocabulary
129280: embedding and ``lm_head`` 129280 x 7168; MLA with q_lora_rank 1536, kv_lora_rank 512, 128 heads of
qk_nope 128 + qk_rope 64, v_head 128; dense MLP 18432) and a few layers, random bf16 weights (std 0.02,
norms 1, seeded), written stripe by stripe (no tensor whole in memory) as sharded safetensors with an
index; with ``fp8`` each decoder linear is an E4M3 payload with float32 ``weight_scale_inv`` per
128 x 128 block (``reshard.ir.codec.fp8_block_encode``, as DeepSeek-V3's release stores them), so the
import decodes them on the way. The first layers are dense (``first_k_dense_replace``); ``moe_layers`` > 0
makes the last ones MoE (``deepseek_v3.json`` maps the router, ``e_score_correction_bias`` (float32, as the
release stores it), the routed experts and the shared expert): ``experts`` routed experts (default 8, not
DeepSeek-V3's 256: 256 full-width experts are 21 GB a layer, past a scratch disk) of full width
``moe_intermediate_size`` 2048, one shared expert.

Two commands, each a subprocess, peak RSS by ``benchmarks.common.tree_rss`` (the process tree's summed
RSS every 20 ms) and each process's ``VmHWM`` (``bench_fp8_export.measured``):

1. ``reshard reshard SRC MG --to megatron --tp 1 --pp 1 --dtype bf16`` (reshard's own ``torch_dist`` writer);
2. ``reshard convert MG/hf BACK --format hf --dtype bf16``.

Then BACK is checked against what the generator wrote (a CRC-32 of every tensor's bytes, computed while
generating: the source's own bytes, or for ``fp8`` its decoded values cast to bf16): every tensor bit for
bit. Random stripes are made once per width and reused (``_Pool``): the weights are random, not all
different. The source's hashes are taken as it is written, so SRC is deleted once imported (disk: two
checkpoints at a time). Everything lives in a temporary folder (``$DSV3_TMP``, default /tmp), deleted after.

    python -m benchmarks.bench_dsv3_memory [--layers 2,4] [--fp8] [--moe-layers 0] [--experts 8]
    (make bench: $DSV3_LAYERS, default "1,2" of a narrow vocabulary ("small"); DSV3_FULL=1 for full widths)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import tempfile
import time
import zlib
from math import prod
from pathlib import Path

from benchmarks.bench_fp8_export import measured, nbytes, quantized_linear

MIB = 2**20
BLOCK = (128, 128)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
FULL = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
# the same shape family, a sixteenth of the widths: what `make bench` runs by default (seconds, not minutes)
SMALL = {"vocab_size": 8192, "hidden_size": 448, "intermediate_size": 1152, "moe_intermediate_size": 128,
         "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 96, "kv_lora_rank": 32,
         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STRIPE = 1 << 24  # elements generated at a time
SHARD = 4 << 30  # bytes per safetensors file at most (save_pretrained's default is 5 GB)


def config(widths: dict, layers: int, moe_layers: int = 0, experts: int = 4) -> dict:
    dense = layers - moe_layers
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **widths,
            "num_hidden_layers": layers, "first_k_dense_replace": dense, "n_routed_experts": experts,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 2.5, "rope_interleave": True, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "max_position_embeddings": 4096,
            "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "dtype": "bfloat16",
            "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
            "initializer_range": 0.02}


def entries(cfg: dict, fp8: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor, in name order: the model's state dict built on
    the meta device; with ``fp8`` each decoder linear's weight an E4M3 payload and its scales after it."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from reshard.ir.codec import scale_grid

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
    out = []
    for name, t in model.state_dict().items():
        shape = tuple(t.shape)
        if fp8 and quantized_linear(name, LINEARS):
            out += [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32", scale_grid(shape, BLOCK))]
        elif name.endswith("e_score_correction_bias"):
            out.append((name, "F32", shape))
        else:
            out.append((name, "BF16", shape))
    return sorted(out)




class _Pool:
    """Random stripes made once per width and reused (``POOL`` of them, in turn, from a place each
    tensor's seed picks): generating 10 GB of fresh random numbers, and FP8-encoding them, would
    take the benchmark longer than the commands it measures. Each stripe is held as the bytes the
    source stores and the bytes the HF export back must hold (the decoded values, for FP8)."""

    def __init__(self) -> None:
        self.made: dict = {}

    def stripe(self, rows: int, cols: int, k: int, fp8: bool) -> tuple[bytes, bytes, object]:
        """Stripe ``k`` of ``rows`` x ``cols``: (stored bytes, bytes back, FP8 scales or None)."""
        import torch

        from reshard.ir.codec import fp8_block_decode, fp8_block_encode

        key = (rows, cols, k % POOL, fp8)
        if key not in self.made:
            g = torch.Generator().manual_seed(cols * POOL + k % POOL)
            t = (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)
            if fp8:
                q, sc = fp8_block_encode(t, BLOCK, "float32")
                back = fp8_block_decode(q, sc, BLOCK).to(torch.bfloat16)
                self.made[key] = (q.view(torch.uint8).numpy().tobytes(), back.view(torch.uint8).numpy().tobytes(), sc)
            else:
                raw = t.view(torch.uint8).numpy().tobytes()
                self.made[key] = (raw, raw, None)
        return self.made[key]

    @staticmethod
    def rows(cols: int) -> int:
        return max(BLOCK[0], STRIPE // cols // BLOCK[0] * BLOCK[0])


POOL = 3


def _write_tensor(f, name: str, dtype: str, shape: tuple[int, ...], seed: int, scales: dict, pool: _Pool
                  ) -> dict[str, int]:
    """Write one tensor's bytes (an FP8 payload's scales kept in ``scales`` for the next entry);
    returns ``{name: CRC-32}`` of the bytes the HF export back must hold (bf16: the decoded values)."""
    import torch

    if name in scales:
        f.write(scales.pop(name).contiguous().view(torch.uint8).numpy().tobytes())
        return {}
    crc = 0
    if len(shape) < 2 or name.endswith("norm.weight"):  # norms: ones
        t = torch.ones(shape, dtype=torch.bfloat16 if dtype == "BF16" else torch.float32)
        raw = t.view(torch.uint8).numpy().tobytes()
        f.write(raw)
        return {name: zlib.crc32(raw)}
    rows, cols = prod(shape[:-1]), shape[-1]  # stacked experts [E, out, in]: E * out rows
    per = min(_Pool.rows(cols), -(-rows // BLOCK[0]) * BLOCK[0])
    parts = []
    for i, r0 in enumerate(range(0, rows, per)):
        n = min(per, rows - r0)
        stored, back, sc = pool.stripe(per, cols, seed + i, dtype == "F8_E4M3")
        f.write(memoryview(stored)[:n * cols * (1 if dtype == "F8_E4M3" else 2)])
        crc = zlib.crc32(memoryview(back)[:n * cols * 2], crc)
        if dtype == "F8_E4M3":
            parts.append(sc[:-(-n // BLOCK[0])])
    if parts:
        scales[name + "_scale_inv"] = torch.cat(parts)
    return {name: crc}


def write_folder(folder: Path, cfg: dict, fp8: bool, seed: int = 0) -> dict:
    """The HF folder (shards of at most ``SHARD`` bytes, an index, ``config.json``), one stripe in
    memory at a time. Returns ``{"parameters", "bytes", "files", "sums"}``."""
    ents = entries(cfg, fp8)
    shards: list[list] = [[]]
    used = 0
    for e in ents:
        n = nbytes(e[1], e[2])
        if shards[-1] and used + n > SHARD and not e[0].endswith("_scale_inv"):
            shards.append([])
            used = 0
        shards[-1].append(e)
        used += n
    folder.mkdir(parents=True)
    weight_map, total, sums, scales, pool = {}, 0, {}, {}, _Pool()
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        at = 0
        for name, dtype, shp in shard:
            header[name] = {"dtype": dtype, "shape": list(shp), "data_offsets": [at, at + nbytes(dtype, shp)]}
            at += nbytes(dtype, shp)
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for j, (name, dtype, shp) in enumerate(shard):
                sums.update(_write_tensor(f, name, dtype, shp, seed + zlib.crc32(name.encode()) + j, scales, pool))
        total += at
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    doc = dict(cfg, **({"quantization_config": QUANT} if fp8 else {}))
    (folder / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    params = sum(nbytes("F8_E4M3", s) for n, _, s in ents if not n.endswith("_scale_inv"))
    return {"parameters": params, "bytes": total, "files": len(shards), "sums": sums}


def sums_of(folder: Path) -> dict[str, int]:
    """CRC-32 of every tensor's bytes in an HF folder, read a stripe at a time (``safe_open``'s slices)."""
    import torch
    from safetensors import safe_open

    out = {}
    for p in sorted(folder.glob("*.safetensors")):
        with safe_open(p, "pt") as g:
            for name in g.keys():
                sl = g.get_slice(name)
                shape = sl.get_shape()
                step = max(1, STRIPE // max(1, prod(shape[1:])))
                crc = 0
                for r0 in range(0, shape[0], step):
                    crc = zlib.crc32(sl[r0:min(shape[0], r0 + step)].contiguous().view(torch.uint8).numpy(), crc)
                out[name] = crc
    return out


def _tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def one(widths: dict, layers: int, fp8: bool, moe_layers: int, work: Path, experts: int = 8) -> list[str]:
    from benchmarks.common import row

    src, mg, back = work / "hf", work / "mg", work / "back"
    cfg = config(widths, layers, moe_layers, experts)
    t = time.perf_counter()
    made = write_folder(src, cfg, fp8)
    what = (f"{layers} layers ({moe_layers} MoE" + (f", {experts} experts of {widths['moe_intermediate_size']}" if moe_layers else "")
            + f"), hidden {widths['hidden_size']}, vocab {widths['vocab_size']}"
            + (", FP8 linears" if fp8 else ", bf16"))
    lines = [f"  DeepSeek-V3-shaped {what}: {made['parameters'] / 1e9:.2f}B parameters, {made['files']} files, "
             f"{made['bytes'] / MIB:,.0f} MiB (generated in {time.perf_counter() - t:.0f} s)"]
    try:
        imp_s, imp_rss, imp_hwm = measured(["-m", "reshard", "reshard", src, mg, "--to", "megatron", "--tp", "1",
                                            "--pp", "1", "--dtype", "bf16"], work / "import.log")
    except RuntimeError as e:
        return lines + [f"  HF -> Megatron refused or failed: {str(e).splitlines()[-1]}"]
    shutil.rmtree(src)  # its tensors' hashes are kept: two checkpoints on disk at a time
    mg_bytes = _tree_bytes(mg)
    saved = mg / src.name  # OUT/<tag>: the save folder (latest_checkpointed_iteration.txt, iter_*)
    exp_s, exp_rss, exp_hwm = measured(["-m", "reshard", "convert", saved, back, "--format", "hf", "--dtype", "bf16"], work / "export.log")
    got = sums_of(back)
    bad = sorted(n for n in made["sums"].keys() | got.keys() if made["sums"].get(n) != got.get(n))
    if bad:
        raise SystemExit(f"HF -> Megatron -> HF changed {len(bad)} tensors: {bad[:5]}")
    goal = 512 * MIB
    for label, s, rss, hwm in (("HF -> Megatron", imp_s, imp_rss, imp_hwm), ("Megatron -> HF", exp_s, exp_rss, exp_hwm)):
        lines.append(row(f"dsv3 {layers}L{' fp8' if fp8 else ''}: {label} peak RSS", max(rss, hwm) / MIB, unit="MiB",
                         note=f"(tree {rss / MIB:.0f} MiB, VmHWM {hwm / MIB:.0f} MiB; {s:.1f} s; goal <= 512 MiB: "
                              + ("met)" if max(rss, hwm) <= goal else "NOT met)")))
    lines.append(f"  Megatron torch_dist {mg_bytes / MIB:,.0f} MiB; back to HF: all {len(got)} tensors equal the "
                 "source's (decoded) values bit for bit")
    return lines


def main(layers: list[int] | None = None, fp8: bool | None = None, moe_layers: int = 0,
         full: bool | None = None, experts: int = 8) -> list[str]:
    try:
        import psutil  # noqa: F401
        from transformers import DeepseekV3Config  # noqa: F401
    except ImportError as e:
        return [f"  (skipped: {e}; this benchmark needs transformers and psutil)"]
    full = os.environ.get("DSV3_FULL") == "1" if full is None else full
    layers = layers or [int(x) for x in os.environ.get("DSV3_LAYERS", "2,4" if full else "1,2").split(",")]
    fp8 = os.environ.get("DSV3_FP8") == "1" if fp8 is None else fp8
    out = []
    for n in layers:
        with tempfile.TemporaryDirectory(prefix="dsv3_mem_", dir=os.environ.get("DSV3_TMP")) as tmp:
            out += one(FULL if full else SMALL, n, fp8, moe_layers, Path(tmp), experts)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default=None, help="comma-separated layer counts (default $DSV3_LAYERS)")
    ap.add_argument("--fp8", action="store_true", help="the decoder linears FP8 with block scales (as released)")
    ap.add_argument("--moe-layers", type=int, default=0, help="the last N layers MoE")
    ap.add_argument("--experts", type=int, default=8,
                    help="routed experts per MoE layer (DeepSeek-V3 has 256: too big for a scratch disk)")
    ap.add_argument("--full", action="store_true", help="DeepSeek-V3's full widths (else $DSV3_FULL)")
    a = ap.parse_args()
    from benchmarks.common import machine

    print(f"machine: {machine()}", flush=True)
    for line in main([int(x) for x in a.layers.split(",")] if a.layers else None, a.fp8 or None, a.moe_layers,
                     a.full or None, a.experts):
        print(line, flush=True)
