"""meshfold's IR: named meshes, layouts, typed values, ops and graphs, with a text form.

``ir`` imports nothing else of meshfold's.
"""

from meshfold.ir import dialects  # noqa: F401  # NOTE: registers every op of ours, so IR text naming one parses
from meshfold.ir.graph import (
    Arg,
    Graph,
    GraphBuilder,
    GraphInput,
    GraphOutput,
    Op,
    ParamStack,
    Phase,
    Provenance,
    TextPosition,
    Value,
    map_values,
)
from meshfold.ir.mesh import Mesh
from meshfold.ir.ops import (
    OpDef,
    Target,
    ViewTrait,
    collective_for,
    is_pure,
    is_view,
    own_ops,
    resolve_target,
    target_name,
    view_trait,
)
from meshfold.ir.parser import ParseError, parse
from meshfold.ir.placement import Layout, Partial, Placement, R, Replicate, Shard, parse_placement
from meshfold.ir.printer import print_graph
from meshfold.ir.rewrite import PatternTable, Rewriter, apply_patterns
from meshfold.ir.specialize import specialize
from meshfold.ir.types import ScalarType, TensorType, Type, dtype_name, is_float8, tensor_type, type_of
from meshfold.ir.verifier import VerifyError, verify

__all__ = [
    "constant",
    "conv",
    "specialize",
    "moe",
    "ring",
    "scan",
    "stage",
    "Arg",
    "Graph",
    "GraphBuilder",
    "GraphInput",
    "GraphOutput",
    "Layout",
    "Mesh",
    "Op",
    "ParamStack",
    "OpDef",
    "ParseError",
    "Partial",
    "PatternTable",
    "Phase",
    "Placement",
    "Provenance",
    "R",
    "Replicate",
    "Rewriter",
    "ScalarType",
    "Shard",
    "Target",
    "TensorType",
    "TextPosition",
    "Type",
    "Value",
    "ViewTrait",
    "VerifyError",
    "apply_patterns",
    "collective_for",
    "dtype_name",
    "is_float8",
    "is_pure",
    "is_view",
    "map_values",
    "own_ops",
    "parse",
    "parse_placement",
    "print_graph",
    "resolve_target",
    "target_name",
    "tensor_type",
    "type_of",
    "verify",
    "view_trait",
]
