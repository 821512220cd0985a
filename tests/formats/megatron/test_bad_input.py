"""Bad Megatron input is refused by a reshard error naming the file, tensor and rank, before any
output folder exists: a missing or truncated file, a planted pickle in ``common_state`` or its
``args`` (or a legacy file), stacked shapes that disagree with ``args``, an iteration folder the
tracker does not name."""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil

import pytest
import torch

from reshard.errors import CheckpointError, ReshardError
from reshard.formats.megatron import safe
from reshard.jobs.convert import convert

from .support import FIXTURES


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo planted",))


def _copy(tmp_path, name: str):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst, ignore=shutil.ignore_patterns("oracle"))
    return dst


def _refused(src, tmp_path, *needles: str, fmt: str = "safetensors") -> str:
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as e:
        convert(src, out, fmt=fmt)
    text = str(e.value)
    for n in needles:
        assert n in text, f"{n!r} not in {text!r}"
    assert not out.exists() or not any(out.iterdir()), "something that looks finished was left"
    return text


def _plant(iter_dir, key: str, value) -> None:
    """Replace object ``key``'s record by ``torch.save([value])`` appended to rank 0's file."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = FileSystemReader(str(iter_dir)).read_metadata()
    buf = io.BytesIO(safe.dumps([value]))
    f = iter_dir / "__0_0.distcp"
    at = f.stat().st_size
    with open(f, "ab") as out:
        out.write(buf.getvalue())
    for idx in list(md.storage_data):
        if idx.fqn == key:
            md.storage_data[idx] = _StorageInfo("__0_0.distcp", at, len(buf.getvalue()))
    with open(iter_dir / ".metadata", "wb") as out:
        pickle.dump(md, out)


def _save(sd: dict, f) -> None:
    data = safe.dumps({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()} | {
        "model": {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sd["model"].items()}})
    f.write_bytes(data)


def _common(iter_dir) -> dict:
    from reshard.formats.megatron.dist import TorchDistBackend

    return TorchDistBackend(iter_dir).common


def test_missing_distcp_file(tmp_path):
    src = _copy(tmp_path, "torch_dist_tp2_pp2")
    (src / "iter_0000003" / "__3_0.distcp").unlink()
    _refused(src, tmp_path, "__3_0.distcp", "missing", "global rank 3")


def test_truncated_distcp_file(tmp_path):
    src = _copy(tmp_path, "torch_dist_tp2_dp2_distopt")
    f = src / "iter_0000003" / "__2_0.distcp"
    os.truncate(f, f.stat().st_size // 2)
    _refused(src, tmp_path, "__2_0.distcp", "truncated")


def test_missing_legacy_rank_file(tmp_path):
    src = _copy(tmp_path, "legacy_tp2_pp2")
    (src / "iter_0000003" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    _refused(src, tmp_path, "mp_rank_01_001", "TP rank 1, PP rank 1")


def test_truncated_legacy_file(tmp_path):
    src = _copy(tmp_path, "legacy_dp2_distopt")
    f = src / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt"
    os.truncate(f, f.stat().st_size - 4096)
    _refused(src, tmp_path, "distrib_optim.pt")


def test_planted_pickle_in_common_state(tmp_path):
    src = _copy(tmp_path, "torch_dist_tp2_pp2")
    it = src / "iter_0000003"
    common = _common(it)
    common["optimizer"] = _Evil()
    _plant(it, "common_state/shard_0_1", common)
    _refused(src, tmp_path, "__0_0.distcp", "common_state", "system")


def test_planted_pickle_in_args(tmp_path):
    src = _copy(tmp_path, "torch_dist_dp2_fully_reshardable")
    it = src / "iter_0000003"
    common = _common(it)
    common["args"].exit_signal = _Evil()
    _plant(it, "common_state/shard_0_1", common)
    _refused(src, tmp_path, "common_state", "system", "allow-list")


def test_planted_pickle_in_a_legacy_file(tmp_path):
    src = _copy(tmp_path, "legacy_tp2_pp2")
    f = src / "iter_0000003" / "mp_rank_01_000" / "model_optim_rng.pt"
    sd = safe.load_file(f)
    sd["rng_state"] = [_Evil()]
    _save(sd, f)
    _refused(src, tmp_path, "mp_rank_01_000", "system")


def test_stacked_shapes_disagreeing_with_args(tmp_path):
    src = _copy(tmp_path, "torch_dist_tp2_pp2")
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    args.num_layers = 6
    common["args"] = args
    _plant(it, "common_state/shard_0_1", common)
    _refused(src, tmp_path, ".metadata", "decoder.layers.", "args imply", "[6,")


def test_legacy_shapes_disagreeing_with_args(tmp_path):
    src = _copy(tmp_path, "legacy_tp2_pp2")
    for f in (src / "iter_0000003").glob("mp_rank_*/model_optim_rng.pt"):
        sd = safe.load_file(f)
        sd["args"].ffn_hidden_size = 40
        _save(sd, f)
    _refused(src, tmp_path, "mp_rank_00_000", "linear_fc1.weight", "TP rank 0")


def test_iteration_folder_the_tracker_does_not_name(tmp_path):
    src = _copy(tmp_path, "torch_dist_tp2_pp2")
    shutil.copytree(src / "iter_0000003", src / "iter_0000002")
    _refused(src / "iter_0000002", tmp_path, "latest_checkpointed_iteration.txt", "iter_0000003")
    (src / "latest_checkpointed_iteration.txt").write_text("5")
    _refused(src, tmp_path, "latest_checkpointed_iteration.txt", "iter_0000005", "missing")


def test_legacy_virtual_stages_the_files_do_not_hold(tmp_path):
    src = _copy(tmp_path, "legacy_tp2_pp2")
    f = src / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt"
    sd = safe.load_file(f)
    sd["args"].virtual_pipeline_model_parallel_size = 2
    _save(sd, f)
    _refused(src, tmp_path, "mp_rank_00_000", "no model0 / model1 state dict")


def test_legacy_virtual_stages_with_the_distributed_optimizer_are_refused_by_name(tmp_path):
    src = _copy(tmp_path, "legacy_pp2_vpp2")
    f = src / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt"
    sd = safe.load_file(f)
    sd["args"].use_distributed_optimizer = True
    f.write_bytes(safe.dumps(sd))
    _refused(src, tmp_path, "mp_rank_00_000", "virtual_pipeline_model_parallel_size = 2 with the distributed optimizer")


def test_uneven_stages_that_do_not_add_up(tmp_path):
    src = _copy(tmp_path, "torch_dist_pp2_uneven")
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    args.decoder_last_pipeline_num_layers = 1  # first 1 + last 1 of 3 layers over 2 stages
    common["args"] = args
    _plant(it, "common_state/shard_0_1", common)
    _refused(src, tmp_path, "__0_0.distcp", "3 layers do not divide over 2 pipeline stages (first 1, last 1)")


def _edit_bucket(src, edit) -> None:
    """Edit the fp32 ``param`` entry of the distributed optimizer's bucket in ``.metadata``."""
    f = next(src.glob("iter_*/.metadata"))
    md = pickle.loads(f.read_bytes())  # our own fixture's copy: trusted here
    key = next(k for k in md.state_dict_metadata if k.endswith("bucket_idx_0.param"))
    edit(md.state_dict_metadata, key)
    f.write_bytes(pickle.dumps(md))


@pytest.mark.parametrize("route", ["universal", "safetensors"])
def test_a_bucket_chunk_lost_from_the_metadata_is_refused(tmp_path, route):
    """Found by make fuzz (case 214 at seed 20261201): one DP rank's chunk of a bucket dropped from
    ``.metadata`` left part of the fp32 masters unread, and ``--format universal`` wrote the rest."""
    src = _copy(tmp_path, "torch_dist_dp2_distopt_bf16")
    _edit_bucket(src, lambda md, key: md[key].chunks.pop(0))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"bucket_idx_0\.param'.*: chunks leave a hole at"):
        convert(src, out, fmt=route)
    assert not out.exists()


def test_a_bucket_without_its_fp32_params_is_refused(tmp_path):
    """Megatron's distributed Adam saves a bucket's fp32 params with both moments: one missing is damage,
    never a source without masters whose weights would be cast instead."""
    src = _copy(tmp_path, "torch_dist_dp2_distopt_bf16")
    _edit_bucket(src, lambda md, key: md.pop(key))
    _refused(src, tmp_path, ".metadata", "its bucket has no param entry")


@pytest.mark.parametrize("field,value,needle", [
    ("moe_layer_freq", [0, 1], "args.moe_layer_freq = [0, 1]: not one 0 / 1 per layer of 3"),
    ("moe_layer_freq", 2, "no tensor 'decoder.layers.0.mlp.router.weight'"),  # [1, 0, 1]: layer 0 MoE
    ("mtp_num_layers", 1, "the bucket layout args imply"),  # an MTP layer's parameters the buckets lack
    ("multi_latent_attention", True, "the bucket layout args imply"),  # MLA at Megatron's default widths
    ("moe_single_grouped_weight", True, "grouped-GEMM experts held as one grouped parameter"),
    ("moe_shared_expert_intermediate_size", 31, "shared expert's ffn does not divide over TP=2"),
])
def test_moe_args_the_files_do_not_hold_are_refused_by_name(tmp_path, field, value, needle):
    """Shared experts, expert bias, mixed layers and MTP are read; what is still not (grouped GEMM in one
    parameter) or what the files contradict is refused naming the args field, the missing key or the layout."""
    src = _copy(tmp_path, "torch_dist_moe_tp2_ep2_shared_distopt")
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    setattr(args, field, value)
    _plant(it, "common_state/shard_0_1", dict(common, args=args))
    _refused(src, tmp_path, needle, fmt="dcp")  # Megatron names (HF names of shared experts: not mapped yet)


@pytest.mark.parametrize("field,value,needle", [
    ("transformer_impl", "transformer_engine", "only the local spec's MLA keys are read"),
    ("mla_down_proj_fusion", True, "fused MLA q/kv down projections"),
    ("mtp_num_layers", 1, "no tensor 'mtp.layers.0.enorm.weight', which args imply"),
    ("kv_lora_rank", 16, "decoder.layers.self_attention.linear_kv_down_proj.weight"),  # files hold 14 + 4 rows
    ("qk_pos_emb_head_dim", 5, "do not divide over TP=2"),  # 14 + 5 kv down rows over TP 2
])
def test_mla_args_the_files_do_not_hold_are_refused_by_name(tmp_path, field, value, needle):
    src = _copy(tmp_path, "torch_dist_tp2_mla")
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    setattr(args, field, value)
    _plant(it, "common_state/shard_0_1", dict(common, args=args))
    _refused(src, tmp_path, needle, fmt="dcp")


@pytest.mark.parametrize("fixture,repeated,needle", [
    ("torch_dist_mtp2", True, "mtp.layers.1"),  # the second layer's tensors: no key of one repeated layer
    ("torch_dist_mtp2_repeated", False, "no tensor 'mtp.layers.1.enorm.weight', which args imply"),
])
def test_a_repeated_mtp_layer_the_files_contradict_is_refused_by_name(tmp_path, fixture, repeated, needle):
    src = _copy(tmp_path, fixture)
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    args.mtp_use_repeated_layer = repeated
    _plant(it, "common_state/shard_0_1", dict(common, args=args))
    _refused(src, tmp_path, needle, fmt="dcp")


@pytest.mark.parametrize("field,value,needle", [
    ("layernorm_epsilon", 1e-5, "fixes its latent norms' eps at 1e-6"),
    ("rope_type", "yarn", "MLA with YaRN RoPE"),
    ("rotary_interleaved", True, "interleaved RoPE"),
])
def test_mla_models_no_deepseek_v3_config_computes_are_refused(tmp_path, field, value, needle):
    """The HF export of MLA: where transformers' DeepseekV3 computes another function, no folder."""
    from reshard.errors import ReshardError

    src = _copy(tmp_path, "torch_dist_tp2_mla")
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    setattr(args, field, value)
    _plant(it, "common_state/shard_0_1", dict(common, args=args))
    out = tmp_path / "out"
    with pytest.raises(ReshardError, match=needle):
        convert(src, out, fmt="hf")
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("field,value,needle", [
    ("ddp_bucket_size", 5000, "its buffer holds buckets [0, 1, 2, 3], the args (overlap_grad_reduce, ddp_bucket_size, "
                              "ddp_num_buckets) imply 3"),
    ("overlap_grad_reduce", False, "imply 1"),
    ("dist_ckpt_optim_fully_reshardable", True, "fully_reshardable optimizer with several DDP buckets"),
])
def test_bucket_args_the_files_do_not_hold_are_refused(tmp_path, field, value, needle):
    """Several DDP buckets are read where the args say where Megatron cut them; args that disagree with
    the bucket keys, or a fully_reshardable optimizer over several buckets, are refused by name."""
    src = _copy(tmp_path, "torch_dist_dp2_distopt_buckets")
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    setattr(args, field, value)
    if field == "dist_ckpt_optim_fully_reshardable":
        common = dict(common, content_metadata=dict(common.get("content_metadata") or {},
                                                    distrib_optim_sharding_type="fully_reshardable"))
    _plant(it, "common_state/shard_0_1", dict(common, args=args))
    _refused(src, tmp_path, needle, fmt="dcp")


def test_te_grouped_gemm_buckets_are_refused_by_name(tmp_path):
    """TEGroupedMLP keeps SequentialMLP's torch_dist keys but not its DDP bucket order: a dp_reshardable
    optimizer of a Transformer Engine run with --moe-grouped-gemm is refused naming it."""
    src = _copy(tmp_path, "torch_dist_moe_tp2_ep2_shared_distopt")
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    args.moe_grouped_gemm, args.transformer_impl = True, "transformer_engine"
    _plant(it, "common_state/shard_0_1", dict(common, args=args))
    _refused(src, tmp_path, "args.moe_grouped_gemm = True (transformer_impl 'transformer_engine')",
             "dp_reshardable buckets of grouped-GEMM experts under Transformer Engine", fmt="dcp")


def test_mtp_tensors_the_args_do_not_name_are_never_dropped(tmp_path):
    """An MTP checkpoint whose args lost mtp_num_layers: its mtp.layers.* tensors are weights no parameter
    takes, so the conversion is refused naming one (never a model silently without them) unless --drop."""
    src = _copy(tmp_path, "torch_dist_mtp1")
    it = src / "iter_0000003"
    common = _common(it)
    args = argparse.Namespace(**vars(common["args"]))
    args.mtp_num_layers = None
    _plant(it, "common_state/shard_0_1", dict(common, args=args))
    with pytest.raises(ReshardError, match=r"mtp\.layers\.0\."):
        convert(src, tmp_path / "out", fmt="dcp")
    assert not (tmp_path / "out").exists()
    report = convert(src, tmp_path / "dropped", fmt="dcp", drop=[r"^mtp\."])
    assert any("mtp.layers.0.eh_proj.weight" in str(d) for d in report.dropped)


def test_mla_without_latent_norms_has_no_deepseek_v3_config(tmp_path):
    """Megatron's MLA without --qk-layernorm (identity latent norms) reads and reshards; its HF
    export is refused by name (DeepseekV3 always normalizes the latents)."""
    from reshard.errors import ReshardError

    out = tmp_path / "out"
    with pytest.raises(ReshardError, match="MLA without latent norms"):
        convert(FIXTURES / "torch_dist_tp2_mla_q_proj", out, fmt="hf")
    assert not out.exists() or not any(out.iterdir())


# -- legacy files with expert parallelism (mp_rank_TT_EEE; a chained [dense, experts] plain Adam) ---------------
LEGACY_EP = "legacy_moe_tp2_ep2_shared"  # files mp_rank_00_000 (global rank 0) and mp_rank_01_001 (rank 1)


def test_missing_legacy_expert_rank_file(tmp_path):
    src = _copy(tmp_path, LEGACY_EP)
    (src / "iter_0000003" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    _refused(src, tmp_path, "mp_rank_01_001", "TP rank 1, PP rank 0, EP rank 1", fmt="dcp")


def test_legacy_expert_rank_files_swapped(tmp_path):
    """Both files hold the same names and shapes (expert TP 1: each EP rank's two experts whole): only
    ``args.rank`` tells them apart, and it must be of the TP and EP rank the folder names."""
    src = _copy(tmp_path, LEGACY_EP)
    it = src / "iter_0000003"
    a, b = it / "mp_rank_00_000" / "model_optim_rng.pt", it / "mp_rank_01_001" / "model_optim_rng.pt"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    _refused(src, tmp_path, "saved by global rank 1 (TP rank 1, PP rank 0, EP rank 1)", "TP rank 0, PP rank 0, EP rank 0",
             "swapped", fmt="dcp")


def test_legacy_ep_file_without_the_chained_optimizer(tmp_path):
    src = _copy(tmp_path, LEGACY_EP)
    f = src / "iter_0000003" / "mp_rank_01_001" / "model_optim_rng.pt"
    sd = safe.load_file(f)
    sd["optimizer"] = sd["optimizer"][0]  # the dense optimizer's only: the experts' moments are gone
    _save(sd, f)
    _refused(src, tmp_path, "mp_rank_01_001", "optimizer is dict", "list of 2", fmt="dcp")


def test_legacy_ep_expert_moments_that_do_not_fit(tmp_path):
    src = _copy(tmp_path, LEGACY_EP)
    f = src / "iter_0000003" / "mp_rank_01_001" / "model_optim_rng.pt"
    sd = safe.load_file(f)
    experts = sd["optimizer"][1]
    experts["state"] = dict(experts["state"])
    experts["state"][1] = {k: (v[:-1].clone() if k == "exp_avg" else v) for k, v in experts["state"][1].items()}
    _save(sd, f)
    _refused(src, tmp_path, "mp_rank_01_001", "expert optimizer state 1", "local_experts.0.linear_fc2.weight",
             "exp_avg of shape [24, 16]", fmt="dcp")


def test_legacy_ep_distrib_optim_without_the_chained_buffers(tmp_path):
    """With experts apart ``distrib_optim.pt`` is ``[dense, experts]``: a file holding one optimizer's
    buffers (as without experts) is refused naming it, not read as the dense one."""
    src = _copy(tmp_path, LEGACY_EP + "_distopt")
    f = src / "iter_0000003" / "mp_rank_01_001" / "distrib_optim.pt"
    f.write_bytes(safe.dumps(safe.load_file(f)[0]))
    _refused(src, tmp_path, "mp_rank_01_001/distrib_optim.pt", "holds dict", "chained [dense, experts]", fmt="dcp")


def test_legacy_ep_expert_buffer_that_does_not_fit(tmp_path):
    src = _copy(tmp_path, LEGACY_EP + "_distopt")
    f = src / "iter_0000003" / "mp_rank_00_000" / "distrib_optim.pt"
    d = safe.load_file(f)
    (buf,) = d[1][0].values()
    buf["exp_avg_sq"] = buf["exp_avg_sq"][:-64].clone()
    f.write_bytes(safe.dumps(d))
    _refused(src, tmp_path, "mp_rank_00_000/distrib_optim.pt", "expert 'exp_avg_sq' is [4544]",
             "bucket layout args imply [4608]", fmt="dcp")


def test_a_flipped_legacy_adam_step_is_refused_when_records_are_checked_as_read(tmp_path, monkeypatch):
    """Fuzz case 7 (legacy_moe_tp2_ep2_shared, seed 20261201, lazy): with every record checked only
    when read (``EAGER_BYTES = 0``, the large-file path), Adam's ``step`` -- read outside the engine
    for the target's optimizer state -- went out flipped; its record is now checked when read."""
    from reshard.storage import verified
    from tests.fuzz.mutations import _index

    src = _copy(tmp_path, LEGACY_EP)
    f = src / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt"
    rec = _index(f).records["data/35"]  # optimizer[0].state.0.step
    data = bytearray(f.read_bytes())
    data[rec.start + 1] ^= 0x80
    f.write_bytes(bytes(data))
    monkeypatch.setattr(verified, "EAGER_BYTES", 0)
    _refused(src, tmp_path, "mp_rank_00_000", "optimizer[0].state.0.step", "CRC-32", fmt="ucp")


@pytest.mark.parametrize("which", ["mp_rank_00_000", "mp_rank_01_001"])
def test_legacy_files_of_weights_only_and_with_optimizer_mixed(tmp_path, which):
    """One file without its optimizer entry (as a weights-only save writes it) beside files with one:
    refused naming it, never read as weights only with the others' moments left unread."""
    src = _copy(tmp_path, "legacy_tp2_pp2")
    f = src / "iter_0000003" / which / "model_optim_rng.pt"
    sd = safe.load_file(f)
    del sd["optimizer"]
    _save(sd, f)
    _refused(src, tmp_path, "optimizer state", "files of different saves mixed")
