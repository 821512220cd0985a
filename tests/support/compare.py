"""Comparisons the test modules share: loaded checkpoint objects equal, bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch

from reshard.formats.deepspeed.checkpoint import DeepSpeedCheckpoint
from reshard.jobs.convert import convert
from reshard.storage.safe_load import load

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        same(vars(a), vars(b), where)
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def same_strict(a, b, path: str = "", skip: tuple[str, ...] = ()) -> None:
    """Object-for-object equality of two loaded files: dict key order, types, and for tensors
    dtype, shape, strides, requires_grad, storage size and offset, attributes (``ds_id``) and
    every bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        ma, mb = (tensor_meta(t) for t in (a, b))
        assert ma == mb, (path, ma, mb)
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            if k not in skip:
                same_strict(a[k], b[k], f"{path}/{k}", skip)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same_strict(x, y, f"{path}/{i}", skip)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b) and vars(a) == vars(b), path
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def tensor_meta(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.requires_grad, t.storage_offset(),
            t.untyped_storage().nbytes(), dict(vars(t)))


def assert_same_as_ds_to_universal(ours: Path, theirs: Path, expected: str) -> None:
    """``reshard convert``'s folder ``ours`` holds ``ds_to_universal``'s files (``expected`` among
    them): model-state files (rewritten by both under AutoEP) byte for byte, the rest object for
    object, tensor for tensor."""
    their_files = sorted(p.relative_to(theirs).as_posix() for p in theirs.rglob("*.pt"))
    assert sorted(p.relative_to(ours).as_posix() for p in ours.rglob("*.pt")) == their_files
    assert expected in their_files
    for rel in their_files:
        if "model_states" in rel:
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel
            continue
        same(load(ours / rel), load(theirs / rel), rel)


def diff_files(ours: Path, theirs: Path, *, group_names: dict[str, str] | None = None) -> None:
    """Our files equal DeepSpeed's own save at the target, tensor for tensor and key for key; only
    ``ds_config`` differs (DeepSpeed records the resuming job's config, reshard the source's). With
    ``group_names`` (``{ours: theirs}``), an optimizer group of ours so named is named so in theirs:
    DeepSpeed's universal loader copies the saved groups' names over its own (an AutoEP expert
    group resumed at another EP keeps the source's ``ep_size_N``), where reshard names it as
    DeepSpeed's engine does at the target EP."""
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    for p in theirs.glob("*.pt"):
        a, b = load(ours / p.name), load(p)
        if isinstance(b, dict):
            for obj in (a, b):
                obj.pop("ds_config", None)
            osd = a.get("optimizer_state_dict")
            base = osd.get("base_optimizer_state") if isinstance(osd, dict) else None
            for pg in (base or {}).get("param_groups", []) if group_names else []:
                pg["name"] = group_names.get(pg.get("name"), pg.get("name"))
        same(a, b, p.name)


def flat_universal(ckpt: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{param: {state: flat fp32 tensor}} of ``reshard.convert`` of a checkpoint at any ZeRO stage."""
    folder = convert(ckpt, out).out_dir
    params = {}
    for d in sorted(p for p in (folder / "zero").iterdir() if p.is_dir()):
        objs = {s: load(d / f"{s}.pt", mmap=False) for s in STATES}
        params[d.name] = {s: (o["param"] if isinstance(o, dict) else o).reshape(-1) for s, o in objs.items()}
    return params


def rebase_ds_ids(obj: dict) -> dict:
    """``ds_id`` counts parameters over every ZeRO-3 engine a process has built, so a save by a
    job's later engine numbers from where the earlier ones stopped (``"63_83"`` for the fourth
    21-parameter engine): compare the numbering from its first parameter."""
    flats = obj.get("optimizer_state_dict", {}).get("fp32_flat_groups") or []
    first = int(flats[0].ds_id.split("_")[0]) if flats else 0
    for t in flats:
        t.ds_id = "_".join(str(int(x) - first) for x in t.ds_id.split("_"))
    return obj


def full_state(ck: DeepSpeedCheckpoint, name: str, state: str) -> torch.Tensor:
    """The logical tensor of one optimizer state, as reshard's DeepSpeed reader rebuilds it from
    the ranks' fragments: how a target is compared with its source, each read the way every route
    reads them."""
    from reshard.formats.deepspeed.reader import DeepSpeedReader

    reader = DeepSpeedReader(ck)
    m = reader.map(name, state)
    return m.rebuild({r: reader.fragment(name, state, r) for r in m.ranks})


def skeleton(obj):
    """``obj`` with tensors as (dtype, shape), without the step counters and the Adam state (a fresh
    engine has taken no step, so its ``base_optimizer_state.state`` is empty): the file's layout."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape))
    if isinstance(obj, dict):
        return [(k, skeleton(v)) for k, v in obj.items() if k not in ("global_steps", "global_samples", "state")]
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [skeleton(v) for v in obj])
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj).__name__, skeleton(vars(obj)))
    return obj
