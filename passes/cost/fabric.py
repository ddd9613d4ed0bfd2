"""The text of a cluster: ``DEVICE:GPUS_PER_NODExNODES[@NIC]`` parts joined by ``+`` (``hardware.parse_cluster``)."""

from __future__ import annotations

import re

from meshfold.passes.cost.hardware import DEVICES, LINKS

_CLUSTER_RE = re.compile(r"^\s*([A-Za-z0-9_-]+)\s*:\s*(\S+?)\s*[xX]\s*([^@\s]+?)\s*(?:@\s*(\S+?))?\s*$")

NIC_ALIASES: dict[str, str] = {"ib": "ib-ndr400", "roce": "roce200"}
"""Short NIC names accepted after ``@``: InfiniBand NDR 400 Gb/s and RoCE v2 200 GbE per device port
(``hardware.LINKS`` gives their sources)."""


def parse_part(text: str, part: str) -> tuple[str, int, int, str | None]:
    """(device, GPUs per node, nodes, NIC link name or None) of one ``DEVICE:GxN[@NIC]`` part."""
    m = _CLUSTER_RE.match(part)
    known = ", ".join(sorted(DEVICES))
    if m is None:
        raise ValueError(
            f"cluster {text!r} must look like DEVICE:GPUS_PER_NODExNODES[@NIC][+...], e.g. h100:8x64 or "
            f"h100:8x4@ib+h100:8x4@roce (devices: {known})"
        )
    name, per_node, nodes, nic = m.groups()
    if name.lower() not in DEVICES:
        raise ValueError(f"cluster {text!r}: unknown device {name!r}; accepted devices: {known}")
    for label, value in (("GPUS_PER_NODE", per_node), ("NODES", nodes)):
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"cluster {text!r}: {label} {value!r} must be a positive integer, e.g. h100:8x64")
    key = None
    if nic is not None:
        key = NIC_ALIASES.get(nic.lower(), nic.lower())
        if key not in LINKS:
            names = ", ".join([*sorted(NIC_ALIASES), *sorted(LINKS)])
            raise ValueError(f"cluster {text!r}: unknown NIC {nic!r} after @; accepted: {names}")
    return name.lower(), int(per_node), int(nodes), key
