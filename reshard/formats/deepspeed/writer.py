"""A DeepSpeed 0.19.8 checkpoint at a topology, written from any source, as DeepSpeed itself
would have saved it there (so ``engine.load_checkpoint`` loads it natively, no universal
checkpoint involved): ``OUT/<tag>`` and ``OUT/latest``.

:class:`DeepSpeedWriter` decides which layout the target takes and refuses, before any output
folder exists, what it cannot write:

* ZeRO-1/2 at TP x DP (x PP), from a ZeRO-1/2, ZeRO-3 or non-DeepSpeed source;
* ZeRO-3 at TP x DP;
* AutoEP or classic MoE experts at another EP x DP, AutoEP under pipeline parallelism at another
  PP x EP x DP (``expert_pipe``), AutoEP under ZeRO-3 (``placement``), an
  AutoEP ZeRO-3 checkpoint at ZeRO-1/2 (its weights the fp32 masters cast), and an AutoEP
  ZeRO-1/2 checkpoint at ZeRO-3;
* AutoEP folded over TP > 1 (AutoEP x AutoTP) at ZeRO-1/2 and at ZeRO-3 (``expert_folded``), from
  an AutoEP ZeRO-1/2 or ZeRO-3 source and, with ``--layout``, from a universal, DCP or HF one.
* classic MoE saved at TP > 1 through an ``mpu`` at its own TP or at TP 1 (``moe_tp_target``).

Every kind is one :class:`~reshard.formats.deepspeed.target.DeepSpeedTarget` over a
:class:`~reshard.formats.deepspeed.layout.Layout` (outer maps, partition groups, flat groups or
sub-groups).

The target's model-parallel maps come from ``target_layout``: the source's TP maps kept, whole at
TP=1, or from ``layout=`` at another degree (a Hugging Face folder without one: its architecture's
tensor-parallel plan in transformers). From a DeepSpeed source every file is built on the
source's own dictionaries (``templates.from_deepspeed``); from any other on those of a fresh ZeRO
job (``templates.fresh``): moments the source lacks are zeros and Adam's step the source's or 0,
as a fresh optimizer holds them (said in the report).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointError, ReshardError
from ...layouts import replicated
from ...storage.staging import ArchiveJob
from ..contract import BEST, Buffer, Held, Reader, Writer
from ..table import noun_of
from . import experts as dse
from . import templates
from .expert_pipe import autoep_pipe_target
from .expert_pipe import is_pipeline_module as pipeline_autoep
from .expert_target import autoep_from_zero3_target, moe_target
from .reader import DeepSpeedNative
from .target import (
    DeepSpeedTarget,
    autoep_zero3_target,
    zero3_target,
    zero12_target,
)
from .target_layout import TargetLayout, hf_plan_maps, layout_sources, target_stage_maps, target_tp_maps

__all__ = ["DeepSpeedWriter"]


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ReshardError(f"{what} must be a positive integer (--{what.replace('_', '-')}), got {value!r}")
    return value


class DeepSpeedWriter(Writer):
    format = "deepspeed"
    latest = "latest"

    def __init__(self, reader: Reader, *, tp: int = 1, dp: int | None = None, pp: int = 1, zero_stage: int | None = None,
                 ep: int | None = None, layout: TargetLayout = None, dtype: torch.dtype | None = None) -> None:
        tp, pp = _positive(tp, "tp"), _positive(pp, "pp")
        if dp is not None:
            _positive(dp, "dp")
        if ep is not None:
            _positive(ep, "ep")
        self.reader, self.tag = reader, reader.tag
        self.extra_sources = layout_sources(layout)
        self._notes: list[str] = []
        self._source: dict[str, int] = {}
        self._written_aliases: set[str] = set()
        self._view: Reader | None = None  # the source as an AutoEP target names it (autoep_view)
        self.keeps_replicas = False
        self.target: DeepSpeedTarget
        frozen = reader.frozen()
        if frozen and (tp > 1 or pp > 1 or ep is not None):  # no DeepSpeed-written checkpoint shows where they go
            what = f"TP={tp}" if tp > 1 else f"PP={pp}" if pp > 1 else f"EP={ep}"
            raise ReshardError(f"{reader.sources[-1]}: frozen parameter {frozen[0]!r} ({len(frozen)} frozen): a "
                               f"DeepSpeed target at {what} is not written with frozen parameters (only at TP = PP = 1 "
                               "without experts, where DeepSpeed's own saves show their records)")
        own = reader.native("deepspeed")
        self.own = own if isinstance(own, DeepSpeedNative) else None  # a DeepSpeed source's files and layout
        if self.own is not None:
            self._from_deepspeed(self.own, tp, dp, pp, zero_stage, ep, layout)
        else:
            self._from_any(reader, tp, dp or 1, pp, zero_stage, ep, layout, dtype)

    # -- which layout --------------------------------------------------------------------------------
    def _from_deepspeed(self, own: DeepSpeedNative, tp: int, dp: int | None, pp: int, stage: int | None,
                        ep: int | None, layout: TargetLayout) -> None:
        ck = own.ck
        if dp is None and ck.experts is not None and ck.pp == 1 and (ck.mp * ck.dp) % tp == 0:
            dp = ck.mp * ck.dp // tp  # AutoEP folded or not: the job's world kept
        dp = ck.dp if dp is None else dp
        source = {"tp": ck.tp, "dp": ck.dp, "pp": ck.pp, "zero_stage": ck.zero_stage}
        if ck.experts is not None:  # a target DeepSpeed's own folding refuses, whatever else is asked
            from .placement import check_folding
            check_folding(ck.tag_dir, tp, ep if ep is not None else ck.experts.ep, pp, ck.experts.data_before_expert)
        if ck.experts is not None and (ck.pp > 1 or pp > 1) and pipeline_autoep(ck):
            self._autoep_pipe(ck, tp, dp, pp, stage, ep if ep is not None else ck.experts.ep, layout)
        elif ck.experts is not None and tp > 1 and pp == 1 and (stage == 3 or (stage is None and ck.zero_stage == 3)):
            self._autoep_folded_zero3(ck, tp, dp, ep if ep is not None else ck.experts.ep, layout)
        elif ck.zero_stage == 3 and ck.experts is not None and tp > 1 and pp == 1 and stage in (1, 2):
            self._autoep_folded_from_zero3(ck, tp, dp, stage, ep if ep is not None else ck.experts.ep, layout)
        elif ck.zero_stage == 3 and ck.experts is not None:
            self._autoep_zero3(ck, tp, dp, pp, stage, ep if ep is not None else ck.experts.ep)
        elif ep is not None or (ck.zero_stage != 3 and (ck.experts is not None or ck.moe is not None)):
            self._experts(ck, tp, dp, pp, stage, ep if ep is not None else (ck.experts or ck.moe).ep, layout)
        elif ck.zero_stage == 3 or stage == 3:
            self._zero3_route(own, tp, dp, pp, stage, layout)
        else:
            self._zero12_route(own, tp, dp, pp, stage, layout)
        if "ep" not in self._source:
            self._source = source
        self.keeps_replicas = self._target["tp"] == ck.tp

    def _autoep_pipe(self, ck: Any, tp: int, dp: int, pp: int, stage: int | None, ep: int,
                     layout: TargetLayout) -> None:
        """AutoEP under pipeline parallelism: the same PipelineModule job at ``pp`` stages (kept or merged
        into one), EP ``ep``, DP ``dp`` (``expert_pipe``)."""
        from .expert_pipe import check_autoep_pipe

        stage = ck.zero_stage if stage is None else stage
        check_autoep_pipe(ck, ep, dp, tp, pp, stage)
        self.target = autoep_pipe_target(ck, pp=pp, ep=ep, dp=dp, split_from=layout)
        self._source = {"tp": 1, "dp": ck.dp, "pp": ck.pp, "zero_stage": ck.zero_stage, "ep": ck.experts.ep}
        self._target = {"tp": 1, "dp": dp, "pp": pp, "zero_stage": stage, "ep": ep}
        self._notes += self.target.notes

    def _autoep_zero3(self, ck: Any, tp: int, dp: int, pp: int, stage: int | None, ep: int) -> None:
        from .placement import check_autoep_zero3

        stage = 3 if stage is None else stage
        check_autoep_zero3(ck, ep, dp, tp, pp, stage)
        self.target = autoep_zero3_target(ck, ep, dp) if stage == 3 else autoep_from_zero3_target(ck, ep, dp, stage)
        self._source = {"tp": 1, "dp": ck.dp, "pp": 1, "zero_stage": 3, "ep": ck.experts.ep}
        self._target = {"tp": 1, "dp": dp, "pp": 1, "zero_stage": stage, "ep": ep}
        self._notes += self.target.notes

    def _experts(self, ck: Any, tp: int, dp: int, pp: int, stage: int | None, ep: int, layout: TargetLayout) -> None:
        from .placement import EXPERT_FILE, check_autoep, check_moe

        stage = ck.zero_stage if stage is None else stage
        if ck.experts is not None and tp > 1 and stage == ck.zero_stage and pp == 1:
            self._autoep_folded(ck, tp, dp, stage, ep, layout)
            return
        if ck.experts is None and ck.zero_stage != 3 and ck.moe is not None:
            check_moe(ck, ep, dp, tp, pp, stage, layout=layout)
            if ck.tp > 1 or tp > 1:  # saved through an mpu (its own TP or 1), or a TP-1 one at a --layout's TP
                from .moe_tp_target import moe_tp_target
                maps, info = None, None
                if tp != ck.tp and tp > 1:
                    dense = [n for g, grp in enumerate(ck.groups(0)) if g not in ck.moe.groups for n in grp]
                    maps, info, _ = target_tp_maps(ck, dense, tp, layout)
                self.target = moe_tp_target(ck, tp, ep, dp, stage, maps, info)
                self._source = {"tp": ck.tp, "dp": ck.dp, "pp": 1, "zero_stage": ck.zero_stage, "ep": ck.moe.ep}
                self._target = {"tp": tp, "dp": dp, "pp": 1, "zero_stage": stage, "ep": ep}
                self._notes += self.target.notes
                return
            self.target = moe_target(ck, ep, dp, stage, [ck.moe.files[k] for k in sorted(ck.moe.files)])
            source_ep = ck.moe.ep
        elif ck.experts is not None and ck.zero_stage in (1, 2) and stage == 3:
            self._autoep_to_zero3(ck, tp, dp, pp, ep)
            return
        else:
            check_autoep(ck, ep, dp, tp, pp, stage)
            files = sorted(ck.tag_dir.glob("layer_*_expert_*_mp_rank_*_model_states.pt"))
            want = {EXPERT_FILE.format(layer=p.layer, expert=x) for p in ck.experts.params.values()
                    for x in range(p.full_shape[0])}
            # folded: per-expert files named by their writer's TP rank, rewritten (checks.check_expert_files)
            missing = [] if ck.experts.folded else sorted(want - {p.name for p in files})
            if missing:
                raise CheckpointError(f"{ck.tag_dir}: AutoEP per-expert files missing: {missing[:3]}")
            # the one AutoEP target, without pipeline stages here (expert_pipe); a folded source unfolded
            self.target = autoep_pipe_target(ck, pp=1, ep=ep, dp=dp, zero_stage=stage,
                                             strays=[] if ck.experts.folded else [f for f in files if f.name not in want])
            source_ep = ck.experts.ep
        self._source = {"tp": ck.tp, "dp": ck.dp, "pp": 1, "zero_stage": ck.zero_stage, "ep": source_ep}
        self._target = {"tp": 1, "dp": dp, "pp": 1, "zero_stage": stage, "ep": ep}
        self._notes += self.target.notes

    def _autoep_folded(self, ck: Any, tp: int, dp: int, stage: int, ep: int, layout: TargetLayout) -> None:
        """AutoEP at TP > 1, folded as DeepSpeed saves it (``expert_folded.autoep_folded_target``): the
        dense TP maps the source's at its own folded TP, else a DeepSpeed checkpoint's at ``tp``
        (``--layout``), whose ``universal_checkpoint_info`` DeepSpeed records at that topology."""
        from .expert_folded import autoep_folded_target
        from .placement import check_autoep, check_folded_target

        check_autoep(ck, ep, tp * dp, 1, 1, stage)  # the placement, stage and steps (at TP 1's rules)
        check_folded_target(ck, ep, tp)
        dense = [n for g, grp in enumerate(ck.groups(0)) if g not in ck.experts.groups for n in grp]
        maps, info = self._folded_maps(ck, dense, tp, layout)
        self.target = autoep_folded_target(ck, tp, ep, dp, stage, maps, info)
        self._source = {"tp": ck.tp, "dp": ck.dp, "pp": 1, "zero_stage": ck.zero_stage, "ep": ck.experts.ep}
        self._target = {"tp": tp, "dp": dp, "pp": 1, "zero_stage": stage, "ep": ep}
        self._notes += self.target.notes

    @staticmethod
    def _folded_maps(ck: Any, dense: list[str], tp: int, layout: TargetLayout) -> tuple[dict, dict | None]:
        """A folded target's dense TP maps and the ``universal_checkpoint_info`` DeepSpeed records with
        them: the source's at its own folded TP, else a DeepSpeed checkpoint's at ``tp`` (``--layout``)."""
        if layout is None and ck.experts.folded and tp == ck.tp:
            return {n: ck.tp_map(n).map for n in dense}, ck.model_state(0).get("universal_checkpoint_info")
        if isinstance(layout, (str, Path)) and Path(layout).is_dir():
            maps, info, _ = target_tp_maps(ck, dense, tp, layout)
            return maps, info
        raise ReshardError(f"{ck.tag_dir}: an AutoEP target at TP={tp} takes its dense TP maps and the "
                           "universal_checkpoint_info DeepSpeed records with them from a DeepSpeed checkpoint of "
                           f"this model saved folded at TP={tp} (--layout), or from a folded source at its own TP")

    def _autoep_folded_zero3(self, ck: Any, tp: int, dp: int, ep: int, layout: TargetLayout) -> None:
        """AutoEP at ZeRO-3 folded over TP > 1, as DeepSpeed saves it
        (``target.autoep_zero3`` at TP > 1), from an AutoEP ZeRO-3 source (its model
        state and optimizer file the templates) or a ZeRO-1/2 one (recast for ZeRO-3); the dense
        TP maps as for a folded ZeRO-1/2 target."""
        from . import zero3 as z3
        from .expert_target import optim_zero3_from_zero12, zero3_template_from_zero12
        from .placement import check_folded_zero3
        from .target import autoep_zero3

        check_folded_zero3(ck, ep, tp * dp, tp, 1)
        ax, path = ck.experts, ck.model_files[0]
        if ck.zero_stage == 3:
            group_names, expert_groups, _ = z3.autoep_groups(ck)
            ids, exact = z3.autoep_ds_ids(ck, [n for g in group_names for n in g])
            template: dict = ck.model_state(0)
            optim = (lambda: ck.optim_state(0, 0))
        else:
            template, group_names, ids, exact = zero3_template_from_zero12(ck)
            expert_groups = set(ax.groups)
            optim = (lambda: optim_zero3_from_zero12(ck))
        dense = [n for g, grp in enumerate(group_names) if g not in expert_groups for n in grp]
        maps, info = self._folded_maps(ck, dense, tp, layout)
        cfg = template.get("ds_config") if isinstance(template.get("ds_config"), dict) else None
        notes = [f"AutoEP experts at EP {ep} folded over TP {tp} (DP {dp}, EDP {tp * dp // ep}), uniform placement, "
                 "ZeRO-3: one model-state and one optimizer file per (TP, DP) rank, a folding record in every file"]
        notes += templates.ds_id_notes(exact, "do not match the parameter order reshard derives")
        self.target = autoep_zero3(ax, group_names, expert_groups, ep=ep, dp=dp, template=template, optim=optim,
                                   cfg=cfg, ds_ids=ids, size=z3.sub_group_size(cfg, str(path)), bf16=ck.bf16,
                                   model_size=path.stat().st_size, notes=notes, tp=tp, maps=maps, info=info)
        self._source = {"tp": ck.tp, "dp": ck.dp, "pp": 1, "zero_stage": ck.zero_stage, "ep": ax.ep}
        self._target = {"tp": tp, "dp": dp, "pp": 1, "zero_stage": 3, "ep": ep}
        self._notes += self.target.notes

    def _autoep_folded_from_zero3(self, ck: Any, tp: int, dp: int, stage: int, ep: int, layout: TargetLayout) -> None:
        """An AutoEP ZeRO-3 checkpoint (folded or not) written folded over TP > 1 at ZeRO-1/2
        (``expert_folded.folded_target``) on its TP 1 view (``target.tp1_view``: the optimizer file
        recast for ZeRO-1/2, the module's and each per-expert file's weights the fp32 masters cast,
        as the ZeRO-3 checkpoint keeps no other copy); the dense TP maps as for every folded target."""
        from . import zero3 as z3
        from .expert_folded import folded_target
        from .expert_target import router_aliases
        from .placement import check_folded_zero3
        from .target import tp1_view

        check_folded_zero3(ck, ep, tp * dp, tp, 1)
        group_names, expert_groups, _ = z3.autoep_groups(ck)
        names = [n for g in group_names for n in g]
        template, optim, _ = tp1_view(ck)
        def per_expert_files(state: dict) -> dict:
            """The ZeRO-1/2 expert format in ``state``'s layer entries, as DeepSpeed's AutoEP ZeRO-1/2
            save records it."""
            return {**state, dse.LAYERS_KEY: [{**entry, "checkpoint_format": "per_expert_files",
                                               "checkpoint_format_version": None} for entry in state[dse.LAYERS_KEY]]}

        template = per_expert_files(template)
        dense = [n for g, grp in enumerate(group_names) if g not in expert_groups for n in grp]
        maps, info = self._folded_maps(ck, dense, tp, layout)
        info = per_expert_files(info) if isinstance(info, dict) and dse.LAYERS_KEY in info else info
        cfg = template.get("ds_config")
        clip = cfg.get("gradient_clipping", 0.0) if isinstance(cfg, dict) else 0.0
        dtype = templates.placeholder_dtype(ck, names)
        self.target = folded_target(z3.autoep(ck), group_names, template,
                                    lambda: z3.optim_source_from_zero3(optim(), clip_grad=clip), tp=tp, ep=ep, dp=dp,
                                    stage=stage, maps=maps, info=info, dtype=dtype, bf16=ck.bf16,
                                    aliases=router_aliases(template, names, str(ck.model_files[0])),
                                    group_names=dict.fromkeys(expert_groups, f"ep_size_{ep}"))
        self._source = {"tp": ck.tp, "dp": ck.dp, "pp": 1, "zero_stage": 3, "ep": ck.experts.ep}
        self._target = {"tp": tp, "dp": dp, "pp": 1, "zero_stage": stage, "ep": ep}
        self._notes += self.target.notes
        self._notes.append(f"ZeRO-3 -> ZeRO-{stage}: the module's and the per-expert files' weights are the fp32 "
                           f"masters cast to {dtype}, as the ZeRO-3 checkpoint keeps no other copy")

    def _autoep_to_zero3(self, ck: Any, tp: int, dp: int, pp: int, ep: int) -> None:
        """An AutoEP ZeRO-1/2 checkpoint at ZeRO-3 (``--zero-stage 3``)."""
        from .expert_target import autoep_to_zero3_target
        from .placement import check_autoep_to_zero3

        check_autoep_to_zero3(ck, ep, dp, tp, pp)
        self.target = autoep_to_zero3_target(ck, ep, dp)
        self._source = {"tp": ck.tp, "dp": ck.dp, "pp": 1, "zero_stage": ck.zero_stage, "ep": ck.experts.ep}
        self._target = {"tp": 1, "dp": dp, "pp": 1, "zero_stage": 3, "ep": ep}
        self._notes += self.target.notes

    def _zero3_route(self, own: DeepSpeedNative, tp: int, dp: int, pp: int, stage: int | None,
                     layout: TargetLayout) -> None:
        """ZeRO-3 at either end: a ZeRO-3 source at stage 1, 2 or 3, or a ZeRO-1/2 one at stage 3."""
        ck = own.ck
        stage = ck.zero_stage if stage is None else stage
        if pp != 1:
            raise ReshardError(f"{ck.tag_dir}: ZeRO-3 is resharded over TP and DP only (PP=1); got pp={pp}")
        if ck.zero_stage == 3 and stage not in (1, 2, 3):
            raise ReshardError(f"{ck.tag_dir}: a ZeRO-3 checkpoint is written at ZeRO stage 1, 2 or 3, not {stage!r}")
        if ck.zero_stage != 3 and (ck.zero_stage not in (1, 2) or stage != 3):
            raise ReshardError(f"{ck.tag_dir}: ZeRO stage {ck.zero_stage} -> {stage!r} is not written here (ZeRO-1/2 "
                               "-> ZeRO-3 only)")
        if ck.zero_stage != 3 and ck.pipe:
            raise ReshardError(f"{ck.tag_dir}: only a ZeRO-1/2 checkpoint without pipeline stages is written at "
                               f"ZeRO stage 3 (this one is TP={ck.tp} x PP={ck.pp})")
        tpl = templates.from_deepspeed(own)
        maps, uc_info, origin = target_tp_maps(ck, tpl.names, tp, layout)
        uc_info = uc_info if tp > 1 else None
        if stage == 3:
            self.target = zero3_target(tpl, maps, tp=tp, dp=dp, uc_info=uc_info, where=str(ck.model_files[0]),
                                       model_size=ck.model_files[0].stat().st_size)
        else:
            self.target = zero12_target(tpl, maps, tp=tp, dp=dp, pp=1, stage=stage, uc_info=uc_info)
        self._target = {"tp": tp, "dp": dp, "pp": 1, "zero_stage": stage}
        self.origin = "none (TP=1)" if tp == 1 and ck.tp == 1 else origin
        self._notes += [] if tp == 1 and ck.tp == 1 else [f"target TP layout {origin}"]
        self._notes += self.target.notes

    def _zero12_route(self, own: DeepSpeedNative, tp: int, dp: int, pp: int, stage: int | None,
                      layout: TargetLayout) -> None:
        ck = own.ck
        if ck.zero_stage not in (1, 2):
            raise CheckpointError(f"{ck.tag_dir}: ZeRO stage {ck.zero_stage} checkpoints are not supported (only 1 "
                                  "and 2); convert to a universal checkpoint with `reshard convert` instead")
        stage = ck.zero_stage if stage is None else stage
        if stage not in (1, 2):
            raise ReshardError(f"target ZeRO stage {stage!r} is not supported (only 1 and 2, which share one file "
                               "format)")
        if own.kind != "zero12":
            raise CheckpointError(f"{ck.tag_dir}: not a dense ZeRO-1/2 checkpoint")
        tpl = templates.from_deepspeed(own)
        if ck.pipe:
            maps, uc_info, origin = target_stage_maps(ck, tpl.names, tp, pp, layout, stage)
        else:
            if pp != 1:
                raise ReshardError(f"{ck.tag_dir}: not a pipeline (deepspeed.pipe) checkpoint; pp={pp} needs one")
            maps, uc_info, origin = target_tp_maps(ck, tpl.names, tp, layout)
        self.target = zero12_target(tpl, maps, tp=tp, dp=dp, pp=pp, stage=stage, uc_info=uc_info, pipe=ck.pipe,
                                    layer_files=ck.layer_files, source_ck=ck)
        self._target = {"tp": tp, "dp": dp, "pp": pp, "zero_stage": stage}
        self.origin = origin
        self._notes.append(f"target TP layout {origin}")

    def _from_any(self, reader: Reader, tp: int, dp: int, pp: int, stage: int | None, ep: int | None,
                  layout: TargetLayout, dtype: torch.dtype | None) -> None:
        """A non-DeepSpeed source: the files of a fresh ZeRO job over its parameters."""
        where = reader.sources[-1]
        if ep is not None:
            self._autoep_from_any(reader, tp, dp, pp, stage, ep, dtype, layout)
            return
        if any(lay.record for lay in reader.expert_layers()):
            # its optimizer groups are AutoEP's (the experts' marked moe, named by their EP group),
            # which a dense ZeRO engine would take for its own on load
            raise ReshardError(f"{where}: {noun_of(reader)} holds AutoEP experts (ds_autoep_layers); DeepSpeed is "
                               "written from it as an AutoEP checkpoint only: pass --ep (its EP degree)")
        if pp != 1:
            raise ReshardError(f"{where}: --pp {pp} is refused from {noun_of(reader)}: a DeepSpeed pipeline "
                               "(deepspeed.pipe) target is written only from a DeepSpeed pipeline checkpoint, whose "
                               "layer files it is built on; from this source DeepSpeed is written at "
                               "--tp/--dp/--zero-stage only (pp=1)")
        stage = 1 if stage is None else stage
        if stage not in (1, 2, 3):
            raise ReshardError(f"target ZeRO stage {stage!r} must be 1, 2 or 3")
        # an HF folder's TP layout, first: it says why when transformers is missing
        planned = hf_plan_maps(reader, tp) if tp > 1 and layout is None else None
        order = _model_order(reader)
        first = reader.names[0]
        have = reader.states(first)
        own = reader.dtype(first, next(s for s in BEST if s in have))
        steps = [reader.step(n) for n in reader.names]
        step = max((float(s.item() if isinstance(s, torch.Tensor) else s) for s in steps if s is not None), default=0.0)
        clip = reader.grad_clip()
        tpl = templates.fresh(reader, stage=stage, dtype=dtype or own, step=step, order=order, clip_grad=clip)
        if clip is None and stage != 3:
            self._notes.append("clip_grad 0.0 in the optimizer files (the source records no gradient clipping): "
                               "DeepSpeed's ZeRO-1/2 loader takes it over the job's gradient_clipping, so a "
                               "resumed job runs unclipped")
        self._written_aliases = set(tpl.shared)  # the module holds them, sharing their weight's tensor
        if tp == 1:
            maps = {n: replicated(reader.shape(n), 1) for n in reader.names}
            origin, uc_info = "whole (TP=1)", None
        else:
            if planned is not None:  # an HF folder: its architecture's tensor-parallel plan
                layout, plan_origin = planned
            if layout is None:
                raise ReshardError(f"{where}: {noun_of(reader)} does not record how its parameters split over "
                                   f"TP ranks; TP={tp} needs the layout: pass --layout (a DeepSpeed checkpoint of "
                                   f"this model saved at TP={tp}, a map document, or 'geometry')")
            maps, uc_info, origin = target_tp_maps(None, tpl.names, tp, layout,
                                                   source_maps={n: replicated(reader.shape(n), 1) for n in reader.names})
            origin = plan_origin if planned is not None else origin
        if stage == 3:
            self.target = zero3_target(tpl, maps, tp=tp, dp=dp, uc_info=uc_info, where=str(where), model_size=1 << 16)
        else:
            self.target = zero12_target(tpl, maps, tp=tp, dp=dp, pp=1, stage=stage, uc_info=uc_info)
        self._source = dict(reader.topology)
        self._target = {"tp": tp, "dp": dp, "pp": 1, "zero_stage": stage}
        self.origin = origin
        if tp > 1:
            self._notes.append(f"target TP layout {origin}")
        missing = [m for m in ("exp_avg", "exp_avg_sq") if not any(m in reader.states(n) for n in reader.names)]
        self._notes.append(f"the files of a fresh DeepSpeed ZeRO-{stage} job (DeepSpeed 0.19.8) over the source's "
                           f"parameters, training dtype {tpl.dtype}, Adam step {int(step)}"
                           + (f"; {' and '.join(missing)} zero, as a fresh optimizer holds them" if missing else ""))

    def _autoep_from_any(self, reader: Reader, tp: int, dp: int, pp: int, stage: int | None, ep: int,
                         dtype: torch.dtype | None, layout: TargetLayout = None) -> None:
        """AutoEP at EP ``ep`` from a source that holds its experts fused (``Reader.expert_layers``):
        the files of a fresh ZeRO job, AutoEP's uniform placement; a source in HF names is read in
        AutoEP's (``autoep_view``: its router renamed and aliased, gate/up cut into w1/w3)."""
        from .autoep_view import AutoEPView, autoep_view
        from .expert_folded import autoep_folded_fresh_target
        from .expert_target import autoep_fresh_target, autoep_fresh_zero3_target
        from .placement import check_folding

        where, noun = reader.sources[-1], noun_of(reader)
        if not reader.expert_layers():
            raise ReshardError(f"{where}: --ep {ep} is refused from {noun}: it holds no fused expert layers (DeepSpeed "
                               "AutoEP's ds_autoep_layers, or in Hugging Face names an MoE block's experts as fused "
                               "tensors <module>.experts.<name> [num_experts, ...]), which an AutoEP target places at "
                               "--ep; a DeepSpeed AutoEP or classic MoE checkpoint, its universal checkpoint, or a "
                               "model in HF names autoep.json has a preset for (Mixtral, Qwen3-MoE, DeepSeek-V3: a DCP "
                               "checkpoint, an HF folder, a Megatron-Core checkpoint read in HF names) holds them. Without --ep "
                               "DeepSpeed is written at --tp/--dp/--zero-stage, every parameter (experts included) a "
                               "dense one")
        view = autoep_view(reader, ep)
        if isinstance(view, AutoEPView):
            self._view = reader = view
            self._notes.append(f"the source read in DeepSpeed AutoEP's names ({view.preset} preset, autoep.json): "
                               f"{view.how}")
        layers = reader.expert_layers()
        stage = 1 if stage is None else stage
        check_folding(where, tp, ep, pp)
        if pp != 1:
            raise ReshardError(f"{where}: an AutoEP target is written at TP = PP = 1 only (asked tp={tp}, pp={pp})")
        if tp > 1 and not (isinstance(layout, (str, Path)) and Path(layout).is_dir()):
            raise ReshardError(f"{where}: an AutoEP target at TP={tp} from {noun} takes its dense TP maps and the "
                               "universal_checkpoint_info DeepSpeed records with them from a DeepSpeed checkpoint of "
                               f"this model saved folded at TP={tp} (--layout)")
        if stage not in (1, 2, 3):
            raise ReshardError(f"{where}: an AutoEP target from {noun} is written at ZeRO stage 1, 2 or 3 (asked "
                               f"{stage})")
        if stage == 3 and self._view is not None:  # ZeRO-3 AutoEP is checked against DeepSpeed from a universal only
            raise ReshardError(f"{where}: an AutoEP target from {noun} read in HF names is written at ZeRO stage 1 "
                               "or 2 (asked 3); write ZeRO-1/2 here, then --zero-stage 3 from that checkpoint")
        if (tp * dp) % ep:
            world = f"dp={dp} (EDP = dp / ep)" if tp == 1 else f"tp x dp={tp * dp} (EDP = tp x dp / ep)"
            raise ReshardError(f"ep={ep} must divide the target world size {world}")
        for lay in layers:
            if lay.num_experts % ep:
                raise ReshardError(f"{where}: {lay.module_path}: {lay.num_experts} experts do not split evenly over "
                                   f"ep={ep} (AutoEP's uniform placement)")
        order = _model_order(reader)
        held = set(reader.names)
        buffers = [n for n in reader.buffers() if n in held]  # lowered module buffers: in no optimizer group
        if tp > 1 and buffers:  # where DeepSpeed's folded AutoEP keeps a buffer: no fixture here shows it
            raise ReshardError(f"{where}: an AutoEP target folded over TP={tp} from {noun} holding module buffers "
                               f"({buffers[0]}: buffer_names) is not written (no folded DeepSpeed checkpoint with "
                               "buffers checks where they go); write it at TP 1")
        if stage == 3 and buffers:  # where DeepSpeed's AutoEP ZeRO-3 keeps a buffer: no fixture here shows it
            raise ReshardError(f"{where}: an AutoEP target at ZeRO stage 3 from {noun} holding module buffers "
                               f"({buffers[0]}: buffer_names) is not written (no DeepSpeed AutoEP ZeRO-3 checkpoint "
                               "with buffers checks where they go); write ZeRO-1/2")
        first = reader.names[0]
        own = reader.dtype(first, next(s for s in BEST if s in reader.states(first)))
        steps = [reader.step(n) for n in reader.names]
        step = max((float(s.item() if isinstance(s, torch.Tensor) else s) for s in steps if s is not None), default=0.0)
        tpl = templates.fresh(reader, stage=stage, dtype=dtype or own, step=step, order=order,
                              clip_grad=reader.grad_clip(), buffers=buffers)
        if reader.grad_clip() is None:
            self._notes.append("clip_grad 0.0 in the optimizer files (the source records no gradient clipping): "
                               "DeepSpeed's ZeRO-1/2 loader takes it over the job's gradient_clipping, so a "
                               "resumed job runs unclipped")
        experts = {n for lay in layers for n in lay.params}
        mixed = [g for g in tpl.group_names if experts & set(g) and not experts >= set(g)]
        if mixed:
            raise ReshardError(f"{where}: an optimizer parameter group of {noun} holds experts and also "
                               f"{[n for n in mixed[0] if n not in experts][:3]}; AutoEP partitions the experts' "
                               "group over EDP groups, so it holds experts only")
        shapes = {n: reader.shape(n) for n in reader.names}
        if tp > 1:  # folded (AutoEP x AutoTP): the dense TP maps a folded DeepSpeed checkpoint's (--layout)
            dense = [n for g in tpl.group_names for n in g if n not in experts]
            maps, info, _ = target_tp_maps(None, dense, tp, layout,
                                           source_maps={n: replicated(shapes[n], 1) for n in dense})
            if stage == 3:
                self.target = autoep_fresh_zero3_target(tpl, layers, shapes, ep, dp, reader.tied(), str(where), tp=tp,
                                                        maps=maps, info=info)
            else:
                self.target = autoep_folded_fresh_target(tpl, layers, shapes, tp=tp, ep=ep, dp=dp, stage=stage,
                                                         aliases=reader.tied(), maps=maps, info=info,
                                                         clip_grad=reader.grad_clip())
        elif stage == 3:
            self.target = autoep_fresh_zero3_target(tpl, layers, shapes, ep, dp, reader.tied(), str(where))
        else:
            self.target = autoep_fresh_target(tpl, layers, shapes, ep, dp, stage, reader.tied(),
                                              clip_grad=reader.grad_clip())
        self._written_aliases = set(reader.tied())
        self._source = dict(reader.topology)
        self._target = {"tp": tp, "dp": dp, "pp": 1, "zero_stage": stage, "ep": ep}
        self._notes += self.target.notes
        self._notes.append(f"the files of a fresh DeepSpeed ZeRO-{stage} job (DeepSpeed 0.19.8) over the source's "
                           f"parameters, training dtype {tpl.dtype}, Adam step {int(step)}")

    # -- the contract ----------------------------------------------------------------------------
    def buffers(self) -> list[Buffer]:
        return self.target.buffers()

    def view(self, reader: Reader) -> Reader:
        """The source in AutoEP's names where the target renamed it (``autoep_view``), else itself."""
        return self._view if self._view is not None else reader

    def tp_index(self, rank: int) -> int:
        return self.target.tp_index(rank)

    def jobs(self, engine: Any, staging: Any) -> list:
        return self.target.jobs(engine, staging, ArchiveJob)

    def carries(self, held: Held) -> bool:
        """From a DeepSpeed source, the model states' buffers, scheduler and client state (its
        model-state files are the target's templates) and the module entries an expert target
        copies as they are; from another source the tied aliases its module holds (AutoEP's router
        alias in a universal checkpoint), written from their weight."""
        if self.own is None:  # a tied alias the module holds, written from its weight
            return held.key in self._written_aliases
        f = Path(held.file)  # the tag folder (a parameter) or a model-state file in it
        return self.own is not None and (f == self.own.ck.tag_dir or (
            f.parent == self.own.ck.tag_dir and f.name.endswith("model_states.pt")))

    def meta(self) -> dict[str, Any]:
        out = {"target": "DeepSpeed checkpoint", "source_topology": self._source, "target_topology": self._target}
        if hasattr(self, "origin"):
            out["target_tp_layout"] = self.origin
        return out

    def notes(self) -> list[str]:
        return list(self._notes)


def _model_order(reader: Reader) -> list[str]:
    """The order a DeepSpeed engine flattens the source's parameters in: its model's. A format that
    does not keep it (safetensors) must be able to tell it otherwise (``model_order``), or the files
    would load into the wrong parameters."""
    order = reader.model_order()
    if order is None:
        how = {"dcp": "reshard wrote its entries in no model's order (sorted by key before entry_order, or "
                      "from a source that did not tell the model's order; its manifest lacks entry_order): "
                      "write DeepSpeed from that source itself, or the DCP checkpoint again with this reshard",
               "universal": "its model states record no param_shapes for some parameters (a universal "
                             "checkpoint written from a source without optimizer groups, such as an HF folder), "
                             "and its folders' names sorted are no model's order: write DeepSpeed from that "
                             "source itself",
               "megatron": "read in Hugging Face names it takes the order from the model transformers builds from "
                           "its config, which failed: is transformers installed and does it know the "
                           "architecture?"}.get(reader.format, "it needs the folder's config.json and transformers "
                                                "installed to build the model's order")
        raise ReshardError(f"{reader.sources[-1]}: {noun_of(reader)} does not record the model's parameter "
                           f"order, which DeepSpeed's flat ZeRO buffers follow: {how}")
    return order
