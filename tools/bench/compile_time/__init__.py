"""Benches of compile time at scale: capture of deep models on fake tensors, the sharding solve."""
