"""The last pipeline stage's copy of the word embeddings under the distributed optimizer (issue 35),
as Megatron-Core 0.19.2 saves it over PP 2 x DP 2:

* ``torch_dist_pp2_dp2_mtp1_distopt``: for the MTP block, registered first on the last stage, so
  the last bucket of its reversed buffer;
* ``torch_dist_pp2_dp2_tied_distopt`` and ``legacy_pp2_dp2_tied_distopt``: tied embeddings, the
  last stage's ``output_layer.weight``, registered last, so its buffer's first bucket.

Megatron marks the first stage's embedding and the copy ``shared_embedding``, and its distributed
optimizer gives each a bucket of its own. ``torch_dist`` stores the copy's weights once (the first
stage's, replica 0) but each stage's buckets apart; reshard reads the first stage's and checks the
copy's fp32 master and moments equal to them. Every tensor equals Megatron's TP1 reload bit for bit
(``test_reader.test_megatron_names_equal_the_oracle``); here: the buckets, the write-back at the
source topology (Megatron's files), reshards from and to the layout, and a drifted copy refused."""

from __future__ import annotations

import io
import shutil

import pytest
import torch

from reshard.errors import CheckpointError
from reshard.formats.megatron import safe
from reshard.formats.megatron.reader import MegatronReader
from reshard.formats.registry import open_reader
from reshard.jobs.convert import convert, reshard

from .support import FIXTURES, compare_megatron

MTP, TIED, LEGACY_TIED = "torch_dist_pp2_dp2_mtp1_distopt", "torch_dist_pp2_dp2_tied_distopt", "legacy_pp2_dp2_tied_distopt"
EMBED = "embedding.word_embeddings.weight"
_DTYPE = "(torch.float32, torch.float32)"


def _bucket_key(m: int, idx: int, kind: str) -> str:
    return f"optimizer.distributed.dp_group_idx_{m}.gbuf_idx_0.dtype_{_DTYPE}.bucket_idx_{idx}.{kind}"


def _sizes(r: MegatronReader, m: int) -> list[int]:
    return list(r.src.obj(f"optimizer.distributed.dp_group_idx_{m}.per_bucket_numel_unpadded/shard_0_1")[0].values())[0]


def _whole(r: MegatronReader, key: str) -> torch.Tensor:
    e = r.src.ck.entry(key)
    return torch.cat([r.src.ck.chunk(key, i).reshape(-1) for i in sorted(range(len(e.chunks)),
                                                                       key=lambda i: e.chunks[i].offsets)])


@pytest.mark.parametrize("fixture,copy_bucket", [(MTP, -1), (TIED, 0)])
def test_the_copy_has_a_bucket_of_its_own_equal_to_the_first_stages(fixture, copy_bucket):
    """Stage 0's buffer ends with the embedding's bucket; stage 1's copy is its last bucket (MTP) or
    its first (tied); both hold the embedding's numel and the same fp32 masters and moments."""
    r = MegatronReader.open(FIXTURES / fixture)
    r.check()
    numel = r.arch.padded_vocab * r.arch.hidden
    first, last = _sizes(r, 0), _sizes(r, 1)
    assert len(first) == len(last) == 2 and first[-1] == numel and last[copy_bucket] == numel
    idx = copy_bucket % len(last)
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.equal(_whole(r, _bucket_key(0, 1, kind)), _whole(r, _bucket_key(1, idx, kind))), kind
    # the weights once: one embedding entry, the first stage's (tied: no output_layer.weight)
    assert EMBED in r.src.ck.tensors and ("output_layer.weight" in r.src.ck.tensors) == (fixture == MTP)
    assert not [h for h in r.unlowered() if h.what == "weights"]


def _held(r: MegatronReader, key: str, chunk: int) -> list[tuple[int, int]]:
    """The ranges of bucket chunk ``chunk`` of ``key`` that hold a parameter's state (the copy's too;
    none in a chunk of a DP rank's shard that is all padding)."""
    ranges = [(start, n) for per in r.src.buckets.values() for (_, k, c, start, n, _) in per.values()
              if (k, c) == (key, chunk)]
    ranges += [(start, n) for per in r.src.copies.values() for (k, c, start, n, _) in per if (k, c) == (key, chunk)]
    return ranges


@pytest.mark.parametrize("fixture", [MTP, TIED])
def test_written_at_its_own_topology_is_megatrons_files(tmp_path, fixture):
    """Every tensor entry of Megatron's save -- model chunks and every bucket chunk, the copy's too --
    with its chunks bit for bit, each bucket chunk in its DP rank's file; the same objects, the
    bucket sizes equal. (Which DP rank's file holds a replicated model chunk is Megatron's save-load
    balancing, not read by its loader: not compared.)"""
    src = MegatronReader.open(FIXTURES / fixture)
    out = MegatronReader.open(reshard(FIXTURES / fixture, tmp_path, to="megatron").out_dir)
    out.check()
    assert set(out.src.ck.tensors) == set(src.src.ck.tensors) and set(out.src.ck.objects) == set(src.src.ck.objects)
    for key, e in src.src.ck.tensors.items():
        got = out.src.ck.tensors[key]
        assert (got.shape, got.dtype) == (e.shape, e.dtype), key
        files = ".bucket_idx_" in key
        mine = sorted((c.offsets, c.sizes, c.file if files else "", i) for i, c in enumerate(got.chunks))
        theirs = sorted((c.offsets, c.sizes, c.file if files else "", i) for i, c in enumerate(e.chunks))
        assert [x[:3] for x in mine] == [x[:3] for x in theirs], key
        for (_, _, _, i), (_, _, _, j) in zip(mine, theirs):
            a, b = out.src.ck.chunk(key, i).reshape(-1), src.src.ck.chunk(key, j).reshape(-1)
            for lo, n in _held(src, key, j) if files else [(0, a.numel())]:  # a bucket's gaps: Megatron's torch.empty
                assert torch.equal(a.narrow(0, lo, n).view(torch.uint8), b.narrow(0, lo, n).view(torch.uint8)), key
    for m in (0, 1):
        assert _sizes(out, m) == _sizes(src, m)
    assert compare_megatron(out, fixture) > 0


@pytest.mark.parametrize("fixture,fmt,topology", [
    (MTP, "torch_dist", dict(tp=2, pp=1, dp=2)),  # the copy dropped: one stage
    (TIED, "torch_dist", dict(tp=2, pp=1, dp=2)),
    (TIED, "torch", dict(tp=1, pp=2, dp=2, optimizer="distributed")),  # legacy: output_layer.weight, its bucket
    (LEGACY_TIED, "torch_dist", dict(tp=1, pp=2, dp=2)),  # legacy -> torch_dist, the copy's bucket made again
    ("torch_dist_mtp1", "torch_dist", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable")),  # the copy made
    # virtual stages: the copy first in the last stage's last model chunk's buffer (gbuf_idx_1)
    ("torch_dist_pp2_vpp2_mtp1", "torch_dist", dict(tp=1, pp=2, dp=2, optimizer="dp_reshardable")),
])
def test_resharded_from_and_to_the_copys_buckets_equals_the_oracle(tmp_path, fixture, fmt, topology):
    out = reshard(FIXTURES / fixture, tmp_path, to="megatron", ckpt_format=fmt, **topology).out_dir
    r = MegatronReader.open(out)
    r.check()  # the copy, where there is one, checked equal to the first stage's
    assert r.loc.fmt == fmt and (r.arch.tp, r.arch.pp, r.arch.dp) == (topology["tp"], topology["pp"], topology["dp"])
    assert r.src.sharding == "dp_reshardable"
    assert compare_megatron(r, fixture) > 0


def test_torch_dist_tied_written_as_legacy_is_megatrons_legacy_save(tmp_path):
    """The two tied fixtures are the same run (same seeds and data) saved in each format: the
    ``torch_dist`` one written as legacy files at its topology is Megatron's legacy save, every
    tensor of every ``model_optim_rng.pt`` and ``distrib_optim.pt`` bit for bit (the copy as
    ``output_layer.weight`` last in the last stage's model, its range first in its buffer)."""
    out = reshard(FIXTURES / TIED, tmp_path, to="megatron", ckpt_format="torch", optimizer="distributed").out_dir
    src = FIXTURES / LEGACY_TIED / "iter_0000003"
    for f in sorted(src.rglob("*.pt")):
        want, got = safe.load_file(f), safe.load_file(out / "iter_0000003" / f.relative_to(src))
        if f.name == "model_optim_rng.pt":
            assert list(got["model"]) == list(want["model"]), f
            for k, v in want["model"].items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(got["model"][k], v), (f, k)
        else:
            (a,), (b,) = got[0].values(), want[0].values()
            for k in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(a[k], b[k]), (f, k)


def _plant_chunk(iter_dir, key: str, change) -> None:
    """Chunk 0 of tensor ``key`` replaced by ``change(it)``, saved as DCP saves a tensor and appended
    to its file, ``.metadata`` pointed at it."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = FileSystemReader(str(iter_dir)).read_metadata()
    r = MegatronReader.open(iter_dir)
    t = change(r.src.ck.chunk(key, 0).clone())
    c = r.src.ck.entry(key).chunks[0]
    buf = io.BytesIO()
    torch.save(t, buf)
    f = iter_dir / c.file
    at = f.stat().st_size
    with open(f, "ab") as out:
        out.write(buf.getvalue())
    for idx in list(md.storage_data):
        if idx.fqn == key and tuple(idx.offset) == tuple(c.offsets):
            md.storage_data[idx] = _StorageInfo(c.file, at, len(buf.getvalue()))
    import pickle

    with open(iter_dir / ".metadata", "wb") as out:
        pickle.dump(md, out)


@pytest.mark.parametrize("fixture,bucket", [(MTP, 1), (TIED, 0)])
def test_a_drifted_copy_is_refused_naming_the_tensor(tmp_path, fixture, bucket):
    """A ``+1`` planted in the copy's ``exp_avg`` (stage 1's bucket): refused by the reader's check,
    naming the bucket entry and the copy, before any output folder exists."""
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / fixture, bad, ignore=shutil.ignore_patterns("oracle"))
    key = _bucket_key(1, bucket, "exp_avg")

    def plus_one(t: torch.Tensor) -> torch.Tensor:
        t.view(-1)[0] += 1
        return t

    _plant_chunk(bad / "iter_0000003", key, plus_one)
    name = EMBED if fixture == MTP else "output_layer.weight"
    with pytest.raises(CheckpointError, match=f"{key.replace('(', '.').replace(')', '.')}.*embedding copy {name} "
                                              r"\(exp_avg, TP rank 0\) differs from the first stage's"):
        MegatronReader.open(bad).check()
    with pytest.raises(CheckpointError, match="differs from the first stage's"):
        reshard(bad, tmp_path / "out", to="megatron", tp=2, pp=1, dp=2)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fixture,via", [(MTP, "dcp"), (TIED, "universal"), (LEGACY_TIED, "dcp")])
def test_through_dcp_or_universal_and_back_to_the_copys_buckets(tmp_path, fixture, via):
    """The first stage's embedding (its master and moments) is what DCP / universal get -- every
    tensor equal to Megatron's reload -- and back at PP 2 x DP 2 ``dp_reshardable`` the copy's bucket
    is made again from it (``--megatron-args`` the fixture: its args and run state)."""
    mid = convert(FIXTURES / fixture, tmp_path / via, fmt=via)
    assert not mid.dropped
    assert compare_megatron(open_reader(mid.out_dir), fixture) > 0
    back = reshard(mid.out_dir, tmp_path / "back", to="megatron", megatron_args=FIXTURES / fixture, tp=1, pp=2, dp=2,
                   optimizer="dp_reshardable").out_dir
    r = MegatronReader.open(back)
    r.check()
    assert r.src.sharding == "dp_reshardable" and r.src.copies
    assert compare_megatron(r, fixture) > 0


@pytest.mark.parametrize("what", ["weight", "exp_avg"])
def test_legacy_tied_copy_is_checked_and_accounted_for(tmp_path, what):
    """``legacy_pp2_dp2_tied_distopt``: the last stage's ``output_layer.weight`` is the copy (read as
    the first stage's embedding, so no tensor is left unaccounted for); a drifted copy -- its weight
    in the model, or its ``exp_avg`` at the head of that stage's ``distrib_optim.pt`` -- is refused
    naming the file and ``output_layer.weight``."""
    from reshard.storage import torch_zip

    r = MegatronReader.open(FIXTURES / LEGACY_TIED)
    r.check()
    assert "output_layer.weight" not in r.names and r.arch.tied
    assert not [h for h in r.unlowered() if h.what == "weights"]
    bad = tmp_path / "bad"
    shutil.copytree(FIXTURES / LEGACY_TIED, bad, ignore=shutil.ignore_patterns("oracle"))
    rank = bad / "iter_0000003" / "mp_rank_00_001"
    f = rank / ("model_optim_rng.pt" if what == "weight" else "distrib_optim.pt")
    d = safe.load_file(FIXTURES / LEGACY_TIED / "iter_0000003" / "mp_rank_00_001" / f.name)  # mapped: not the one rewritten
    if what == "weight":
        d["model"]["output_layer.weight"][0, 0] += 1
    else:
        next(iter(d[0].values()))["exp_avg"][0] += 1
    with open(f, "wb") as out:
        torch_zip.save(d, out, pickler=safe.PICKLER)
    with pytest.raises(CheckpointError, match=f"mp_rank_00_001/{f.name}: output_layer.weight \\({what}, TP rank 0\\): "
                                              "the last stage's copy for the tied output layer differs"):
        MegatronReader.open(bad).check()
