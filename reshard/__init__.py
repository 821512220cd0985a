"""reshard: move distributed-training checkpoints between parallel topologies exactly.

The centre is an affine IR (``reshard.ir``): a parameter's map says, for every rank, which
affine blocks of the full tensor F its shard holds. See docs/spec.md.
"""

import gc as _gc
import os as _os
import sys as _sys

__version__ = "0.1.0"

# As the ``reshard`` command (or ``python -m reshard``, which torchrun runs), collect nothing
# while torch and reshard are imported, then freeze what they made: about a million objects,
# none of them garbage, that the full collections of an import (~60 ms of start-up) and of the
# job (~0.3 s of CPU per 3 GB) would otherwise walk again and again. A library import is left
# as it is.
_command = _sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0] if _sys.argv else "") == "reshard"
if _command:
    _gc.disable()
try:
    from . import layouts
    from .convert import convert
    from .derive import derive
    from .errors import (
        CheckpointError,
        MapError,
        MapFormatError,
        NotAffineError,
        OutputError,
        PlanError,
        PlotUnavailable,
        ReplicaMismatchError,
        ReshardError,
        ShardError,
        TopologyError,
    )
    from .execute import apply_model_plan, apply_plan
    from .formats.output import verify
    from .ir import (
        ParamMap,
        Piece,
        Shard,
        View,
        canonicalize,
        check,
        maps_from_document,
        maps_to_document,
        piece,
        uncovered,
    )
    from .offline import reshard as reshard_checkpoint
    from .plan import ModelPlan, PlanStats, Segment, TransferPlan, Unfilled
    from .plan_format import model_plan_from_dict, model_plan_to_dict, plan_from_dict, plan_to_dict
    from .planner import CostModel, DefaultCost, plan, plan_for_rank, plan_model
    from .reports import ConvertReport, ReshardReport
    from .reshard_dcp import reshard_dcp_files
    from .retarget import TopologyPlan, plan_topology
    from .topology import Topology
finally:
    if _command:
        _gc.freeze()
        _gc.enable()

__all__ = [
    "CheckpointError",
    "ConvertReport",
    "CostModel",
    "DefaultCost",
    "ModelPlan",
    "PlanStats",
    "ReshardReport",
    "Segment",
    "Topology",
    "TopologyPlan",
    "TransferPlan",
    "Unfilled",
    "apply_model_plan",
    "apply_plan",
    "model_plan_from_dict",
    "model_plan_to_dict",
    "plan_from_dict",
    "plan_to_dict",
    "convert",
    "derive",
    "layouts",
    "plan",
    "plan_for_rank",
    "plan_model",
    "reshard_dcp_files",
    "plan_topology",
    "reshard_checkpoint",
    "verify",
    "MapError",
    "MapFormatError",
    "NotAffineError",
    "OutputError",
    "ParamMap",
    "PlanError",
    "PlotUnavailable",
    "TopologyError",
    "Piece",
    "ReplicaMismatchError",
    "ReshardError",
    "Shard",
    "ShardError",
    "View",
    "canonicalize",
    "check",
    "maps_from_document",
    "maps_to_document",
    "piece",
    "uncovered",
]
