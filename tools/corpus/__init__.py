"""The differential corpus (``meshfold corpus``): real model code nobody here wrote, and models drawn
from a grammar of real-world blocks, each under every plan family on four ranks against the same
model on one device.

* ``registry``: the entries (``Entry``: how to build the model small with seeded random weights,
  its kind, whose code it is, and the traits that decide which plans apply);
* ``entries``: transformers' families, torchtitan's models, scripts written the way research code is
  (nanoGPT-style), and the models drawn from a grammar of real-world blocks;
* ``plans``: the columns, one or more per plan family;
* ``cell``: one cell on the ranks of a pool; ``matrix``: all of them, the table and its counts;
* ``slice``: the cells the test suite runs; ``command``: the CLI.
"""
