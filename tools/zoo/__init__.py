"""Built-in zoo of small models used by tests, the CLI and demos (``meshfold.tools.zoo``).

Every entry is a factory returning ``(model, example_inputs)`` where
``model(*example_inputs)`` is a scalar fp32 loss. Factories are deterministic
(weights under ``torch.manual_seed(0)``, inputs from a generator seeded with 0)
and construct nothing data-dependent, so they also run under ``FakeTensorMode``.
"""

from __future__ import annotations

# NOTE: the entries register themselves with the registry in ``shared`` as they are imported.
from meshfold.tools.zoo import hf_zoo, hybrid, models, moe_zoo  # noqa: F401
from meshfold.tools.zoo.shared import ZooFactory, build, register, zoo_names

__all__ = ["ZooFactory", "build", "register", "zoo_names"]
