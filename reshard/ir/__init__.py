"""The affine IR: pieces, maps, checks, canonical form, JSON format. No I/O."""

from .blocks import block_grid, coarsen, cut_blocks
from .canonical import canonicalize
from .check import check, uncovered
from .param_map import ParamMap, map_from_dict, map_to_dict, maps_from_document, maps_to_document
from .piece import Piece, View, piece, prod, row_major_strides
from .shard import Shard

__all__ = [
    "ParamMap",
    "Piece",
    "Shard",
    "View",
    "block_grid",
    "canonicalize",
    "check",
    "coarsen",
    "cut_blocks",
    "map_from_dict",
    "map_to_dict",
    "maps_from_document",
    "maps_to_document",
    "piece",
    "prod",
    "row_major_strides",
    "uncovered",
]
