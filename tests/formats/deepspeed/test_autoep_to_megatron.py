"""DeepSpeed AutoEP -> Megatron-Core (issue #35 item 3, the way back of ``--ep`` from a Megatron
source): a checkpoint DeepSpeed 0.19.8 saved for an AutoEP job is read in Hugging Face names through
the mapping document ``autoep.json`` read back (``formats/deepspeed/autoep_hf.py``: gate/up joined,
the router renamed, AutoEP's alias written once) and written as Megatron-Core MoE (SequentialMLP) at
TP x EP. Every weight, fp32 master and Adam moment torch's own DCP loader reads of the output equals
DeepSpeed's own consolidation of the source (``ds_to_universal``), mapped by name in this file; and
Megatron MoE -> AutoEP -> Megatron holds Megatron's own reload of the source again. Megatron's own
loader reading these outputs: ``tests/formats/megatron/test_megatron_loads.py`` (opt-in)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from reshard import ReshardError
from reshard.jobs.convert import convert, reshard
from reshard.storage.safe_load import load
from tests.support.paths import DEEPSPEED, MEGATRON

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

NATIVE = DEEPSPEED / "mixtral_autoep_ep2"  # DeepSpeed AutoEP on an HF Mixtral, EP 2, ZeRO-1
MOE = MEGATRON / "torch_dist_moe_ep2"  # Mixtral-shaped Megatron-Core MoE
MOMENTS = ("exp_avg", "exp_avg_sq")
_STATE_KEYS = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def hf_config_dir(tmp: Path, fixture: Path = NATIVE) -> Path:
    """The fixture job's transformers config (``fixture.json``'s ``model_config_full``) as a
    ``config.json`` folder for ``--hf-config``: DeepSpeed records no architecture."""
    cfg = json.loads((fixture / "fixture.json").read_text())["model_config_full"]
    cfg["architectures"] = ["MixtralForCausalLM"]
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    return tmp


def megatron_tensors(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of a Megatron ``torch_dist`` iteration by key and state, read by torch's own
    DCP loader (the model, and in model space plain Adam's moments / fully_reshardable's masters)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    it = next(out.rglob(".metadata")).parent
    md = dcp.FileSystemReader(it).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()
          if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(it), no_dist=True)
    got: dict[str, dict[str, torch.Tensor]] = {}
    for k, t in sd.items():
        state, key = next(((s, k[len(f"optimizer.state.{m}."):]) for m, s in _STATE_KEYS.items()
                           if k.startswith(f"optimizer.state.{m}.")), ("weight", k))
        got.setdefault(key, {})[state] = t
    return got


def in_hf_names(tensors: dict[str, dict[str, torch.Tensor]], out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Megatron keys cut into HF names by the written checkpoint's mapping document (``llama.json``,
    checked against ``from_pretrained`` and the logits in tests/formats/megatron/test_hf_moe.py)."""
    from reshard.formats.megatron.hfmap import hf_params
    from reshard.formats.megatron.reader import MegatronReader

    res: dict[str, dict[str, torch.Tensor]] = {}
    for p in hf_params(MegatronReader.open(out).arch):
        for state, full in tensors[p.key].items():
            t = full.new_zeros(p.shape)
            for b in p.blocks:
                src = full[tuple(slice(s, s + n) for s, n in zip(b.start, b.size))].reshape(b.size[b.fixed:])
                t[tuple(slice(h, h + n) for h, n in zip(b.hf_start, b.size[b.fixed:]))] = src
            res.setdefault(p.name, {})[state] = t[tuple(slice(0, n) for n in p.valid)]
    return res


def deepspeed_consolidation(tmp: Path, ckpt: Path = NATIVE) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's own ``ds_to_universal`` of an AutoEP checkpoint (into ``tmp``), mapped here to HF
    Mixtral's in-memory names (transformers 5: ``gate_up_proj`` = [w1; w3] along dim 1,
    ``down_proj`` = w2, ``gate.weight`` = the router); the fp32 masters are also the weights."""
    from tests.support.dsconv import ds_to_universal_folder

    zero = ds_to_universal_folder(ckpt, tmp) / "zero"
    tag = ckpt / (ckpt / "latest").read_text().strip()
    shapes = {}  # a ZeRO-3 job's universal files hold each F flat: its model states' param_shapes say its shape
    for f in sorted(tag.glob("zero_pp_rank_0_mp_rank_00_model_states.pt")):
        groups = load(f)["param_shapes"]
        shapes = {n: tuple(x) for g in (groups if isinstance(groups, list) else [groups]) for n, x in g.items()}
    ucp = {}
    for d in zero.iterdir():
        if not d.is_dir() or d.name.endswith(".gate.gate.weight"):  # AutoEP's alias of the router: the router itself
            continue
        states = {}
        for f in ("fp32", *MOMENTS):
            obj = load(d / f"{f}.pt", mmap=False)
            t = obj["param"] if isinstance(obj, dict) else obj
            # (an expert's recorded shape is its EP rank's [E / ep, ...]: the experts' dim from the numel)
            states[f] = t.reshape(-1, *shapes[d.name][1:]) if d.name in shapes and t.dim() == 1 else t
        ucp[d.name] = states
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, states in ucp.items():
        if name.endswith(".experts.w1"):
            m = name[:-len(".experts.w1")]
            w3 = ucp[f"{m}.experts.w3"]
            out[f"{m}.experts.gate_up_proj"] = {s: torch.cat([t, w3[s]], 1) for s, t in states.items()}
        elif name.endswith(".experts.w2"):
            out[name[:-len("w2")] + "down_proj"] = states
        elif name.endswith(".router.gate.weight"):
            out[name.replace(".router.gate.weight", ".gate.weight")] = states
        elif not name.endswith((".experts.w3", ".gate.gate.weight")):
            out[name] = states
    for states in out.values():
        states["weight"] = states["fp32"]
    return out


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    """Per DeepSpeed fixture: its ``ds_to_universal`` (a folder with ``latest_universal``) and tensors."""
    made: dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]] = {}

    def get(fixture: str) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
        if fixture not in made:
            tmp = tmp_path_factory.mktemp(fixture)
            made[fixture] = tmp, deepspeed_consolidation(tmp, DEEPSPEED / fixture)
        return made[fixture]

    return get


@pytest.mark.parametrize("fixture,source,topology", [
    ("mixtral_autoep_ep2", "deepspeed", dict(tp=2, dp=2, ep=2, optimizer="adam")),
    ("mixtral_autoep_ep2", "deepspeed", dict(tp=1, dp=4, ep=4, optimizer="fully_reshardable")),
    ("mixtral_autoep_ep2", "universal", dict(tp=2, dp=2, ep=2, etp=1, optimizer="adam")),  # DeepSpeed's own universal
    pytest.param("mixtral_autoep_ep2_dp4", "deepspeed", dict(tp=1, dp=2, ep=2, optimizer="adam"),  # EP 2 x EDP 2
                 marks=pytest.mark.slow),  # ~10 s (its ds_to_universal): the ep2 rows' code path
    ("mixtral_autoep_ep2_zero3", "deepspeed", dict(tp=2, dp=1, ep=2, etp=1, optimizer="adam")),  # ZeRO-3 source
], ids=["tp2-ep2-adam", "tp1-ep4-fully_reshardable", "universal-tp2-ep2-etp1-adam", "edp2-tp1-ep2-adam",
        "zero3-tp2-ep2-etp1-adam"])
def test_autoep_to_megatron_holds_deepspeeds_own_consolidation(tmp_path, universal, fixture, source, topology):
    ucp, consolidated = universal(fixture)
    out = reshard(DEEPSPEED / fixture if source == "deepspeed" else ucp, tmp_path / "mg", to="megatron",
                  hf_config=hf_config_dir(tmp_path / "cfg", DEEPSPEED / fixture), **topology).out_dir
    from reshard.formats.megatron.reader import MegatronReader

    a = MegatronReader.open(out).arch
    assert (a.tp, a.ep, a.experts, a.moe_layers) == (topology["tp"], topology["ep"], 4, (True, True))
    got = in_hf_names(megatron_tensors(out), out)
    assert sorted(got) == sorted(consolidated)
    states = {"adam": ("weight", *MOMENTS), "fully_reshardable": ("weight", "fp32", *MOMENTS)}[topology["optimizer"]]
    n = 0
    for name, want in consolidated.items():
        assert set(got[name]) == set(states), name
        for s in states:
            assert got[name][s].dtype == want[s].dtype and torch.equal(got[name][s], want[s]), (name, s)
            n += 1
    assert n == len(states) * 21  # 9 per layer (the router and 2 expert tensors among them), 3 outside
    manifest = json.loads(next(out.rglob("reshard-manifest.json")).read_text())
    assert "not_carried" not in manifest and "dropped" not in manifest


def test_megatron_moe_to_autoep_and_back_is_the_source(tmp_path):
    """Megatron MoE (EP 2) -> DeepSpeed AutoEP (EP 2 x DP 2) -> Megatron at the source's TP x EP x DP
    with plain Adam: every weight and moment equals Megatron's own reload of the source (the padded
    vocabulary on its valid rows: HF names hold only those)."""
    from reshard.formats.megatron.reader import MegatronReader
    from tests.formats.megatron.support import STATES, full, oracle

    src = MegatronReader.open(MOE).arch
    hf = convert(MOE, tmp_path / "hf", fmt="hf").out_dir  # its config.json for --hf-config
    ds = reshard(MOE, tmp_path / "ds", to="deepspeed", ep=2, dp=2).out_dir
    back = reshard(ds.parent, tmp_path / "back", to="megatron", tp=src.tp, dp=src.dp, ep=src.ep, optimizer="adam",
                   hf_config=hf).out_dir
    r = MegatronReader.open(back)
    assert (r.arch.tp, r.arch.dp, r.arch.ep, r.arch.experts) == (src.tp, src.dp, src.ep, src.experts)
    model, optim, _, info = oracle(MOE.name)
    n = 0
    for name, (key, idx) in info["names"].items():
        for state, prefix in STATES[:3]:
            want = model[name] if prefix is None else optim[prefix + name]
            got = full(r, key, state)[tuple(idx)]
            if key in _VOCAB:
                got, want = got[:r.arch.vocab], want[:r.arch.vocab]
            assert got.dtype == want.dtype and torch.equal(got, want), (name, state)
            n += 1
    assert n == 3 * len(info["names"]) and any(".local_experts." in k for k in info["names"])


def test_a_planted_difference_between_router_and_its_alias_is_refused(tmp_path):
    """AutoEP saves the router twice (``router.gate.weight`` and its alias ``gate.gate.weight``);
    written once, the two must be one tensor: a copy whose alias differs is refused naming it,
    before any output."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(NATIVE, src)
    f = src / "global_step3" / "mp_rank_00_model_states.pt"
    sd = load(f, mmap=False)
    sd["module"]["model.layers.1.mlp.gate.gate.weight"] = sd["module"]["model.layers.1.mlp.gate.gate.weight"] + 1
    torch.save(sd, f)
    with pytest.raises(ReshardError, match=r"model\.layers\.1\.mlp\.gate\.gate\.weight \(weight\) differs from "
                                           r"model\.layers\.1\.mlp\.router\.gate\.weight"):
        reshard(src, tmp_path / "mg", to="megatron", tp=1, dp=2, ep=2, hf_config=hf_config_dir(tmp_path / "cfg"))
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("fixture,match", [
    ("moe_ep2", r"has no 'model\.embed_tokens\.weight', which the Megatron model needs"),  # classic deepspeed.moe
    ("mixtral_autoep_ep2", r"a Megatron target from a DeepSpeed checkpoint needs the model's Hugging Face "
                           r"config\.json .*--hf-config"),
])
def test_deepspeed_routes_megatron_cannot_take_are_refused_naming_why(tmp_path, fixture, match):
    cfg = {} if fixture == "mixtral_autoep_ep2" else {"hf_config": hf_config_dir(tmp_path / "cfg")}
    with pytest.raises(ReshardError, match=match):
        reshard(DEEPSPEED / fixture, tmp_path / "mg", to="megatron", tp=1, dp=2, ep=2, **cfg)
    assert not (tmp_path / "mg").exists()
