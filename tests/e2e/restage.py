"""DeepSpeed's own universal checkpoint of one ZeRO stage, laid out for DeepSpeed's universal loader
of another (test scaffolding for the cross-stage end-to-end tests of ``tests/formats/deepspeed/test_zero3_reshard.py``).

``ds_to_universal`` of a ZeRO-3 checkpoint cannot be loaded with ``load_universal`` by a ZeRO-1/2
engine, nor that of a ZeRO-1/2 checkpoint by a ZeRO-3 engine (DeepSpeed 0.19.8): the engine looks
for the model-state file its own stage names (``mp_rank_00_model_states.pt`` vs
``zero_pp_rank_0_mp_rank_00_model_states.pt``) and finds none (``AssertionError`` in
``state_dict_factory.check_ckpt_list``); past that, ZeRO-1/2's loader wants each ``zero/<param>/<state>.pt``
as ``{'param': tensor of the parameter's shape}`` plus a ``step.pt`` where ZeRO-3's converter writes a bare
flat tensor and no step, and ZeRO-3's loader reads ``step`` from ``optimizer_state.pt``'s
``optimizer_state_dict``, which ZeRO-1/2's converter does not write. :func:`restage` moves the same
tensors into the other stage's layout and nothing else:

* to ZeRO-1/2: each state file becomes ``{'param': t.view(shape), 'cat_dim': 0}`` (as
  ``ds_to_universal`` writes it for a ZeRO-1/2 source), ``step.pt`` is the recorded step,
  ``optimizer_state.pt`` gains ``clip_grad`` (the config's) and ``ds_version``, and
  ``mp_rank_00_model_states.pt`` is DP rank 0's ZeRO-3 model states with every parameter as zeros
  of its full shape (the engine overwrites the weights from the fp32 master after a universal load,
  ``update_lp_params``; zeros make any failure to do so obvious);
* to ZeRO-3: the state files stay (ZeRO-3's loader reads the dict format too),
  ``optimizer_state.pt`` gains ``optimizer_state_dict`` (the recorded step and ``param_groups``),
  and ``zero_pp_rank_0_mp_rank_00_model_states.pt`` is the ZeRO-1/2 model states with every
  parameter a 0-element placeholder, as a ZeRO-3 save holds them.

A DeepSpeed engine at the target stage then loads it with ``load_universal`` and saves natively:
that save is DeepSpeed's own checkpoint of the source's state at the other stage.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path

import torch

STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _load(path: Path):
    return torch.load(path, weights_only=False)


def _params(ms: dict) -> dict[str, tuple[int, ...]]:
    groups = ms["param_shapes"] if isinstance(ms["param_shapes"], list) else [ms["param_shapes"]]
    return {n: tuple(s) for g in groups for n, s in g.items()}


def restage(ucp_root: Path, out_root: Path, stage: int) -> Path:
    """Copy the universal checkpoint under ``ucp_root`` (the folder holding ``latest_universal``)
    to ``out_root``, laid out for a ZeRO-``stage`` engine's ``load_universal``; returns ``out_root``."""
    shutil.copytree(ucp_root, out_root)
    tag = out_root / (out_root / "latest_universal").read_text().strip()
    zero = tag / "zero"
    optim = _load(zero / "optimizer_state.pt")
    if stage == 3:
        (ms_path,) = tag.glob("mp_rank_*_model_states.pt")
        ms = _load(ms_path)
        params = _params(ms)
        step = _load(zero / next(iter(params)) / "step.pt")
        optim["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": optim["param_groups"]}
        module = ms["module"]
        ms["module"] = OrderedDict((k, torch.empty(0, dtype=v.dtype) if k in params else v) for k, v in module.items())
        ms_path.unlink()
        torch.save(ms, tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    else:
        ms_paths = sorted(tag.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))
        ms = _load(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        params = _params(ms)
        step = optim["optimizer_state_dict"]["state"][0]["step"]
        for name, shape in params.items():
            for state in STATES:
                path = zero / name / f"{state}.pt"
                torch.save({"param": _load(path).view(shape), "cat_dim": 0}, path)
            torch.save(step.clone(), zero / name / "step.pt")
        optim["clip_grad"] = ms["ds_config"].get("gradient_clipping", 0.0)
        optim["ds_version"] = ms["ds_version"]
        module = ms["module"]
        ms["module"] = OrderedDict((k, torch.zeros(params[k], dtype=v.dtype) if k in params else v)
                                   for k, v in module.items())
        for p in ms_paths:
            p.unlink()
        torch.save(ms, tag / "mp_rank_00_model_states.pt")
    torch.save(optim, zero / "optimizer_state.pt")
    return out_root
