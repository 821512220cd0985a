"""What a Megatron-Core checkpoint holds beside the parameter states it lowers
(``formats.contract.Held``), and which of it a Megatron target carries as it is.

``torch_dist``: a tensor entry no parameter, optimizer state or distributed-optimizer bucket
takes is model weights reshard has no parameter for (refused unless dropped, never lost); the
``_extra_state`` objects, RNG states, the rerun state machine's and the entries of
``common_state`` beside ``args`` and the optimizer's are a run's state. Legacy files: the same of
each ``model_optim_rng.pt``'s model state dicts and top-level entries.
"""

from __future__ import annotations

from typing import Any

from ..contract import Held
from ..dcp import checkpoint as dcp
from .buckets import copy_name
from .dist import _BUCKET, _STATE_KINDS, TorchDistBackend
from .legacy import LegacyBackend

__all__ = ["carried", "held"]

# common_state / a legacy file's top level: what the reader reads (args, the optimizer's groups and
# step, the layout's metadata), else a run's state
READ = ("args", "optimizer", "content_metadata", "checkpoint_version", "model")
# what a Megatron target's common_state keeps of its source's (common.common_state)
KEPT = ("checkpoint_version", "iteration", "opt_param_scheduler", "rerun_state_machine",
        "num_floating_point_operations_so_far")
_WHY = {"iteration": "the iteration count", "opt_param_scheduler": "the learning-rate scheduler's state",
        "rerun_state_machine": "the rerun state machine's state", "rng_state": "the ranks' RNG states",
        "num_floating_point_operations_so_far": "the run's floating-point operation count",
        "rerun_state_machine_state": "the rerun state machine's state"}
EXTRA = "_extra_state"


def _why(key: str) -> str:
    head = key.split("/", 1)[0]
    if head.endswith(EXTRA):
        return "a module's _extra_state (Transformer Engine's FP8 metadata; None in the local spec)"
    return _WHY.get(head, "a run's state reshard does not read")


def held(src: TorchDistBackend | LegacyBackend, specs: Any) -> list[Held]:
    """Every entry of ``src`` beside the states of the parameters ``specs`` (``{key: KeySpec}``)."""
    return _dist(src, specs) if isinstance(src, TorchDistBackend) else _legacy(src)


def _dist(src: TorchDistBackend, specs: Any) -> list[Held]:
    where = str(src.dir / dcp.METADATA)
    used = set()
    for spec in specs.values():
        used.add(spec.key)
        for names in _STATE_KINDS.values():
            for n in names:
                for prefix in ("", "chained_0.", "chained_1."):
                    used.add(f"{prefix}optimizer.state.{n}.{spec.key}")
    out = [Held(k, where, "state" if k.startswith(("optimizer.", "chained_")) else "weights",
                "optimizer state of no parameter reshard reads" if k.startswith(("optimizer.", "chained_"))
                else "a tensor entry that is no parameter reshard reads")
           for k in src.ck.tensors if k not in used and not _BUCKET.match(k)]
    for key in src.ck.objects:
        if key == "common_state/shard_0_1":
            out += [Held(f"common_state/{k}", where, "state", _why(k)) for k in src.common if k not in READ]
        elif ".optimizer.distributed." in f".{key}" or key.startswith("chained_"):
            continue  # the distributed optimizer's groups and bucket sizes: read (param_groups, the layout)
        else:
            out.append(Held(key, where, "state", _why(key)))
    return out


def _legacy(src: LegacyBackend) -> list[Held]:
    a, out = src.arch, []
    for (tp, pp, ep), f in sorted(src.files.items()):
        sd = src.state_dict((tp, pp, ep))
        for v, mk in enumerate(src._model_keys):  # every file holds its TP part of the dense keys, its EP rank's experts
            local = {src._local_name(lp) for lp in a.stage_params(pp, tp, vp=v)}
            if a.experts:
                local |= {src._local_name(lp) for lp in a.stage_params(pp, 0, expert_rank=ep, vp=v)}
            # buffers read as keys (a router's expert_bias): no parameter, so not in stage_params
            local |= {src._local_name(lp) for s in a.keys() if s.buffer for lp in a.locals_of(s)
                      if lp.tp == tp and a.stage_of(s, lp.index) == pp and src._chunk_of(lp) == v}
            if src.embedding_copy(pp) and v == a.vpp - 1:  # the embedding copy: checked equal to the first stage's
                local.add(copy_name(a))
            for name in sd[mk]:
                if name in local:
                    continue
                extra = name.endswith(EXTRA)
                out.append(Held(f"{mk}.{name}" if len(src._model_keys) > 1 else name, str(f),
                                "state" if extra else "weights",
                                _why(name) if extra else "a module tensor that is no parameter reshard reads"))
        for k in sd:
            if k in READ or k.startswith("model") or (k in KEPT and (tp, pp, ep) != min(src.files)):
                continue  # the common entries once, from the first file
            rank = f"TP {tp}, PP {pp}" + (f", EP {ep}" if a.ep > 1 else "")
            out.append(Held(k if k != "rng_state" else f"rng_state ({rank})", str(f), "state", _why(k)))
    return out


def carried(held: Held, *, template: bool, objects: set[str], rng: bool, rerun: bool) -> bool:
    """Whether a Megatron target carries ``held``: its common_state keeps the source's ``KEPT``
    entries (``template``: from a Megatron source), writes the ``_extra_state`` records ``objects``
    names as the source's, and copies the RNG and rerun records where Megatron would load them."""
    key = held.key
    if key.startswith("common_state/") or key in KEPT:
        return template and key.rpartition("/")[2] in KEPT
    if key in objects:
        return True
    if key.startswith("rng_state"):
        return rng
    if key.startswith("rerun_state_machine_state"):
        return rerun
    return False
