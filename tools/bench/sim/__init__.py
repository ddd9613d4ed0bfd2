"""Benches of the cluster simulator alone (no ranks): published runs, networks, MoE folding, plan speed."""
