"""The conformance suite: every reader to every writer, one engine.

For each source fixture (written by its framework) and each target format, the output is read back
by the *target framework's own reader* and compared, tensor for tensor and bit for bit, with the
*source framework's own consolidation* of the source: weights, and both Adam moments wherever both
ends hold them. A route that cannot hold is a row asserting its refusal, before anything exists. The
other contracts every route keeps are tested once for all writers: a target a source cannot be
written as is refused naming what is missing; a failure midway leaves nothing; workers write the
same files as one process; a DeepSpeed checkpoint written at another topology and back is its source.

Readers of the target: ``torch.load(weights_only=True)`` of universal files, ``safetensors.load_file``,
torch's ``dcp_to_torch_save``, DeepSpeed's ``ds_to_universal``, ``transformers``' ``from_pretrained``,
torch's DCP ``load`` of a Megatron ``torch_dist`` folder's tensors, the safetensors files of vLLM's
sharded state (unfused here as vLLM fuses them). Consolidations of the source: DeepSpeed's
``ds_to_universal``, the universal files themselves, ``dcp_to_torch_save``, ``safetensors.load_file``,
the live model and moments the HF Trainer and Accelerate fixtures recorded at save time (weights of
the Accelerate one: ``dcp_to_torch_save`` of its model folder, as Accelerate's ``merge_fsdp_weights``),
Megatron's own TP=1 reload (``oracle/``). Hugging Face names and Megatron's keys are compared in
Megatron's (q/k/v per query group, gate/up fused, layers stacked, the valid vocabulary rows); a
Megatron MoE source's oracle (DeepSeek-V3, Qwen3-MoE) is cut into Hugging Face names by its mapping
document instead, states and expert bias included.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from reshard.errors import OutputError, ReshardError
from reshard.jobs.convert import convert, reshard
from reshard.storage.safe_load import load
from tests.support.compare import assert_same_as_ds_to_universal, same_strict
from tests.support.dsconv import ds_to_universal_folder
from tests.support.paths import DCP, DEEPSPEED, HF, MEGATRON

MOMENTS = ("exp_avg", "exp_avg_sq")
TARGETS = ("ucp", "safetensors", "dcp", "hf", "deepspeed", "megatron", "vllm")
# what a target holds of the source: weights only (no optimizer state)
WEIGHTS_ONLY = ("safetensors", "hf", "vllm")
LLAMA = (4, 2, 6)  # (attention heads, query groups, head dim) of the HF llama fixtures
MEGATRON_GPT = (4, 2, 10)  # of the Megatron fixtures
ACCELERATE = HF / "accelerate_fsdp_llama"

# source name -> (kind, path, geometry, options its hf/vllm targets take)
SOURCES = {
    "deepspeed-autotp-zero1": ("deepspeed", DEEPSPEED / "llama_tp2_dp2", None, {}),
    "deepspeed-zero3": ("deepspeed", DEEPSPEED / "llama_zero3_dp2", None, {}),
    "deepspeed-autoep": ("deepspeed", DEEPSPEED / "mixtral_autoep_ep2", None, {}),
    "deepspeed-tp-pp": ("deepspeed", DEEPSPEED / "tp_pipe_tp2_pp2", None, {}),
    "deepspeed-zero3-tp": ("deepspeed", DEEPSPEED / "llama_zero3_tp2_dp2", None, {}),
    "deepspeed-autoep-zero3": ("deepspeed", DEEPSPEED / "mixtral_autoep_ep2_zero3", None, {}),
    "deepspeed-autoep-edp": ("deepspeed", DEEPSPEED / "mixtral_autoep_ep2_dp4", None, {}),
    "universal": ("universal", DEEPSPEED / "llama_zero1_dp2", None, {}),  # DeepSpeed's ds_to_universal of it
    "dcp-fsdp2": ("dcp", DCP / "llama_fsdp2_ws2", None, {}),
    "hf-sharded": ("hf", HF / "pretrained_llama_sharded", LLAMA, {}),
    "hf-trainer": ("trainer", HF / "trainer_llama_zero2" / "checkpoint-3", LLAMA, {}),
    "accelerate": ("accelerate", ACCELERATE / "checkpoint-3", LLAMA, {"hf_config": ACCELERATE / "hf_files"}),
    "megatron-torch-dist": ("megatron", MEGATRON / "torch_dist_tp2_dp2_distopt", MEGATRON_GPT, {}),
    "megatron-legacy": ("megatron", MEGATRON / "legacy_tp2_pp2", MEGATRON_GPT, {}),
    # DeepSeek-V3 MoE (MLA, TP2 x EP2 x expert TP1, a shared expert, the router's expert bias): no geometry, its
    # HF names are Megatron's oracle cut by the mapping document (_documented)
    "megatron-deepseek-v3": ("megatron", MEGATRON / "torch_dist_deepseek_v3_tp2_ep2", None, {}),
    # Qwen3-MoE (TP2 x EP2 x expert TP1, QK layer norms, a dense layer among MoE ones)
    "megatron-qwen3-moe": ("megatron", MEGATRON / "torch_dist_moe_tp2_ep2_qk_layernorm", None, {}),
}
NO_CONFIG = r"no config.json beside the checkpoint and the source does not record its architecture; pass --hf-config"
NOT_MEGATRON = r"a Megatron-Core checkpoint is written from a Megatron-Core checkpoint or a Hugging Face safetensors folder"
NO_MEGATRON_CONFIG = r"a Megatron target from .* needs the model's Hugging Face config.json .*--hf-config"
# (source, target) -> the refusal of a route that cannot hold: a DeepSpeed, universal or DCP checkpoint
# records no HF config; Megatron is written from Megatron, an HF folder, or DCP / universal / DeepSpeed given --hf-config
# (AutoEP's experts read back in HF names: tests/formats/deepspeed/test_autoep_to_megatron.py)
REFUSED = {
    **{(s, t): NO_CONFIG for s, (k, _, _, _) in SOURCES.items() if k in ("deepspeed", "universal", "dcp")
       for t in ("hf", "vllm")},
    **{(s, "megatron"): NO_MEGATRON_CONFIG if k in ("dcp", "universal", "deepspeed", "trainer") else NOT_MEGATRON
       for s, (k, _, _, _) in SOURCES.items() if k not in ("hf", "megatron")},
    # Accelerate saves a config without "architectures"; vLLM's writer takes the architecture from there
    ("accelerate", "vllm"): r"architecture \['llama'\] -- --format vllm writes LlamaForCausalLM",
    # vLLM's writer fuses dense Llama / Qwen2 layers only
    ("megatron-deepseek-v3", "vllm"): r"architecture \['DeepseekV3ForCausalLM'\] -- --format vllm writes",
    ("megatron-qwen3-moe", "vllm"): r"architecture \['Qwen3MoeForCausalLM'\] -- --format vllm writes",
}
ROUTES = [(s, t) for s in SOURCES for t in TARGETS if (s, t) not in REFUSED]
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight", "model.embed_tokens.weight", "lm_head.weight")

Tensors = dict[str, dict[str, torch.Tensor]]  # {name: {"weight": F, "exp_avg": ..., "exp_avg_sq": ...}}


# -- consolidations and target readers -------------------------------------------------------------------


def _universal_tensors(folder: Path, shapes: dict[str, tuple[int, ...]] | None = None) -> Tensors:
    """A universal folder's tensors by parameter and state (``weight`` its fp32.pt)."""
    out = {}
    for d in sorted(p for p in (folder / "zero").iterdir() if p.is_dir()):
        states = {}
        for state, file in (("weight", "fp32"), *((m, m) for m in MOMENTS)):
            f = d / f"{file}.pt"
            if f.is_file():
                obj = load(f, mmap=False)
                t = obj["param"] if isinstance(obj, dict) else obj
                flat = shapes and d.name in shapes and t.dim() == 1 and t.numel() == math.prod(shapes[d.name])
                states[state] = t.reshape(shapes[d.name]) if flat else t
        out[d.name] = states
    return out


def _dcp_tensors(folder: Path, tmp: Path) -> Tensors:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp / "whole.pt")
    sd = torch.load(tmp / "whole.pt", weights_only=True)
    model, state = sd.get("model", sd), (sd.get("optim") or {}).get("state", {})
    return {n: {"weight": w, **{m: state[n][m] for m in MOMENTS if m in state.get(n, {})}} for n, w in model.items()}


def _safetensors_tensors(folder: Path) -> Tensors:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    out = {}
    for f in files:
        out.update({n: {"weight": t} for n, t in load_file(folder / f).items()})
    moments = folder / "zero"
    if moments.is_dir():
        for n, states in _universal_tensors(folder).items():
            out[n].update({m: states[m] for m in MOMENTS if m in states})
    return out


def _recorded(files: dict[str, Path]) -> Tensors:
    """Tensors a fixture's job recorded at save time, one safetensors file per state."""
    from safetensors.torch import load_file

    out: Tensors = {}
    for state, f in files.items():
        for n, t in load_file(f).items():
            out.setdefault(n, {})[state] = t
    return out


def _megatron_oracle(path: Path) -> Tensors:
    """Megatron's own TP=1 reload of the fixture, stacked into its checkpoint keys (``oracle.json``
    names the key and index of every layer's tensor)."""
    from safetensors.torch import load_file

    o = path / "oracle"
    model, info = load_file(o / "model.safetensors"), json.loads((o / "oracle.json").read_text())
    optim = load_file(o / "optimizer.safetensors") if (o / "optimizer.safetensors").is_file() else {}
    out: Tensors = {}
    for name, (key, idx) in info["names"].items():
        for state, prefix in (("weight", ""), *((m, f"{m}.") for m in MOMENTS)):
            t = model[name] if state == "weight" else optim.get(prefix + name)
            if t is None:
                continue
            full = out.setdefault(key, {}).setdefault(state, t.new_empty(info["key_shapes"][key]))
            full[tuple(idx)] = t
    return out


def _hf_tensors(folder: Path) -> Tensors:
    """The weights ``transformers`` loads from an HF folder (the model's own state dict)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    return {n: {"weight": t} for n, t in model.state_dict().items() if "rotary" not in n}


def _megatron_tensors(out: Path) -> Tensors:
    """Every tensor of a Megatron ``torch_dist`` iteration, read by torch's DCP loader (Megatron's
    objects are left unread): its weights, and its moments where held in model space (plain Adam)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    it = next(out.rglob(".metadata")).parent
    md = dcp.FileSystemReader(it).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()
          if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.distributed.")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(it), no_dist=True)
    got: Tensors = {}
    for k, t in sd.items():
        state, key = next(((m, k[len(f"optimizer.state.{m}."):]) for m in MOMENTS
                           if k.startswith(f"optimizer.state.{m}.")), ("weight", k))
        got.setdefault(key, {})[state] = t
    return got


def _vllm_tensors(out: Path) -> Tensors:
    """vLLM's sharded state at TP 1 (``convert --format vllm``'s default), unfused into HF names:
    ``qkv_proj`` = [q; k; v], ``gate_up_proj`` = [gate; up] (``tests/support/vllm_ref.py``)."""
    from safetensors.torch import load_file

    cfg = json.loads((out / "config.json").read_text())
    h, g = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // h
    got: Tensors = {}
    for f in sorted(out.glob("model-rank-*-part-*.safetensors")):
        assert f.name.startswith("model-rank-0-"), f.name  # TP 1: one rank
        for n, t in load_file(f).items():
            if ".attn._" in n:  # vLLM's attention scales (1.0 unless quantized), no source tensor
                assert t.shape == () and t.item() == 1.0, n
            elif n.endswith("qkv_proj.weight"):
                for part, x in zip(("q", "k", "v"), t.split([h * d, g * d, g * d])):
                    got[n.replace("qkv_proj", f"{part}_proj")] = {"weight": x}
            elif n.endswith("gate_up_proj.weight"):
                for part, x in zip(("gate", "up"), t.chunk(2)):
                    got[n.replace("gate_up_proj", f"{part}_proj")] = {"weight": x}
            else:  # the vocabulary's padding rows are vLLM's, no source row
                got[n] = {"weight": t[:cfg["vocab_size"]] if n in _VOCAB else t}
    return got


def _to_megatron(tensors: Tensors, geometry: tuple[int, int, int]) -> Tensors:
    """HF Llama names as Megatron-Core's keys: q/k/v interleaved per query group, gate and up
    concatenated, the layers stacked along a first axis (Megatron's own layout)."""
    h, g, d = geometry
    layers = sorted({int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")})
    out: Tensors = {}

    def put(key: str, parts) -> None:
        states = set.intersection(*(set(tensors[f"model.layers.{i}.{p}"]) for i in layers for p in parts))
        for s in states:
            def one(i: int) -> torch.Tensor:
                ts = [tensors[f"model.layers.{i}.{p}"][s] for p in parts]
                if len(ts) == 3:  # q, k, v
                    q, k, v = ts[0].view(g, h // g * d, -1), ts[1].view(g, d, -1), ts[2].view(g, d, -1)
                    return torch.cat([q, k, v], 1).reshape(-1, q.shape[-1])
                return torch.cat(ts)
            out.setdefault(key, {})[s] = torch.stack([one(i) for i in layers])

    put("decoder.layers.self_attention.linear_qkv.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                             "self_attn.v_proj.weight"))
    put("decoder.layers.self_attention.linear_proj.weight", ("self_attn.o_proj.weight",))
    put("decoder.layers.mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))
    put("decoder.layers.mlp.linear_fc2.weight", ("mlp.down_proj.weight",))
    put("decoder.layers.self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",))
    put("decoder.layers.mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",))
    for hf, key in (("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
                    ("lm_head.weight", "output_layer.weight"), ("model.norm.weight", "decoder.final_layernorm.weight")):
        out[key] = tensors[hf]
    return out


def _documented(tensors: Tensors, fixture: Path) -> Tensors:
    """Megatron keys as Hugging Face names by the fixture's mapping document (``hfmap.hf_params``:
    each name's blocks of its key, the valid vocabulary rows), for every state the keys hold: no
    code per name, so MoE, MLA and shared experts too. The document itself is checked against
    ``from_pretrained`` and the logits (tests/formats/megatron/test_hf_*.py)."""
    from reshard.formats.megatron.hfmap import hf_params
    from reshard.formats.megatron.reader import MegatronReader

    out: Tensors = {}
    for p in hf_params(MegatronReader.open(fixture).arch):
        for state, full in tensors[p.key].items():
            t = full.new_zeros(p.shape)
            for b in p.blocks:
                src = full[tuple(slice(s, s + n) for s, n in zip(b.start, b.size))].reshape(b.size[b.fixed:])
                t[tuple(slice(h, h + n) for h, n in zip(b.hf_start, b.size[b.fixed:]))] = src
            out.setdefault(p.name, {})[state] = t[tuple(slice(0, n) for n in p.valid)]
    return out


def _megatron_keyed(tensors: Tensors) -> bool:
    return any(n.startswith(("decoder.", "embedding.")) for n in tensors)


@functools.cache
def _source_universal(name: str, root: Path) -> Path:
    """DeepSpeed's own ds_to_universal of a DeepSpeed fixture (made once per session)."""
    return ds_to_universal_folder(SOURCES[name][1], root / name)


def _consolidated(name: str, root: Path) -> Tensors:
    kind, path, _, _ = SOURCES[name]
    if kind in ("deepspeed", "universal"):
        return _universal_tensors(_source_universal(name, root), _shapes(path) if kind == "deepspeed" else None)
    if kind == "dcp":
        return _dcp_tensors(path, root)
    if kind == "trainer":  # the live model and its moments at save time (fp32: the masters)
        ref = path.parent / "reference" / path.name
        return _recorded({"weight": ref / "model.safetensors", **{m: ref / f"{m}.safetensors" for m in MOMENTS}})
    if kind == "accelerate":
        (root / name).mkdir(exist_ok=True)
        weights = _dcp_tensors(path / "pytorch_model_fsdp_0", root / name)
        moments = _recorded({m: path.parent / "reference" / f"{m}.safetensors" for m in MOMENTS})
        return {n: {**s, **moments.get(n, {})} for n, s in weights.items()}
    if kind == "megatron":
        return _megatron_oracle(path)
    return _safetensors_tensors(path)


def _shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """F's shape of every parameter of a ZeRO-3 job, whose universal files hold the parameters without
    TP or experts flat: the ``param_shapes`` its model states record (full shapes for those)."""
    tag = ckpt / (ckpt / "latest").read_text().strip()
    files = sorted(tag.glob("zero_pp_rank_0_mp_rank_00_model_states.pt"))
    if not files:
        return {}
    groups = load(files[0])["param_shapes"]
    return {n: tuple(s) for g in (groups if isinstance(groups, list) else [groups]) for n, s in g.items()}


def _source_path(name: str | Path, root: Path) -> Path:
    if isinstance(name, Path):
        return name
    kind, path, _, _ = SOURCES[name]
    return _source_universal(name, root).parent if kind == "universal" else path


def _read_target(fmt: str, out: Path, tmp: Path, shapes: dict[str, tuple[int, ...]]) -> Tensors:
    if fmt == "ucp":
        return _universal_tensors(out, shapes)
    if fmt == "safetensors":
        return _safetensors_tensors(out)
    if fmt == "dcp":
        return _dcp_tensors(out, tmp)
    if fmt == "hf":
        return _hf_tensors(out)
    if fmt == "megatron":
        return _megatron_tensors(out)
    if fmt == "vllm":
        return _vllm_tensors(out)
    return _universal_tensors(ds_to_universal_folder(out, tmp / "ds"), shapes)


def _write(source: str, target: str, src: Path, out: Path) -> Path:
    options = SOURCES[source][3] if target in ("hf", "vllm") else {}
    if target == "deepspeed":
        return reshard(src, out, to="deepspeed", tp=1, dp=2).out_dir
    if target == "megatron":
        return reshard(src, out, to="megatron", ckpt_format="torch_dist").out_dir
    return convert(src, out, fmt=target, **options).out_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("routes")


def _needs(source: str, target: str) -> None:
    """DeepSpeed's own tools are the reader or the consolidation of DeepSpeed routes only."""
    if target == "deepspeed" or SOURCES[source][0] in ("deepspeed", "universal"):
        pytest.importorskip("deepspeed")


def _same_tensor(have: torch.Tensor, want: torch.Tensor, where: tuple) -> None:
    if have.shape != want.shape and where[0] in _VOCAB and have.shape[1:] == want.shape[1:]:
        rows = min(have.shape[0], want.shape[0])  # a padded vocabulary: the rows both hold
        have, want = have[:rows], want[:rows]
    assert have.shape == want.shape, (*where, have.shape, want.shape)
    if have.dtype != want.dtype:  # widened (a bf16 source's weights in fp32 files): exact
        assert have.dtype.itemsize > want.dtype.itemsize, (*where, have.dtype, want.dtype)
        want = want.to(have.dtype)
    assert torch.equal(have.contiguous().view(torch.uint8) if have.is_floating_point() else have,
                       want.contiguous().view(torch.uint8) if want.is_floating_point() else want), where


@pytest.mark.parametrize("source,target", ROUTES, ids=[f"{s}-to-{t}" for s, t in ROUTES])
def test_every_route_gives_the_source_frameworks_tensors(source: str, target: str, root: Path, tmp_path: Path):
    _needs(source, target)
    ref = _consolidated(source, root)
    shapes = {n: tuple(s["weight"].shape) for n, s in ref.items()}
    out = _write(source, target, _source_path(source, root), tmp_path / "out")
    got = _read_target(target, out, tmp_path, shapes)
    if _megatron_keyed(got) != _megatron_keyed(ref):  # one end in HF names, the other in Megatron's keys
        geometry = SOURCES[source][2]
        if geometry is None:  # a Megatron MoE source written in HF names: its oracle in them too
            ref = _documented(ref, SOURCES[source][1])
        else:
            got, ref = (got, _to_megatron(ref, geometry)) if _megatron_keyed(got) else (_to_megatron(got, geometry), ref)
    assert sorted(got) == sorted(ref), (sorted(set(got) ^ set(ref)))
    # Megatron's distributed optimizer keeps moments in flat buckets, which torch's reader reads as such
    bucketed = target == "megatron" and not any(m in s for s in got.values() for m in MOMENTS)
    for name, states in ref.items():
        for state, want in states.items():
            if state not in got[name]:
                assert state in MOMENTS and (target in WEIGHTS_ONLY or bucketed), (name, state)  # weights only
                continue
            _same_tensor(got[name][state], want, (name, state))
        if target in ("dcp", "deepspeed", "ucp"):  # a fresh optimizer's moments where the source has none
            for m in MOMENTS:
                if m in got[name] and m not in states:
                    assert not got[name][m].any(), (name, m)


@pytest.mark.parametrize("source,target", list(REFUSED), ids=[f"{s}-to-{t}" for s, t in REFUSED])
def test_routes_that_cannot_hold_are_refused_before_anything_exists(source: str, target: str, root: Path,
                                                                    tmp_path: Path):
    if SOURCES[source][0] == "universal":
        pytest.importorskip("deepspeed")
    with pytest.raises(ReshardError, match=REFUSED[source, target]):
        _write(source, target, _source_path(source, root), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_megatron_names_in_safetensors_are_megatrons_reload(tmp_path: Path):
    """``--names megatron``: a Megatron MoE checkpoint's safetensors keep Megatron's keys."""
    out = convert(MEGATRON / "torch_dist_moe_ep2", tmp_path, fmt="safetensors", names="megatron").out_dir
    got, want = _safetensors_tensors(out), _megatron_oracle(MEGATRON / "torch_dist_moe_ep2")
    assert sorted(got) == sorted(want)
    for name, states in want.items():
        _same_tensor(got[name]["weight"], states["weight"], (name, "weight"))


# -- refusals: named, and before anything exists ----------------------------------------------------------


# (source, target, options, message): a SOURCES name, or a fixture (classic MoE: ds_to_universal does not
# read it, or at TP 2 merges its experts wrongly, so it is no route's source here; tests/formats/deepspeed/
# test_moe*.py compare it with DeepSpeed's own consolidation otherwise)
REFUSALS = [
    ("dcp-fsdp2", "deepspeed", {"tp": 2}, r"does not record how its parameters split over TP ranks.*--layout"),
    ("hf-sharded", "deepspeed", {"pp": 2}, r"--pp 2 is refused from a Hugging Face .*: a DeepSpeed pipeline "
     r"\(deepspeed.pipe\) target is written only from a DeepSpeed pipeline checkpoint"),
    ("dcp-fsdp2", "deepspeed", {"ep": 2}, r"--ep 2 is refused from a PyTorch DCP checkpoint: it holds no fused "
     r"expert layers \(DeepSpeed AutoEP's ds_autoep_layers, or in Hugging Face names.*Without --ep DeepSpeed is "
     r"written at --tp/--dp/--zero-stage, every parameter \(experts included\) a dense one"),
    ("universal", "deepspeed", {"ep": 2}, r"--ep 2 is refused from a universal checkpoint: it holds no fused "
     r"expert layers"),
    ("deepspeed-zero3", "deepspeed", {"pp": 2}, r"PP=1"),
    ("universal", "dcp", {"files": 2, "tp": 2}, r"--tp goes with --to deepspeed or --to megatron or --format vllm, not with a "
     r"PyTorch DCP checkpoint \(the target\)"),
    ("hf-sharded", "ucp", {"rename": ["a=b"]}, r"--rename goes with --format dcp"),
    ("dcp-fsdp2", "ucp", {"with_optimizer": True}, r"--with-optimizer goes with --format safetensors"),
    # DeepSpeed targets each kind of DeepSpeed source cannot be written as
    ("deepspeed-zero3", "deepspeed", {"tp": 2, "dp": 1}, r"changing TP from 1 to 2 needs the layout"),
    ("deepspeed-zero3", "deepspeed", {"tp": 1, "dp": 2, "pp": 2}, r"resharded over TP and DP only \(PP=1\)"),
    ("deepspeed-zero3", "deepspeed", {"tp": 1, "dp": 4, "zero_stage": 0}, r"written at ZeRO stage 1, 2 or 3, not 0"),
    ("deepspeed-zero3", "deepspeed", {"tp": 4, "dp": 1, "layout": DEEPSPEED / "llama_tp2_dp2"},
     r"is at TP=2, the target is TP=4"),
    ("deepspeed-autoep", "deepspeed", {"tp": 1, "dp": 3, "ep": 2}, r"ep=2 must divide the target world size dp=3"),
    ("deepspeed-autoep", "deepspeed", {"tp": 1, "dp": 3, "ep": 3}, r"4 experts do not split evenly over ep=3"),
    ("deepspeed-autoep", "deepspeed", {"tp": 2, "dp": 2, "ep": 2},
     r"an AutoEP target at TP=2 takes its dense TP maps .* saved folded at TP=2 \(--layout\)"),
    ("deepspeed-autoep", "deepspeed", {"tp": 2, "dp": 1, "ep": 1, "layout": DEEPSPEED / "mixtral_autoep_ep2_tp2"},
     r"DeepSpeed 0\.19\.8 does not train it.*AutoEP\+AutoTP folding requires expert_parallel.autoep_size > 1"),
    ("deepspeed-autoep", "deepspeed", {"tp": 2, "dp": 1, "ep": 2, "layout": DEEPSPEED / "llama_tp2"},
     r"layout checkpoint .*llama_tp2.* has no parameter 'model.layers.0.mlp.router.gate.weight'"),
    ("deepspeed-autoep", "deepspeed", {"tp": 1, "dp": 2, "ep": 2, "zero_stage": 2}, r"keeps the source's ZeRO stage 1"),
    ("deepspeed-autoep-zero3", "deepspeed", {"tp": 1, "dp": 3, "ep": 2}, r"ep=2 must divide the target world size dp=3"),
    ("deepspeed-autoep-zero3", "deepspeed", {"tp": 1, "dp": 3, "ep": 3}, r"4 experts do not split evenly over ep=3"),
    ("deepspeed-autoep-zero3", "deepspeed", {"tp": 2, "dp": 2, "ep": 2},
     r"an AutoEP target at TP=2 takes its dense TP maps .* saved folded at TP=2 \(--layout\)"),
    ("deepspeed-autoep-zero3", "deepspeed", {"tp": 2, "dp": 2, "ep": 2, "zero_stage": 1},
     r"an AutoEP target at TP=2 takes its dense TP maps .* saved folded at TP=2 \(--layout\)"),
    ("deepspeed-autoep-zero3", "deepspeed", {"tp": 1, "dp": 2, "ep": 2, "zero_stage": 0},
     r"written at ZeRO stage 1, 2 or 3 \(asked 0\)"),
    (DEEPSPEED / "moe_ep2", "deepspeed", {"tp": 1, "dp": 3, "ep": 3},
     r"mp_rank_00_model_states.pt: MoE layer 0 \(blocks.0.moe.deepspeed_moe.experts.deepspeed_experts\): 4 experts "
     r"do not split evenly over ep=3"),
    (DEEPSPEED / "moe_ep2", "deepspeed", {"tp": 1, "dp": 6, "ep": 3}, r"4 experts do not split evenly over ep=3"),
    (DEEPSPEED / "moe_ep2", "deepspeed", {"tp": 1, "dp": 2, "ep": 4}, r"ep=4 must divide the target world size dp=2"),
    (DEEPSPEED / "moe_ep2", "deepspeed", {"tp": 1, "dp": 3, "ep": 2}, r"ep=2 must divide the target world size dp=3"),
    (DEEPSPEED / "moe_ep2", "deepspeed", {"tp": 2, "dp": 2, "ep": 2},
     r"classic MoE checkpoints are resharded at TP = PP = 1 only"),
    (DEEPSPEED / "moe_ep2", "deepspeed", {"tp": 1, "dp": 2, "ep": 2, "zero_stage": 2}, r"keeps the source's ZeRO stage 1"),
    # classic MoE saved at TP 2 through an mpu: written as DeepSpeed files at its own TP or at TP 1 only
    (DEEPSPEED / "moe_ep2_tp2", "deepspeed", {"tp": 4, "dp": 1, "ep": 2},
     r"saved at TP=2 \(through an mpu\) is written as DeepSpeed files at its own TP=2 or at TP=1 \(PP=1\) only"),
    (DEEPSPEED / "moe_ep2_tp2_etp", "deepspeed", {"tp": 2, "dp": 2, "ep": 4},
     r"ep=4 must divide the DP size dp=2 with the experts split over TP"),
    (DEEPSPEED / "moe_ep2", "deepspeed", {"tp": 1, "dp": 2, "ep": 2, "zero_stage": 3},
     r"classic MoE .* is not written at ZeRO stage 3: DeepSpeed 0.19.8 does not train it there"),
    ("deepspeed-autoep", "deepspeed", {"tp": 2, "dp": 2, "ep": 2, "zero_stage": 3},
     r"an AutoEP target at TP=2 takes its dense TP maps .* saved folded at TP=2 \(--layout\)"),
    ("deepspeed-autoep", "deepspeed", {"tp": 2, "dp": 1, "ep": 1, "zero_stage": 3,
                                       "layout": DEEPSPEED / "mixtral_autoep_ep2_tp2_zero3"},
     r"DeepSpeed 0\.19\.8 does not train it.*autoep_size > 1"),
    ("deepspeed-autoep", "deepspeed", {"tp": 1, "dp": 3, "ep": 2, "zero_stage": 3},
     r"ep=2 must divide the target world size dp=3"),
]


@pytest.mark.parametrize("source,target,options,match", REFUSALS,
                         ids=[f"{getattr(s, 'name', s)}-to-{t}-" + "-".join(
                             k if isinstance(v, (Path, list)) else f"{k}{v}" for k, v in o.items())
                             for s, t, o, _ in REFUSALS])
def test_targets_a_source_cannot_give_are_refused_before_anything_exists(source, target, options, match, root,
                                                                          tmp_path):
    if source == "universal":
        pytest.importorskip("deepspeed")
    src = _source_path(source, root)
    with pytest.raises(ReshardError, match=match):
        if target in ("deepspeed",) or "files" in options:
            reshard(src, tmp_path / "out", to=target, **options)
        else:
            convert(src, tmp_path / "out", fmt=target, **options)
    assert not (tmp_path / "out").exists()


# -- every DeepSpeed kind: convert is ds_to_universal, file for file ------------------------------------------

DS_EXPECTED = {  # one file ds_to_universal writes for each kind, which reshard's folder must hold too
    "deepspeed-autotp-zero1": "zero/model.layers.0.self_attn.q_proj.weight/exp_avg.pt",
    "deepspeed-zero3": "zero/model.layers.0.self_attn.q_proj.weight/exp_avg.pt",
    "deepspeed-zero3-tp": "zero/model.layers.0.self_attn.q_proj.weight/exp_avg.pt",
    "deepspeed-tp-pp": None,
    "deepspeed-autoep": "zero/model.layers.0.mlp.experts.w1/exp_avg_sq.pt",
    "deepspeed-autoep-zero3": "zero/model.layers.1.mlp.experts.w2/exp_avg_sq.pt",
    "deepspeed-autoep-edp": "zero/model.layers.1.mlp.experts.w3/exp_avg_sq.pt",
}


@pytest.mark.parametrize("source", list(DS_EXPECTED))
def test_convert_is_ds_to_universal(source: str, root: Path, tmp_path: Path):
    pytest.importorskip("deepspeed")
    theirs = _source_universal(source, root)
    ours = convert(SOURCES[source][1], tmp_path / "reshard").out_dir
    expected = DS_EXPECTED[source] or next(p.relative_to(theirs).as_posix() for p in sorted(theirs.rglob("*.pt")))
    assert_same_as_ds_to_universal(ours, theirs, expected)


# -- workers: the same files as one process ----------------------------------------------------------------

WORKERS = [("llama_tp2_dp2", {"tp": 1, "dp": 3}), ("llama_zero3_dp2", {"tp": 1, "dp": 3}),
           ("llama_zero3_tp2_dp2", {"tp": 2, "dp": 3, "zero_stage": 1})]


@pytest.mark.parametrize("name,topology", WORKERS, ids=[w[0] for w in WORKERS])
def test_workers_give_the_same_files(name: str, topology: dict, tmp_path: Path):
    a = reshard(DEEPSPEED / name, tmp_path / "a", **topology).out_dir
    b = reshard(DEEPSPEED / name, tmp_path / "b", workers=3, **topology).out_dir
    names = sorted(p.name for p in a.iterdir() if p.suffix == ".pt")
    assert names == sorted(p.name for p in b.iterdir() if p.suffix == ".pt")
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


# -- a failure midway leaves nothing ----------------------------------------------------------------------


@pytest.mark.parametrize("source,target", [("deepspeed-autotp-zero1", "ucp"), ("dcp-fsdp2", "safetensors"),
                                           ("hf-sharded", "dcp"), ("universal", "deepspeed"),
                                           ("deepspeed-zero3", "deepspeed")])
def test_a_failure_midway_leaves_nothing(source, target, root, tmp_path, monkeypatch):
    from reshard.storage.staging import Staging

    real, calls = Staging.record, []

    def flaky(self, rel, size, digest):  # every writer records each file it finishes here
        calls.append(rel)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (simulated)")
        return real(self, rel, size, digest)

    if source == "universal":
        pytest.importorskip("deepspeed")
    monkeypatch.setattr(Staging, "record", flaky)
    src = _source_path(source, root)
    with pytest.raises((OutputError, OSError)):
        if target == "deepspeed":
            reshard(src, tmp_path / "out", to="deepspeed", tp=1, dp=2)
        else:
            convert(src, tmp_path / "out", fmt=target)
    assert calls, "the writer wrote nothing at all"
    out = tmp_path / "out"
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


# -- a DeepSpeed checkpoint at another topology and back is its source --------------------------------------


def _z(tp: int, dp: int, stage: int, **more) -> dict:
    return {"tp": tp, "dp": dp, "zero_stage": stage, **more}


# (fixture, there, back): out to another topology (TP, DP, PP, EP, ZeRO stage) and back to the source's
ROUND_TRIPS = [
    ("llama_tp2_dp2", {"tp": 1, "dp": 3}, {"tp": 2, "dp": 2, "layout": DEEPSPEED / "llama_tp2_dp2"}),
    ("llama_zero3_dp2", {"tp": 1, "dp": 3}, {"tp": 1, "dp": 2}),
    ("llama_zero3_dp2", _z(1, 3, 1), _z(1, 2, 3)),
    ("llama_zero3_dp2_bf16", _z(1, 1, 2), _z(1, 2, 3)),
    ("llama_zero1_dp2", _z(1, 3, 3), _z(1, 2, 1)),
    ("llama_zero2_dp2", _z(1, 1, 3), _z(1, 2, 2)),
    ("llama_zero1_dp2_bf16", _z(1, 3, 3), _z(1, 2, 1)),
    ("llama_zero3_tp2_dp2", _z(2, 1, 3), _z(2, 2, 3)),
    ("llama_zero3_tp2_dp2", _z(1, 4, 3), _z(2, 2, 3, layout=DEEPSPEED / "llama_zero3_tp2_dp2")),
    ("llama_zero3_tp2_dp2", _z(2, 3, 1), _z(2, 2, 3)),
    ("llama_zero3_tp2_dp2", _z(1, 3, 2), _z(2, 2, 3, layout=DEEPSPEED / "llama_zero3_tp2_dp2")),
    ("llama_tp2_dp2", _z(2, 3, 3), _z(2, 2, 1)),
    ("llama_tp2_dp2", _z(1, 1, 3), _z(2, 2, 1, layout=DEEPSPEED / "llama_tp2_dp2")),
    ("mixtral_autoep_ep2", {"tp": 1, "dp": 1, "ep": 1}, {"tp": 1, "dp": 2, "ep": 2}),
    ("mixtral_autoep_ep2_zero3", {"tp": 1, "dp": 1, "ep": 1}, {"tp": 1, "dp": 2, "ep": 2}),
    ("mixtral_autoep_ep2_zero3", {"tp": 1, "dp": 4, "ep": 4}, {"tp": 1, "dp": 2, "ep": 2}),
    ("moe_ep2", {"tp": 1, "dp": 1, "ep": 1}, {"tp": 1, "dp": 2, "ep": 2}),
    ("pipe_pp2_dp2", {"tp": 1, "dp": 1, "pp": 2}, {"tp": 1, "dp": 2, "pp": 2}),
    ("tp_pipe_tp2_pp2", {"tp": 1, "pp": 2, "dp": 3}, {"tp": 2, "pp": 2, "dp": 1}),
]


def _records(path: Path) -> dict[str, bytes]:
    """A torch archive's tensor records (``data/<key>``), without the archive folder's name."""
    with zipfile.ZipFile(path) as z:
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist() if n.split("/", 1)[1].startswith("data/")}


@pytest.mark.parametrize("name,there,back", ROUND_TRIPS,
                         ids=[f"{r[0]}-{'-'.join(f'{k}{v}' for k, v in r[1].items())}" for r in ROUND_TRIPS])
def test_there_and_back_gives_the_source_files(name, there, back, tmp_path):
    """Every file of the source loads to exactly the same objects (types, key order, tensors' dtype,
    shape, strides, storage, attributes and bits; metadata too), every tensor record byte for byte."""
    mid = reshard(DEEPSPEED / name, tmp_path / "mid", **there).out_dir
    out = reshard(mid, tmp_path / "back", **back).out_dir
    src = DEEPSPEED / name / (DEEPSPEED / name / "latest").read_text().strip()
    assert sorted(p.name for p in out.glob("*.pt")) == sorted(p.name for p in src.glob("*.pt"))
    for f in sorted(src.glob("*.pt")):
        same_strict(load(out / f.name, mmap=False), load(f, mmap=False), f.name)
        assert _records(out / f.name) == _records(f), f.name


def test_a_universal_checkpoint_of_a_zero3_job_keeps_its_shapes(root, tmp_path):
    """ZeRO-3 without TP: ``--format ucp`` writes each fp32 master flat, as ds_to_universal does (its
    universal loader expects that), and the shapes come back from the model states beside it: the
    same universal folder converts to shaped safetensors."""
    ucp = convert(DEEPSPEED / "llama_zero3_dp2", tmp_path / "ucp").out_dir
    flat = load(ucp / "zero" / "model.embed_tokens.weight" / "fp32.pt", mmap=False)
    assert flat.dim() == 1
    st = convert(ucp.parent, tmp_path / "st", fmt="safetensors").out_dir
    from safetensors.torch import load_file

    got = load_file(st / "model.safetensors")["model.embed_tokens.weight"]
    assert got.dim() == 2 and torch.equal(got.reshape(-1), flat)
