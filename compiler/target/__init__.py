"""The hardware catalog: accelerators, links and clusters, as frozen plain data (pure Python, no torch)."""
