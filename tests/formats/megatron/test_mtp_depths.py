"""Several multi-token-prediction depths (issue 35), as Megatron-Core 0.19.2 saves them:

* ``torch_dist_mtp2`` (``--mtp-num-layers 2``): two MTP layers, ``mtp.layers.0`` and ``mtp.layers.1``,
  each its own ``enorm`` / ``hnorm`` / ``eh_proj`` / ``mtp_model_layer`` / ``final_layernorm``;
* ``torch_dist_mtp2_repeated`` (``--mtp-num-layers 2 --mtp-use-repeated-layer``): one layer run at
  both depths, so ``mtp.layers.0`` only (its moments hold both depths' gradients).

Every tensor (weights, both Adam moments) equals Megatron's TP1 reload bit for bit
(``test_reader.test_megatron_names_equal_the_oracle``); here: the keys, the write-back at the source
topology with Megatron's keys, chunks and files, and reshards at another TP / PP in both formats."""

from __future__ import annotations

import pytest

from reshard.formats.megatron.reader import MegatronReader
from reshard.jobs.convert import reshard

from .support import FIXTURES, compare_megatron

TWO, REPEATED = "torch_dist_mtp2", "torch_dist_mtp2_repeated"


@pytest.mark.parametrize("fixture,layers", [(TWO, 2), (REPEATED, 1)])
def test_the_mtp_layers_megatron_built(fixture, layers):
    r = MegatronReader.open(FIXTURES / fixture)
    assert r.args.mtp_num_layers == 2 and bool(getattr(r.args, "mtp_use_repeated_layer", False)) == (fixture == REPEATED)
    assert r.arch.mtp == layers
    built = {n.split(".")[2] for n in r.names if n.startswith("mtp.layers.")}
    assert built == {str(k) for k in range(layers)}
    for k in range(layers):
        for n in ("enorm", "hnorm", "eh_proj", "final_layernorm"):
            assert f"mtp.layers.{k}.{n}.weight" in r.names
            assert r.states(f"mtp.layers.{k}.{n}.weight") == ("weight", "exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("fixture", [TWO, REPEATED])
def test_written_at_its_own_topology_is_megatrons_layout(tmp_path, fixture):
    src = MegatronReader.open(FIXTURES / fixture).src
    out = MegatronReader.open(reshard(FIXTURES / fixture, tmp_path, to="megatron").out_dir)
    assert set(out.src.ck.tensors) == set(src.ck.tensors) and set(out.src.ck.objects) == set(src.ck.objects)
    for key, e in src.ck.tensors.items():
        got = out.src.ck.tensors[key]
        assert (got.shape, got.dtype) == (e.shape, e.dtype), key
        assert sorted((c.offsets, c.sizes, c.file) for c in got.chunks) == sorted(
            (c.offsets, c.sizes, c.file) for c in e.chunks), key
    assert out.args.mtp_num_layers == 2
    assert compare_megatron(out, fixture) > 0


@pytest.mark.parametrize("fixture,fmt,topology", [
    (TWO, "torch_dist", dict(tp=2, pp=2, dp=1)),  # both MTP layers on the last stage
    (TWO, "torch", dict(tp=1, pp=2, dp=2, optimizer="distributed")),  # legacy: the embedding copy's bucket too
    (REPEATED, "torch", dict(tp=2, pp=2, dp=1, optimizer="adam")),
])
def test_resharded_equals_the_oracle(tmp_path, fixture, fmt, topology):
    out = reshard(FIXTURES / fixture, tmp_path, to="megatron", ckpt_format=fmt, **topology).out_dir
    r = MegatronReader.open(out)
    r.check()
    assert r.loc.fmt == fmt and (r.arch.tp, r.arch.pp, r.arch.dp) == (topology["tp"], topology["pp"], topology["dp"])
    assert r.args.mtp_num_layers == 2 and r.arch.mtp == (1 if fixture == REPEATED else 2)
    assert compare_megatron(r, fixture) > 0
