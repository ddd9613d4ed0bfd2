"""The lowering table: how each op of a rank's boxed program becomes fx nodes.

``emit.py`` holds the table's machinery (``LoweringTable``, ``EmitContext``, ``RankContext``);
``lowerings.py`` holds ``LOWERINGS``, the one table every backend lowers through, with every op
that lowers other than as a plain call on local tensors (``backends/eager.py`` builds the modules).
"""
