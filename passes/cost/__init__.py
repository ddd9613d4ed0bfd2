"""The per-op time model passes price with, on the hardware catalog (``meshfold.target``).

``opcost`` (roofline time of one kernel), ``comm`` (collective times on two-level clusters),
``axis`` (one mesh axis's time model, as the sharding solve, the schedule and the memory pass use
it) and ``liveness`` (peak memory of one rank from the liveness of its scheduled SPMD graph). The
cluster simulator behind ``meshfold plan`` (``meshfold.sim``) prices with the same ``opcost`` and
``comm``. ``opcost`` and ``comm`` need no torch.
"""
