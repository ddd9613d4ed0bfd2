"""Backends lower each rank's IR program to runnable ``torch.fx`` graphs (eager, Inductor, torchair)."""
