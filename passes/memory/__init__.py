"""The memory pass and its parts: ``activations`` (the ``memory`` pass: which activations a rank
keeps, recomputes or offloads under a budget or a policy), ``budget`` (the choice under a byte
budget), ``policies`` (named and per-value policies), ``recompute`` and ``offload`` (the rewrites),
``rows`` (the budget's integer program)."""
