"""Collectives that fail say which: the collective, the IR op it implements and the mesh axis.

A rank that stops answering (alive but blocked) leaves its peers waiting in a collective until the
process group's timeout; a rank that dies makes their next collective fail. Either way the error
the waiting ranks see comes from inside a lowered graph and names only gloo's socket operation.
Lowering therefore waits on every collective through a ``Watch``: on the normal path one Python
call around ``wait_tensor``; on failure a ``CollectiveError`` naming what it was waiting for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

c10d = torch.ops._c10d_functional


class CollectiveError(RuntimeError):
    """A collective of a compiled program failed or timed out (a peer stuck or gone)."""


class Watch:
    """Calls ``fn`` (``wait_tensor``, or a token exchange) and names ``what`` when it raises.

    An instance is an fx node's target (fx calls any callable with a ``__name__``)."""

    def __init__(self, fn: Callable[..., Any], what: str) -> None:
        self.fn = fn
        self.what = what
        self.__name__ = f"watched_{getattr(fn, '__name__', 'call').replace('.', '_')}"
        self.__module__ = __name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(*args, **kwargs)
        except RuntimeError as e:
            raise CollectiveError(
                f"{self.what} did not complete: {_first_line(e)}. A rank of that group is stuck (alive but "
                "not calling: look at what it is doing) or has exited; a longer wait: parallelize(..., timeout=)"
            ) from e


def watch_waits(g: fx.Graph, after: fx.Node, what: str) -> None:
    """Wait on every collective ``g`` issues after node ``after`` through a ``Watch`` naming ``what``."""
    node = after.next
    while node.op != "root":
        if node.target is c10d.wait_tensor.default:
            issued = node.args[0]
            kind = getattr(getattr(issued, "target", None), "__name__", "collective").split(".")[0]
            node.target = Watch(c10d.wait_tensor.default, f"{kind} of {what}")
        node = node.next


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
