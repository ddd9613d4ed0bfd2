"""The runtime: ``ParallelModule`` and the per-signature programs each rank runs."""
