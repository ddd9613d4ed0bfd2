"""Routed experts on ranks: the all-to-all dispatcher and a rank's range of sharded experts."""
