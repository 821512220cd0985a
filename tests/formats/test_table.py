"""The format table (``reshard.formats.table``) is what the product says and does: ``--help`` and
README.md name every source and target format with its example, from the table; ``reshard
reshard`` keeps a source's format unless ``--to`` says otherwise (read back by the format's reader,
tensor for tensor equal to the source's); a target that cannot be written is refused naming
``--to``'s choices, before anything exists; ``ucp`` is ``universal``'s alias."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from reshard.cli import build_parser, main
from reshard.errors import ReshardError
from reshard.formats import table
from reshard.formats.contract import SCALE_POWER
from reshard.formats.registry import open_reader, source_format
from reshard.jobs.convert import convert, reshard
from reshard.present.usage import synopsis
from tests.formats.megatron.support import compare_megatron
from tests.support.paths import DCP, DEEPSPEED, MEGATRON, REPO


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


def test_help_names_every_format_with_its_example(capsys):
    top = _help(capsys)
    assert synopsis() in top  # verbatim, as README.md carries it
    for f in table.FORMATS:
        assert re.search(rf"^  {re.escape(f.spelled)}\s", top, re.M), f.name
        for example in (f.source_example, f.target_example):
            assert example and example in top or not example and (f.reader is None or f.writer is None), f.name
    assert all(f.source_example for f in table.sources()) and all(f.target_example for f in table.targets())
    conv, resh = _help(capsys, "convert"), _help(capsys, "reshard")
    for f in table.convert_targets():
        assert re.search(rf"^  {re.escape(f.spelled)}\s", conv, re.M), f.name
    for f in table.reshard_targets():
        assert re.search(rf"^  {re.escape(f.name)}\s", resh, re.M), f.name
    for f in table.sources():
        assert f.noun in " ".join(conv.split()) and f.noun in " ".join(resh.split()), f.name
    # every option a target takes is a flag of its command, saying which targets take it
    for command, rows in (("convert", table.convert_targets()), ("reshard", table.reshard_targets())):
        text = " ".join(_help(capsys, command).split())
        for f in rows:
            for key in (f.convert if command == "convert" else f.reshard) or ():
                flag = table.OPTIONS[key].flag
                assert not flag or flag in text, (command, f.name, flag)


def test_readme_synopsis_is_the_help():
    readme = (REPO / "README.md").read_text()
    found = re.search(r"<!-- synopsis: .*?-->\n```text\n(.*?)\n```\n", readme, re.S)
    assert found, "README.md lost its generated synopsis block"
    assert found[1] == synopsis(), "README.md's synopsis differs from --help: paste reshard.present.usage.synopsis()"


def _tensors(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every (parameter, state) F of the checkpoint at ``path``, rebuilt from its reader's shards."""
    reader = open_reader(path)
    out = {}
    for name in reader.names:
        for state in reader.states(name):
            m = reader.map(name, state)
            shards = {r: reader.fragment(name, state, r) for r in m.ranks}
            out[name, state] = m.rebuild(shards, SCALE_POWER.get(state, 1), valid_only=True)
    return out


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), k


@pytest.mark.parametrize("source,topology", [(DEEPSPEED / "llama_tp2_dp2", {"tp": 1, "dp": 3}),
                                             (DCP / "llama_fsdp2_ws2", {"files": 3})], ids=["deepspeed", "dcp"])
def test_a_source_keeps_its_format(source, topology, tmp_path):
    report = reshard(source, tmp_path / "out", **topology)
    kind = source_format(source)
    assert report.target_format == kind and source_format(report.out_dir) == kind
    assert json.loads((report.out_dir / "reshard-manifest.json").read_text())["format"] == kind
    _same(_tensors(report.out_dir), _tensors(source))


def test_a_megatron_source_stays_megatron_with_its_iteration_naming(tmp_path):
    report = reshard(MEGATRON / "torch_dist_tp2_pp2", tmp_path / "out", tp=1)
    out = report.out_dir
    assert report.target_format == "megatron" and source_format(out) == "megatron"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert sorted(p.name for p in (out / "iter_0000003").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert not list(out.rglob("*model_states.pt"))  # no DeepSpeed files
    reader = open_reader(out)
    assert (reader.topology["tp"], reader.topology["pp"]) == (1, 2)
    assert compare_megatron(reader, "torch_dist_tp2_pp2") > 0


@pytest.mark.parametrize("source,options,match", [
    (DCP / "llama_fsdp2_ws2", {}, r"PyTorch DCP checkpoint keeps its format at --files N.*--to takes deepspeed, dcp, "
     r"megatron, vllm$"),
    (DCP / "llama_fsdp2_ws2", {"tp": 1, "dp": 2}, r"--files N.*--to takes deepspeed, dcp, megatron, vllm$"),
    (DCP / "llama_fsdp2_ws2", {"to": "megatron"},  # DCP in HF names goes to Megatron with the model's config.json
     r"a Megatron target from a PyTorch DCP checkpoint needs the model's Hugging Face config.json beside its "
     r"weights \(or --hf-config DIR\)"),
    (DEEPSPEED / "llama_zero1_dp2", {"to": "safetensors"},
     r"--to must be one of deepspeed, dcp, megatron, vllm, got 'safetensors'; safetensors has no topology"),
    (DEEPSPEED / "llama_zero1_dp2", {"optimizer": "adam"}, r"--optimizer goes with --to megatron, not with a "
     r"DeepSpeed checkpoint \(the target\)"),
    (MEGATRON / "torch_dist_tp2_pp2", {"zero_stage": 1}, r"--zero-stage goes with --to deepspeed, not with a "
     r"Megatron-Core checkpoint \(the target\)"),
    (DCP / "llama_fsdp2_ws2", {"to": "deepspeed", "tp": 2},
     r"llama_fsdp2_ws2: a PyTorch DCP checkpoint does not record how its parameters split over TP ranks"),
], ids=["dcp-no-files", "dcp-tp-dp", "dcp-to-megatron", "to-safetensors", "deepspeed-optimizer", "megatron-zero",
        "dcp-tp-words"])
def test_a_target_the_source_cannot_take_is_refused_naming_the_choices(source, options, match, tmp_path):
    with pytest.raises(ReshardError, match=match):
        reshard(source, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_ucp_and_universal_are_one_format(tmp_path, capsys):
    src = DEEPSPEED / "llama_zero1_dp2"
    a = convert(src, tmp_path / "a", fmt="ucp").out_dir
    b = convert(src, tmp_path / "b", fmt="universal").out_dir
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)  # the manifest too
    assert main(["convert", str(src), str(tmp_path / "c"), "--format", "ucp"]) == 0
    assert main(["convert", str(src), str(tmp_path / "d"), "--format", "universal"]) == 0
    capsys.readouterr()
    assert build_parser().parse_args(["convert", "S", "O", "--format", "ucp"]).format == "universal"
    assert table.row("ucp") is table.row("universal") and table.target("ucp", "convert").name == "universal"
    with pytest.raises(ReshardError, match=r"must be one of universal \(or ucp\), dcp, safetensors, hf"):
        convert(src, tmp_path / "e", fmt="deepspeed")


def test_the_command_refuses_a_dcp_source_without_files_in_one_line(tmp_path, capsys):
    assert main(["reshard", str(DCP / "llama_fsdp2_ws2"), str(tmp_path / "out"), "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--files N" in err and "--to takes deepspeed, dcp" in err
    assert not (tmp_path / "out").exists()
