"""Front-end rewrites over the captured fx graph (attention, convolutions, scans, MoE lists), before the IR."""
