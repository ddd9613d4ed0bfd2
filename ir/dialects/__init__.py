"""meshfold's own ops beyond ATen, one module per dialect; importing this package registers them all.

This is the one registration list of our ops: a dialect module defines its ``OpDef``s at import, and
``DIALECTS`` names every module that does (``tests/unit/test_ir_registers_its_ops.py`` checks that
each op the IR defines resolves after ``import meshfold.ir`` alone).
"""

from meshfold.ir.dialects import (
    constant,  # NOTE: meshfold.constant
    conv,  # NOTE: meshfold.causal_conv1d and its backward
    moe,  # NOTE: meshfold.moe_experts, its backward and the ranged forms
    ring,  # NOTE: meshfold.ring_step, its backward and lse_merge
    scan,  # NOTE: meshfold.affine_scan and its backward
    stage,  # NOTE: meshfold.stage_in and its gradient
)

DIALECTS = (constant, conv, moe, ring, scan, stage)
