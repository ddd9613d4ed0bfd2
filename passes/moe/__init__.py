"""Mixture-of-experts: the expert mapping (``spec``) and the ``moe-fold`` pass that applies it."""
