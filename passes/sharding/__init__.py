"""Sharding: per-op rules, propagation of layouts from plan seeds, and boxing (collectives)."""
