#!/usr/bin/env python
"""Check what ``docs/megatron-checkpoints.md`` says against the Megatron fixtures, reading them
the way a reader without Megatron would.

Only torch (the DCP ``.metadata`` classes; ``torch.load`` of records, tensors with
``weights_only=True``, everything else through the restricted unpickler below), safetensors and,
for the forward check, transformers are used -- never megatron. So it runs in reshard's own
environment or in the Megatron venv alike::

    python scripts/verify_megatron_fixtures.py [--only NAME] [--no-hf]

For every fixture it rebuilds, from the documented layout rules alone, every full tensor of the
checkpoint (model weights, Adam moments, distributed-optimizer buckets, legacy per-rank files) and
compares it, bit for bit, with Megatron's own reload in ``oracle/``; it checks each chunk's box
and the rank file that holds it against the documented formulas; and (with transformers) it
converts the TP=1 weights to a Hugging Face ``LlamaForCausalLM`` (or ``MixtralForCausalLM``) and
compares its logits with Megatron's forward logits in ``oracle/forward.safetensors``.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pickle
import re
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "megatron"

# --------------------------------------------------------------------------------------------
# Restricted unpickling (what common_state, rng_state, ... and the legacy files need)
# --------------------------------------------------------------------------------------------

SAFE_GLOBALS = {
    ("argparse", "Namespace"),
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch", "float32"), ("torch", "bfloat16"), ("torch", "float16"),
    ("_codecs", "encode"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}
# Enum members of Megatron (and signal): a reader has no Megatron to import; each becomes a Stub
# that keeps the class name and the value it was built from.
STUB_GLOBALS = {
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "InferenceCudaGraphScope"),
    ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.core.rerun_state_machine", "RerunState"),
    ("megatron.core.rerun_state_machine", "RerunDiagnostic"),
    ("signal", "Signals"),
}


class Stub:
    def __init__(self, cls: str, *args):
        self.cls, self.args = cls, args

    def __repr__(self):
        return f"<{self.cls}{self.args!r}>"


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        if (module, name) in STUB_GLOBALS:
            return lambda *args: Stub(f"{module}.{name}", *args)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


class _RestrictedPickleModule:
    Unpickler = _RestrictedUnpickler
    load = staticmethod(lambda f, **kw: _RestrictedUnpickler(f, **kw).load())
    __name__ = "restricted_pickle"


def restricted_load(data_or_path) -> object:
    f = io.BytesIO(data_or_path) if isinstance(data_or_path, (bytes, bytearray)) else data_or_path
    return torch.load(f, map_location="cpu", weights_only=False, pickle_module=_RestrictedPickleModule)


# --------------------------------------------------------------------------------------------
# torch_dist reader
# --------------------------------------------------------------------------------------------


class DistCheckpoint:
    """A torch_dist ``iter_NNNNNNN`` folder: keys, chunks, full tensors, objects."""

    def __init__(self, iter_dir: Path):
        from torch.distributed.checkpoint import FileSystemReader

        self.dir = iter_dir
        self.md = FileSystemReader(str(iter_dir)).read_metadata()
        self.where = {}
        for idx, info in self.md.storage_data.items():
            off = tuple(idx.offset) if idx.offset is not None else None
            self.where[(idx.fqn, off)] = info

    def _record(self, fqn, off) -> bytes:
        info = self.where[(fqn, off)]
        with open(self.dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            return f.read(info.length)

    def tensor_keys(self):
        return [k for k, v in self.md.state_dict_metadata.items() if hasattr(v, "chunks")]

    def chunks(self, key):
        """[(offsets, sizes, rank of the file that holds it)]."""
        out = []
        for c in self.md.state_dict_metadata[key].chunks:
            off = tuple(c.offsets)
            rel = self.where[(key, off)].relative_path
            out.append((off, tuple(c.sizes), int(re.match(r"__(\d+)_\d+\.distcp$", rel).group(1))))
        return out

    def full(self, key) -> torch.Tensor:
        meta = self.md.state_dict_metadata[key]
        full = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
        seen = torch.zeros(tuple(meta.size), dtype=torch.int32)
        for off, sizes, _rank in self.chunks(key):
            t = torch.load(io.BytesIO(self._record(key, off)), weights_only=True)
            assert tuple(t.shape) == sizes, (key, off, t.shape, sizes)
            sl = tuple(slice(o, o + s) for o, s in zip(off, sizes))
            full[sl] = t
            seen[sl] += 1
        assert bool((seen == 1).all()), f"{key}: chunks do not tile the tensor exactly once"
        return full

    def objects(self, prefix) -> dict:
        """{shard name: unpickled value} for the bytes entries ``prefix/shard_*``."""
        out = {}
        for k, v in self.md.state_dict_metadata.items():
            if not hasattr(v, "chunks") and k.split("/")[0] == prefix:
                value = restricted_load(self._record(k, None))
                assert isinstance(value, list) and len(value) == 1, (k, type(value))  # torch.save([data])
                out[k.split("/", 1)[1]] = value[0]
        return out

    def object_file_rank(self, key) -> int:
        rel = self.where[(key, None)].relative_path
        return int(re.match(r"__(\d+)_\d+\.distcp$", rel).group(1))


# --------------------------------------------------------------------------------------------
# The documented layout rules
# --------------------------------------------------------------------------------------------


class Cfg:
    """What the rules need, from the saved ``args`` (a restricted-unpickled Namespace)."""

    def __init__(self, a):
        self.L = a.num_layers
        self.H = a.hidden_size
        self.heads = a.num_attention_heads
        self.G = a.num_query_groups if a.group_query_attention else a.num_attention_heads
        self.d = a.kv_channels or a.hidden_size // a.num_attention_heads
        self.F = a.ffn_hidden_size
        self.V = a.padded_vocab_size
        self.vocab = a.vocab_size
        self.TP, self.PP = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
        self.DP, self.EP = a.data_parallel_size, a.expert_model_parallel_size
        self.E = a.num_experts
        self.Fe = a.moe_ffn_hidden_size
        self.eps = a.norm_epsilon if hasattr(a, "norm_epsilon") else a.layernorm_epsilon
        self.rope_base = a.rotary_base
        self.distopt = a.use_distributed_optimizer
        self.world = a.world_size
        self.seq = a.seq_length
        self.params_dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
        grad = torch.float32 if (a.accumulate_allreduce_grads_in_fp32 or self.params_dtype == torch.float32) else self.params_dtype
        self.buffer_dtype = (self.params_dtype, grad)  # (param dtype, grad dtype) of the DDP buffer
        self.VPP = getattr(a, "virtual_pipeline_model_parallel_size", None) or 1
        self.first = getattr(a, "decoder_first_pipeline_num_layers", None)
        self.last = getattr(a, "decoder_last_pipeline_num_layers", None)
        self.qk_norm = bool(getattr(a, "qk_layernorm", False))
        self.mla = bool(getattr(a, "multi_latent_attention", False))
        if self.mla:  # MLATransformerConfig's widths
            self.q_lora, self.kv_lora = a.q_lora_rank, a.kv_lora_rank
            self.qk_head, self.rope, self.v_head = a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim

    def chunk_layers(self, pp: int, vp: int) -> range:
        """Global layers of stage ``pp``'s model chunk ``vp`` (get_transformer_layer_offset): each
        chunk of a stage holds ``first / VPP`` (stage 0, when set), ``last / VPP`` (the last stage,
        when set) or an even share of the rest."""
        ends = [x for x in (self.first, self.last) if x is not None]
        mid = (self.L - sum(ends)) // self.VPP // (self.PP - len(ends)) if self.PP > len(ends) else 0
        n = [mid] * self.PP
        if self.first is not None:
            n[0] = self.first // self.VPP
        if self.last is not None:
            n[-1] = self.last // self.VPP
        start = vp * sum(n) + sum(n[:pp])
        return range(start, start + n[pp])

    def stage_of(self, layer: int) -> int:
        return next(p for p in range(self.PP) for v in range(self.VPP) if layer in self.chunk_layers(p, v))

    def stage_layers(self, pp: int) -> list[int]:
        return [i for v in range(self.VPP) for i in self.chunk_layers(pp, v)]

    @property
    def hpg(self):  # query heads per group
        return self.heads // self.G

    def rank(self, tp=0, pp=0, dp=0):
        """Global rank, Megatron's default order 'tp-cp-ep-dp-pp' (cp = 1; EP is carved out of DP)."""
        return tp + self.TP * (dp + self.DP * pp)

    def coords(self, rank):
        """(tp, pp, dp, ep) of a global rank (expert grid: etp = tp, ep = dp % EP)."""
        tp, dp, pp = rank % self.TP, (rank // self.TP) % self.DP, rank // (self.TP * self.DP)
        return tp, pp, dp, dp % self.EP


def key_of(name: str, mla: bool = False) -> tuple[str, list[int]]:
    """TP=1/PP=1 state-dict name -> (ShardedTensor key, index along its stacked axes). MLA's local
    spec keeps its layer norms' module names (no sharded_state_dict_keys_map)."""
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if not m:
        return name, []
    layer, rest = int(m.group(1)), m.group(2)
    if not mla:
        rest = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}.get(rest, rest)
    e = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$", rest)
    if e:
        return f"decoder.layers.mlp.experts.experts.{e.group(2)}", [layer, int(e.group(1))]
    return f"decoder.layers.{rest}", [layer]


def tp_rule(name: str) -> str:
    """How a weight is split over TP: 'col' (dim 0), 'row' (dim 1), 'fc1' (gate/up halves split
    separately), 'rep' (replicated)."""
    if re.search(r"(linear_qkv\.weight|word_embeddings\.weight|output_layer\.weight"
                 r"|linear_q_proj\.weight|linear_(q|kv)_(down|up)_proj\.weight)$", name):  # MLA: all column-parallel
        return "col"
    if re.search(r"experts\.local_experts\.\d+\.linear_fc1\.weight$", name) or name.endswith("mlp.linear_fc1.weight"):
        return "fc1"
    if re.search(r"(linear_proj\.weight|linear_fc2\.weight)$", name):
        return "row"
    return "rep"


def tp_local(name: str, full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """What TP rank ``r`` of ``tp`` holds of ``full``."""
    rule = tp_rule(name)
    if rule == "col":
        n = full.shape[0] // tp
        return full[r * n:(r + 1) * n]
    if rule == "row":
        n = full.shape[1] // tp
        return full[:, r * n:(r + 1) * n]
    if rule == "fc1":
        F = full.shape[0] // 2
        f = F // tp
        return torch.cat([full[r * f:(r + 1) * f], full[F + r * f:F + (r + 1) * f]])
    return full


def expected_model_chunks(name, shape, c: Cfg) -> list[tuple[tuple, tuple, tuple]]:
    """The chunk boxes (in the stacked key's coordinates), each with the (tp, pp[, ep]) of the
    ranks that hold it. Which DP replica's file it lands in is not fixed: with DP > 1 the default
    ``--ckpt-fully-parallel-save`` spreads replicated chunks over the DP ranks."""
    key, idx = key_of(name, c.mla)
    rule = tp_rule(name)
    pp = c.stage_of(idx[0]) if idx else (0 if name.startswith("embedding") else c.PP - 1)
    e = re.search(r"local_experts\.(\d+)\.", name)
    ep = int(e.group(1)) // (c.E // c.EP) if e else None
    out = []
    for r in (range(c.TP) if rule != "rep" else [None]):
        if rule == "col":
            n = shape[0] // c.TP
            boxes = [((r * n,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]))]
        elif rule == "row":
            n = shape[1] // c.TP
            boxes = [((0, r * n), (shape[0], n))]
        elif rule == "fc1":
            F, f = shape[0] // 2, shape[0] // 2 // c.TP
            boxes = [((r * f, 0), (f, shape[1])), ((F + r * f, 0), (f, shape[1]))]
        else:
            boxes = [((0,) * len(shape), tuple(shape))]
        for off, size in boxes:
            out.append((tuple(idx) + off, (1,) * len(idx) + size, (r, pp, ep)))
    return out


def holder_ok(rank: int, want: tuple, c: Cfg) -> bool:
    tp, pp, _dp, ep = c.coords(rank)
    wtp, wpp, wep = want
    return (wtp is None or tp == wtp) and pp == wpp and (wep is None or ep == wep)


# --- distributed optimizer buckets ---------------------------------------------------------


def stage_params(c: Cfg, pp: int, expert: bool = False, vp: int | None = None) -> list[str]:
    """TP=1 names of the parameters of pipeline stage ``pp`` (of its model chunk ``vp`` only, when
    given: a DDP buffer each) in module registration order (``model.parameters()``), dense or
    expert ones."""
    names = []
    if pp == 0 and not expert and vp in (None, 0):
        names.append("embedding.word_embeddings.weight")
    for i in (c.stage_layers(pp) if vp is None else c.chunk_layers(pp, vp)):
        p = f"decoder.layers.{i}."
        if not expert and c.mla:  # MLASelfAttention's registration order (docs §2.9)
            names += [p + "input_layernorm.weight"] + [f"{p}self_attention.{m}.weight" for m in (
                "linear_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                "q_layernorm", "kv_layernorm")] + [p + "pre_mlp_layernorm.weight"]
        elif not expert:
            names += [p + "input_layernorm.weight", p + "self_attention.linear_proj.weight",
                      p + "self_attention.linear_qkv.weight", p + "pre_mlp_layernorm.weight"]
        if c.E:
            if not expert:
                names.append(p + "mlp.router.weight")
            else:
                per = c.E // c.EP
                names += [f"{p}mlp.experts.local_experts.{e}.{w}" for e in range(per)
                          for w in ("linear_fc1.weight", "linear_fc2.weight")]
        elif not expert:
            names += [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    if pp == c.PP - 1 and not expert and vp in (None, c.VPP - 1):
        names += ["decoder.final_layernorm.weight", "output_layer.weight"]
    return names


def pad(x: int, m: int) -> int:
    return -(-x // m) * m


def bucket_layout(numels: list[tuple[str, int]], dp: int):
    """Megatron's layout of one buffer (single bucket): parameters in REVERSE registration
    order, each start rounded up to a multiple of 64; the bucket is padded at the end to a
    multiple of lcm(dp, 128). Returns ([(name, start, end)], numel_unpadded, numel_padded)."""
    out, pos = [], 0
    for name, n in reversed(numels):
        pos = pad(pos, 64)
        out.append((name, pos, pos + n))
        pos += n
    return out, pos, pad(pos, math.lcm(dp, 128))


def dp_reshardable_chunks(layout, unpadded, padded, dp):
    """The chunk boxes of a dp_reshardable bucket key: every parameter piece and every gap,
    cut at the DP shard boundaries k * padded / dp, nothing past ``unpadded``; with the DP rank
    that writes each."""
    shard = padded // dp
    cuts = sorted({0, unpadded} | {s for _, a, b in layout for s in (a, b)} |
                  {k * shard for k in range(1, dp) if k * shard < unpadded})
    return [((a,), (b - a,), a // shard) for a, b in zip(cuts, cuts[1:])]


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


class Report:
    def __init__(self, name):
        self.name, self.ok, self.fail = name, 0, []

    def check(self, cond, what):
        if cond:
            self.ok += 1
        else:
            self.fail.append(what)

    def equal(self, a, b, what):
        self.check(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b),
                   f"{what}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
                   + (f", max |diff| {float((a.float() - b.float()).abs().max()):.3g}" if a.shape == b.shape else ""))


def _oracle(fx: Path):
    from safetensors.torch import load_file

    o = fx / "oracle"
    model = load_file(str(o / "model.safetensors"))
    optim = load_file(str(o / "optimizer.safetensors")) if (o / "optimizer.safetensors").exists() else {}
    fwd = load_file(str(o / "forward.safetensors"))
    return model, optim, fwd, json.loads((o / "oracle.json").read_text())


def check_torch_dist(fx: Path, rep: Report):
    recipe = json.loads((fx / "fixture.json").read_text())
    it = fx / f"iter_{recipe['iteration']:07d}"
    ck = DistCheckpoint(it)
    rep.check(json.loads((it / "metadata.json").read_text()) ==
              {"sharded_backend": "torch_dist", "sharded_backend_version": 1}, "metadata.json")
    rep.check((fx / "latest_checkpointed_iteration.txt").read_text() == str(recipe["iteration"]),
              "latest_checkpointed_iteration.txt")
    common = ck.objects("common_state")
    rep.check(list(common) == ["shard_0_1"], f"common_state shards {list(common)}")
    common = common["shard_0_1"]
    c = Cfg(common["args"])
    model, optim, _fwd, oinfo = _oracle(fx)

    # model weights: name -> key/index rule, chunk boxes, files, values
    keys_seen = set()
    for name, t in model.items():
        key, idx = key_of(name, c.mla)
        rep.check(oinfo["names"][name] == [key, idx], f"{name}: key rule {key, idx} vs {oinfo['names'][name]}")
        keys_seen.add(key)
        got = sorted((o, s, r) for o, s, r in ck.chunks(key)
                     if all(o[j] == idx[j] for j in range(len(idx))))
        want = sorted(expected_model_chunks(name, tuple(t.shape), c))
        rep.check([g[:2] for g in got] == [w[:2] for w in want], f"{name}: chunks {got} vs documented {want}")
        if [g[:2] for g in got] == [w[:2] for w in want]:
            rep.check(all(holder_ok(g[2], w[2], c) for g, w in zip(got, want)),
                      f"{name}: held by ranks {[g[2] for g in got]}, documented (tp, pp, ep) {[w[2] for w in want]}")
        rep.equal(ck.full(key)[tuple(idx)], t, f"{name} (= {key}{idx})")
    model_keys = {k for k in ck.tensor_keys() if "optimizer." not in k}
    rep.check(model_keys == keys_seen, f"model keys {sorted(model_keys ^ keys_seen)}")

    # optimizer
    sharding = common["content_metadata"].get("distrib_optim_sharding_type")
    if not c.distopt or sharding == "fully_reshardable":
        for name in model:
            key, idx = key_of(name, c.mla)
            # plain Adam: exp_avg, exp_avg_sq; fully_reshardable: also "param" (the fp32 main
            # parameter); each chunked exactly as the model key
            for kind in ("exp_avg", "exp_avg_sq") + (("param",) if c.distopt else ()):
                okey = f"optimizer.state.{kind}.{key}"
                rep.check(okey in ck.md.state_dict_metadata, f"{okey} missing")
                if okey not in ck.md.state_dict_metadata:
                    continue
                want = optim[f"{kind}.{name}"]
                rep.equal(ck.full(okey)[tuple(idx)], want, okey + str(idx))
                rep.check(sorted(x[:2] for x in ck.chunks(okey)) == sorted(x[:2] for x in ck.chunks(key)),
                          f"{okey}: not chunked as {key}")
        extra = {k for k in ck.tensor_keys() if k.startswith("optimizer.")} - {
            f"optimizer.state.{kind}.{key_of(n, c.mla)[0]}" for n in model
            for kind in ("exp_avg", "exp_avg_sq") + (("param",) if c.distopt else ())}
        rep.check(not extra, f"unexplained optimizer keys {sorted(extra)}")
    else:
        check_buckets(ck, c, model, optim, rep)
    return c, common


def check_buckets(ck: DistCheckpoint, c: Cfg, model, optim, rep: Report):
    """dp_reshardable: per (TP, PP) rank m = tp + TP * pp, keys
    [chained_<i>.]optimizer.distributed.dp_group_idx_<m>.gbuf_idx_<g>.dtype_(<param>, <grad>).bucket_idx_<b>.<state>
    (``chained_0.`` / ``chained_1.`` = dense / expert optimizer when there are experts; the expert
    optimizer's m is the rank in the expert TP x EP x PP grid: here, the EP rank)."""
    dtype = str(c.buffer_dtype)
    jobs = []  # (prefix, m, names, tp, dp size, rank of (m, dp shard d), DDP buffer = model chunk)
    for pp in range(c.PP):
        for tp in range(c.TP):
            m = tp + c.TP * pp
            for vp in range(c.VPP):
                jobs.append(("chained_0." if c.E else "", m, stage_params(c, pp, vp=vp), tp, c.DP,
                             lambda d, tp=tp, pp=pp: c.rank(tp, pp, d), vp))
    if c.E:
        per = c.E // c.EP
        edp = c.DP // c.EP
        for pp in range(c.PP):
            for ep in range(c.EP):
                names = [re.sub(r"local_experts\.(\d+)\.", lambda mm: f"local_experts.{int(mm.group(1)) + ep * per}.", n)
                         for n in stage_params(c, pp, expert=True)]
                m = ep + c.EP * pp
                jobs.append(("chained_1.", m, names, 0, edp,
                             lambda d, ep=ep, pp=pp: c.rank(0, pp, ep + c.EP * d), 0))
    for prefix, m, names, tp, dp, rank_of, gbuf in jobs:
        numels = [(n, tp_local(n, model[n], c.TP, tp).numel()) for n in names]
        layout, unpadded, padded = bucket_layout(numels, dp)
        base = f"{prefix}optimizer.distributed.dp_group_idx_{m}.gbuf_idx_{gbuf}.dtype_{dtype}.bucket_idx_0"
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            key = f"{base}.{kind}"
            if key not in ck.md.state_dict_metadata:
                rep.check(False, f"{key} missing")
                continue
            got = sorted(ck.chunks(key))
            want = sorted((o, s, rank_of(d)) for o, s, d in dp_reshardable_chunks(layout, unpadded, padded, dp))
            rep.check(got == want, f"{key}: chunks {got[:4]}... vs documented {want[:4]}...")
            full = ck.full(key)
            rep.check(full.numel() == unpadded, f"{key}: size {full.numel()} vs {unpadded}")
            for name, a, b in layout:
                src = optim[f"{kind}.{name}"]  # "param": the fp32 main parameter
                rep.equal(full[a:b], tp_local(name, src, c.TP, tp).reshape(-1),
                          f"{key}[{a}:{b}] = {name} (tp {tp})")
                if kind == "param":  # the model weight is the main parameter cast to its dtype
                    rep.equal(tp_local(name, model[name], c.TP, tp).reshape(-1), full[a:b].to(model[name].dtype),
                              f"{name}: weight = main param cast to {model[name].dtype}")
        pre = f"{prefix}optimizer.distributed.dp_group_idx_{m}"
        pbn = ck.objects(f"{pre}.per_bucket_numel")["shard_0_1"]
        pbu = ck.objects(f"{pre}.per_bucket_numel_unpadded")["shard_0_1"]
        # one {dtypes: [numel]} per DDP buffer (model chunk)
        rep.check(len(pbn) == c.VPP and pbn[gbuf] == {c.buffer_dtype: [padded]}, f"{pre}.per_bucket_numel {pbn}")
        rep.check(len(pbu) == c.VPP and pbu[gbuf] == {c.buffer_dtype: [unpadded]},
                  f"{pre}.per_bucket_numel_unpadded {pbu}")
        groups = ck.objects(f"{pre}.optimizer")["shard_0_1"]["param_groups"]
        rep.check(all(g["step"] == 3.0 for g in groups), f"{pre}.optimizer steps {[g.get('step') for g in groups]}")
    want_keys = {f"{j[0]}optimizer.distributed.dp_group_idx_{j[1]}.gbuf_idx_{j[-1]}.dtype_{dtype}.bucket_idx_0.{k}"
                 for j in jobs for k in ("param", "exp_avg", "exp_avg_sq")}
    have = {k for k in ck.tensor_keys() if "optimizer" in k}
    rep.check(have == want_keys, f"bucket keys differ: {sorted(have ^ want_keys)}")


def check_legacy(fx: Path, rep: Report):
    recipe = json.loads((fx / "fixture.json").read_text())
    it = fx / f"iter_{recipe['iteration']:07d}"
    model, optim, _fwd, _oinfo = _oracle(fx)
    first = sorted(it.glob("mp_rank_*/model_optim_rng.pt"))[0]
    c = Cfg(restricted_load(first)["args"])
    pieces: dict[str, list] = {}
    # one state dict per model chunk: 'model', or 'model0', 'model1', ... with virtual stages
    mkeys = ["model"] if c.VPP == 1 else [f"model{v}" for v in range(c.VPP)]

    def global_name(pp: int, vp: int, k: str) -> str:
        start = c.chunk_layers(pp, vp).start
        return re.sub(r"^decoder\.layers\.(\d+)\.", lambda mm: f"decoder.layers.{int(mm.group(1)) + start}.", k)

    for pp in range(c.PP):
        for tp in range(c.TP):
            sub = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if c.PP > 1 else "")
            sd = restricted_load(it / sub / "model_optim_rng.pt")
            rep.check(sorted(sd) == sorted(["args", "checkpoint_version", "iteration", *mkeys, "optimizer",
                                           "opt_param_scheduler", "rng_state",
                                           "num_floating_point_operations_so_far"]), f"{sub}: keys {sorted(sd)}")
            rep.check(sd["checkpoint_version"] == 3.0 and sd["iteration"] == recipe["iteration"], f"{sub}: version")
            local_names = [(vp, k) for vp, mk in enumerate(mkeys) for k, v in sd[mk].items() if torch.is_tensor(v)]
            for mk in mkeys:
                for k, v in sd[mk].items():
                    if not torch.is_tensor(v):
                        rep.check(k.endswith("._extra_state") and v is None, f"{sub}: {k} = {v!r}")
            for vp, k in local_names:
                gname = global_name(pp, vp, k)
                t = sd[mkeys[vp]][k]
                pieces.setdefault(gname, []).append((tp, t))
                rep.equal(t, tp_local(gname, model[gname], c.TP, tp), f"{sub}:{mkeys[vp]}:{k}")
            # plain Adam: state index = position in [group 0 (weight decay) params..., group 1 (no wd)...],
            # each group's parameters chunk after chunk
            if not c.distopt:
                groups = sd["optimizer"]["param_groups"]
                order = list(local_names)
                wd = [n for n in order if not (n[1].endswith("layernorm.weight") or n[1].endswith(".bias"))]
                nowd = [n for n in order if n not in wd]
                rep.check([g["params"] for g in groups] == [list(range(len(wd))),
                                                            list(range(len(wd), len(wd) + len(nowd)))],
                          f"{sub}: param groups {[g['params'] for g in groups]}")
                for i, (vp, n) in enumerate(wd + nowd):
                    gname = global_name(pp, vp, n)
                    st = sd["optimizer"]["state"][i]
                    for kind in ("exp_avg", "exp_avg_sq"):
                        rep.equal(st[kind], tp_local(gname, optim[f"{kind}.{gname}"], c.TP, tp), f"{sub}: state {i} {kind} ({n})")
                    rep.check(float(st["step"]) == recipe["iteration"], f"{sub}: step {st['step']}")
            else:
                check_legacy_distopt(it / sub, c, pp, tp, model, optim, rep)
    for gname, ps in pieces.items():
        rep.check(sorted(t for t, _ in ps) == list(range(c.TP)) or tp_rule(gname) == "rep",
                  f"{gname}: tp pieces {[t for t, _ in ps]}")
    return c


def check_legacy_distopt(sub: Path, c: Cfg, pp, tp, model, optim, rep: Report):
    d = restricted_load(sub / "distrib_optim.pt")
    rep.check(d.get("buckets_coalesced") is True, f"{sub.name}/distrib_optim.pt: buckets_coalesced {d.get('buckets_coalesced')}")
    names = stage_params(c, pp)
    numels = [(n, tp_local(n, model[n], c.TP, tp).numel()) for n in names]
    layout, unpadded, padded = bucket_layout(numels, c.DP)
    buf = d[0][c.buffer_dtype]
    rep.check(sorted(buf) == ["exp_avg", "exp_avg_sq", "numel_unpadded", "param"], f"distrib_optim keys {sorted(buf)}")
    rep.check(buf["numel_unpadded"] == unpadded, f"numel_unpadded {buf['numel_unpadded']} vs {unpadded}")
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        flat = buf[kind]
        rep.check(flat.numel() == unpadded, f"distrib_optim {kind}: {flat.numel()} vs unpadded {unpadded} (padded {padded})")
        for name, a, b in layout:
            src = optim[f"{kind}.{name}"]
            rep.equal(flat[a:b], tp_local(name, src, c.TP, tp).reshape(-1), f"distrib_optim {kind}[{a}:{b}] = {name}")


# --- the Hugging Face forward check ------------------------------------------------------------


def megatron_to_hf(model: dict, c: Cfg) -> dict:
    """TP=1 Megatron GPT weights -> Hugging Face Llama / Mixtral names."""
    out = {"model.embed_tokens.weight": model["embedding.word_embeddings.weight"],
           "model.norm.weight": model["decoder.final_layernorm.weight"],
           "lm_head.weight": model["output_layer.weight"]}
    for i in range(c.L):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[q + "self_attn.o_proj.weight"] = model[p + "self_attention.linear_proj.weight"]
        if c.mla:  # DeepseekV3: one for one (rows per head [nope; rope], [nope; v]; rope part interleaved alike)
            for hf, mg in (("q_a_proj", "linear_q_down_proj"), ("q_b_proj", "linear_q_up_proj"),
                           ("q_a_layernorm", "q_layernorm"), ("kv_a_proj_with_mqa", "linear_kv_down_proj"),
                           ("kv_b_proj", "linear_kv_up_proj"), ("kv_a_layernorm", "kv_layernorm")):
                out[f"{q}self_attn.{hf}.weight"] = model[f"{p}self_attention.{mg}.weight"]
        else:
            qkv = model[p + "self_attention.linear_qkv.weight"].view(c.G, c.hpg + 2, c.d, c.H)
            out[q + "self_attn.q_proj.weight"] = qkv[:, :c.hpg].reshape(c.G * c.hpg * c.d, c.H)
            out[q + "self_attn.k_proj.weight"] = qkv[:, c.hpg].reshape(c.G * c.d, c.H)
            out[q + "self_attn.v_proj.weight"] = qkv[:, c.hpg + 1].reshape(c.G * c.d, c.H)
        if c.qk_norm and not c.mla:  # Qwen3: q_norm / k_norm over the head dim, as Megatron's q/k_layernorm
            out[q + "self_attn.q_norm.weight"] = model[p + "self_attention.q_layernorm.weight"]
            out[q + "self_attn.k_norm.weight"] = model[p + "self_attention.k_layernorm.weight"]
        out[q + "input_layernorm.weight"] = model[p + "input_layernorm.weight"]
        out[q + "post_attention_layernorm.weight"] = model[p + "pre_mlp_layernorm.weight"]
        if c.E:
            # transformers 5 Mixtral: fused experts; gate_up_proj[e] = [gate; up] = Megatron's fc1
            out[q + "mlp.gate.weight"] = model[p + "mlp.router.weight"]
            out[q + "mlp.experts.gate_up_proj"] = torch.stack(
                [model[f"{p}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(c.E)])
            out[q + "mlp.experts.down_proj"] = torch.stack(
                [model[f"{p}mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in range(c.E)])
        else:
            fc1 = model[p + "mlp.linear_fc1.weight"]
            out[q + "mlp.gate_proj.weight"] = fc1[:c.F]
            out[q + "mlp.up_proj.weight"] = fc1[c.F:]
            out[q + "mlp.down_proj.weight"] = model[p + "mlp.linear_fc2.weight"]
    return out


def check_hf_forward(fx: Path, c: Cfg, args, rep: Report):
    try:
        import transformers
    except ImportError:
        print(f"  {fx.name}: transformers not importable, HF forward check skipped")
        return
    model, _optim, fwd, _ = _oracle(fx)
    common = dict(vocab_size=c.V, hidden_size=c.H, num_hidden_layers=c.L, num_attention_heads=c.heads,
                  num_key_value_heads=c.G, head_dim=c.d, rms_norm_eps=c.eps,
                  max_position_embeddings=args.max_position_embeddings, tie_word_embeddings=False,
                  attention_bias=False, rope_theta=float(c.rope_base))
    if c.mla and (c.E or not c.qk_norm):
        print(f"  {fx.name}: MLA with experts or without latent norms: no HF forward check here (no DeepseekV3 "
              "config computes it)")
        return
    if c.mla:
        common.update(num_key_value_heads=c.heads, q_lora_rank=c.q_lora, kv_lora_rank=c.kv_lora,
                      qk_nope_head_dim=c.qk_head, qk_rope_head_dim=c.rope, v_head_dim=c.v_head, rope_interleave=True,
                      first_k_dense_replace=c.L, n_routed_experts=1, n_shared_experts=0, num_experts_per_tok=1,
                      n_group=1, topk_group=1)
        common.pop("head_dim")
        cfg = transformers.DeepseekV3Config(intermediate_size=c.F, **common)
        hf = transformers.DeepseekV3ForCausalLM(cfg)
    elif c.E:
        cfg = transformers.MixtralConfig(intermediate_size=c.Fe, num_local_experts=c.E,
                                         num_experts_per_tok=args.moe_router_topk, **common)
        hf = transformers.MixtralForCausalLM(cfg)
    elif c.qk_norm:
        cfg = transformers.Qwen3Config(intermediate_size=c.F, **common)
        hf = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(intermediate_size=c.F, mlp_bias=False, **common)
        hf = transformers.LlamaForCausalLM(cfg)
    sd = megatron_to_hf(model, c)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    rep.check(not missing and not unexpected, f"HF load: missing {missing} unexpected {unexpected}")
    hf.eval()
    with torch.no_grad():
        logits = hf(fwd["input_ids"]).logits
    diff = float((logits - fwd["logits"].float()).abs().max())
    tol = 1e-4 if c.params_dtype == torch.float32 else 5e-2  # Megatron ran its forward in bf16
    rep.check(diff < tol, f"HF logits vs Megatron forward: max |diff| {diff:.3g}")
    print(f"  {fx.name}: HF {type(hf).__name__} logits vs Megatron's forward: max |diff| {diff:.2e}")


# --- a minimal writer, read back by Megatron ---------------------------------------------------


def rewrite_one_chunk(src_save: Path, dst_save: Path, iteration: int) -> None:
    """Rewrite a torch_dist checkpoint the simplest way the document allows: every tensor key as
    ONE chunk (the full tensor), everything in ``__0_0.distcp`` (objects first, then tensors),
    object records copied as they are, a ``.metadata`` without ``all_local_plans``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    src = DistCheckpoint(src_save / f"iter_{iteration:07d}")
    out_dir = dst_save / f"iter_{iteration:07d}"
    out_dir.mkdir(parents=True)
    sdm, storage, pos = {}, {}, 0
    with open(out_dir / "__0_0.distcp", "wb") as f:
        for key, meta in src.md.state_dict_metadata.items():  # objects
            if not hasattr(meta, "chunks"):
                rec = src._record(key, None)
                sdm[key] = BytesStorageMetadata()
                storage[MetadataIndex(key, None)] = _StorageInfo("__0_0.distcp", pos, len(rec))
                f.write(rec)
                pos += len(rec)
        for key, meta in src.md.state_dict_metadata.items():  # tensors, one chunk each
            if hasattr(meta, "chunks"):
                full = src.full(key)
                buf = io.BytesIO()
                torch.save(full, buf)
                rec = buf.getvalue()
                zero = torch.Size([0] * full.dim())
                sdm[key] = TensorStorageMetadata(TensorProperties(dtype=full.dtype), torch.Size(full.shape),
                                                 [ChunkStorageMetadata(zero, torch.Size(full.shape))])
                storage[MetadataIndex(key, zero)] = _StorageInfo("__0_0.distcp", pos, len(rec))
                f.write(rec)
                pos += len(rec)
    md = Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=str(out_dir)), version="1.0.0")
    with open(out_dir / ".metadata", "wb") as f:
        pickle.dump(md, f)
    (out_dir / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    (dst_save / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def writer_check(fx: Path, venv: Path, rep: Report):
    """Rewrite with :func:`rewrite_one_chunk`, reload with Megatron (scripts/megatron_oracle.py
    at the oracle's topology) and compare with the oracle."""
    import subprocess
    import tempfile

    from safetensors.torch import load_file

    recipe = json.loads((fx / "fixture.json").read_text())
    info = json.loads((fx / "oracle" / "oracle.json").read_text())
    with tempfile.TemporaryDirectory(prefix="megatron-writer-check-") as tmp:
        dst, out = Path(tmp) / "ckpt", Path(tmp) / "oracle"
        dst.mkdir()
        rewrite_one_chunk(fx, dst, recipe["iteration"])
        t = info["topology"]
        cmd = [str(venv / "bin" / "python"), str(REPO / "scripts" / "megatron_oracle.py"), str(dst), "--out", str(out),
               "--venv", str(venv), "--tp", str(t["tp"]), "--pp", str(t["pp"]), "--dp", str(t["dp"]), "--ep", str(t["ep"])]
        if not info["optimizer_loaded"]:
            cmd.append("--no-optim")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rep.check(proc.returncode == 0, f"Megatron could not load the rewritten checkpoint: {proc.stdout[-2000:]}")
        if proc.returncode != 0:
            return
        for name in ["model.safetensors"] + (["optimizer.safetensors"] if info["optimizer_loaded"] else []):
            a, b = load_file(str(fx / "oracle" / name)), load_file(str(out / name))
            rep.check(set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a),
                      f"rewritten checkpoint reloads differently ({name})")
        print(f"  {fx.name}: rewritten as one chunk per key in one file: Megatron reloads it identically")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fixtures", type=Path, default=FIXTURES)
    p.add_argument("--only", action="append", default=[])
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--writer-check", type=Path, metavar="MEGATRON_VENV",
                   help="also rewrite each torch_dist fixture as one chunk per key in one file and have "
                        "Megatron (from this venv) reload it (opt-in: needs the Megatron venv)")
    opts = p.parse_args(argv)
    bad = 0
    for fx in sorted(d for d in opts.fixtures.iterdir() if (d / "fixture.json").exists()):
        if opts.only and fx.name not in opts.only:
            continue
        rep = Report(fx.name)
        recipe = json.loads((fx / "fixture.json").read_text())
        unruled = [f for f in ("--moe-layer-freq", "--moe-shared-expert-intermediate-size", "--overlap-grad-reduce",
                               "--mtp-num-layers") if f in recipe["mlm_argv"]]
        # per-layer keys, shared experts, expert TP apart, several DDP buckets, MTP layers: in reshard's reader
        # (checked against Megatron's reload), not in these rules yet
        if unruled:
            print(f"{fx.name}: skipped ({', '.join(unruled)}: not in this verifier's rules; tests/formats/megatron "
                  "compares reshard's reading of it with Megatron's reload)")
            continue
        if recipe["format"] == "megatron-torch_dist":
            c, common = check_torch_dist(fx, rep)
            args = common["args"]
        else:
            c = check_legacy(fx, rep)
            first = sorted((fx / f"iter_{recipe['iteration']:07d}").glob("mp_rank_*/model_optim_rng.pt"))[0]
            args = restricted_load(first)["args"]
        if not opts.no_hf:
            check_hf_forward(fx, c, args, rep)
        if opts.writer_check and recipe["format"] == "megatron-torch_dist":
            writer_check(fx, opts.writer_check, rep)
        status = "ok" if not rep.fail else f"{len(rep.fail)} FAILED"
        print(f"{fx.name}: {rep.ok} checks passed, {status}")
        for f in rep.fail[:20]:
            print(f"    - {f}")
        bad += bool(rep.fail)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
