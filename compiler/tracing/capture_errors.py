"""Why a capture failed, said in the user's terms: the construct, the op, the user's source line, the fix.

Dynamo and AOTAutograd report failures in their own vocabulary (fake tensor calls, flattened
attribute names such as ``L__self___lin_weight``). :func:`capture_error` reads the failing fx node
and the error torch raised underneath, and names the op, the operands' shapes, the parameter by the
model's FQN and the line of the model's own code.
"""

from __future__ import annotations

import importlib.util
import operator
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.fx as fx

from meshfold.rewrites.module_paths import module_path


class CaptureError(RuntimeError):
    """The model uses a construct meshfold cannot capture; the message names it and its source line."""


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)')
# NOTE: dynamo's "failed to run FX node with fake tensors" text ends with the error torch raised underneath.
_INNER_RE = re.compile(r"\): got (\w+)\((['\"])(.*?)\2\)", re.S)
_RAISED_RE = re.compile(r"raised exception (\w+)\((['\"])(.*?)\2\)", re.S)
LEAF_IN_PLACE = "a leaf Variable that requires grad is being used in an in-place operation"
_SHAPE_KEYS = ("broadcast", "must match the size", "shapes cannot be multiplied", "size mismatch", "Expected size")


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, name
    return str(Path(next(iter(spec.submodule_search_locations))).resolve()).replace("\\", "/") + "/"


# NOTE: read off the import system, so a source checkout and an installed wheel answer alike
_MACHINERY = tuple(_package_dir(f"meshfold.{sub}") for sub in ("passes", "ir", "backends"))
_HERE = Path(__file__).resolve()
# NOTE: moe_layers.py only forwards a model's experts call to the experts op: the user's line is the caller's
_OWN_FILES = {str(_HERE.with_name(n)).replace("\\", "/") for n in ("tracer.py", "capture_errors.py", "moe_layers.py")}


def is_user_file(path: str) -> bool:
    """False for torch's frames and meshfold's own machinery (the zoo's models count as user code)."""
    p = path.replace("\\", "/")
    if p in _OWN_FILES or p.startswith(_MACHINERY):
        return False
    return not any(s in p for s in ("/torch/", "/torch_npu/", "/functorch/", "<"))


def source_line(stack_trace: str | None) -> str | None:
    """``file.py:LINE`` of the innermost frame outside torch (basename only, so dumps are portable)."""
    if not stack_trace:
        return None
    frames = [(f, ln) for f, ln in _FRAME_RE.findall(stack_trace) if is_user_file(f)]
    if not frames:
        return None
    f, ln = frames[-1]
    return f"{f.replace(chr(92), '/').rsplit('/', 1)[-1]}:{ln}"


def user_frame(e: BaseException) -> str | None:
    """``path:LINE`` of the model's own code where ``e`` happened (dynamo's stack, the message, the traceback)."""
    return _frame_from_dynamo(e) or _frame_from_text(str(e)) or _frame_from_tb(e)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: BaseException | None = e
    while seen is not None and seen not in out:
        out.append(seen)
        seen = seen.__cause__ or seen.__context__
    return out


def _frame_from_dynamo(e: BaseException) -> str | None:
    for err in _chain(e):
        frames = [f for f in getattr(err, "real_stack", None) or [] if is_user_file(f.filename)]
        if frames:
            return f"{frames[-1].filename}:{frames[-1].lineno}"
    return None


def _frame_from_text(text: str) -> str | None:
    frames = [(f, ln) for f, ln in _FRAME_RE.findall(text) if is_user_file(f)]
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else None


def _frame_from_tb(e: BaseException) -> str | None:
    for err in _chain(e):
        frames = [f for f in traceback.extract_tb(err.__traceback__) if is_user_file(f.filename)]
        if frames:
            return f"{frames[-1].filename}:{frames[-1].lineno}"
    return None


def raised_in_model(e: BaseException) -> str | None:
    """``TypeError: ...`` where dynamo, tracing the model's code, saw that code raise a Python exception
    no handler of the traced code caught (dynamo reports it as ``Observed exception``)."""
    from torch._dynamo.exc import ObservedException

    for err in _chain(e):
        if isinstance(err, ObservedException):
            found = _RAISED_RE.search(str(err))
            return f"{found.group(1)}: {found.group(3)}" if found else str(err).strip().splitlines()[0]
    return None


def inner_error(e: BaseException) -> str:
    """The error torch raised underneath dynamo's wrapper (``Attempting to broadcast ...``), else ``e``'s first line."""
    msg = str(e)
    found = _INNER_RE.search(msg)
    if found:
        return f"{found.group(1)}: {found.group(3)}"
    return msg.strip().splitlines()[0] if msg.strip() else type(e).__name__


def failing_node(e: BaseException) -> fx.Node | None:
    """The fx node dynamo was running on fake tensors when ``e`` was raised, where its traceback keeps it."""
    for err in _chain(e):
        tb: TracebackType | None = err.__traceback__
        while tb is not None:
            node = tb.tb_frame.f_locals.get("node") if tb.tb_frame.f_code.co_name == "get_fake_value" else None
            if isinstance(node, fx.Node):
                return node
            tb = tb.tb_next
    return None


_OPERATORS = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.truediv: "/",
    operator.matmul: "@",
    operator.iadd: "+=",
    operator.imul: "*=",
}


def describe_op(node: fx.Node) -> str:
    """``+`` / ``torch.add`` / ``Tensor.add_`` with the shapes of its tensor operands."""
    target = node.target
    if node.op == "call_method":
        name = f"Tensor.{target}"
    elif target in _OPERATORS:
        name = f"`{_OPERATORS[target]}`"  # type: ignore[index]
    else:
        name = getattr(target, "__qualname__", None) or str(target)
        module = getattr(target, "__module__", "") or ""
        name = f"torch.{name}" if module.startswith("torch") and "." not in name else name
    shapes = []
    for a in node.all_input_nodes:
        val = a.meta.get("example_value")
        if isinstance(val, torch.Tensor):
            shapes.append(str(list(val.shape)))
    stack = node.meta.get("nn_module_stack") or {}
    path = module_path(list(stack.values())[-1][0]) if stack else ""
    where = f" in module `{path}`" if path else " in the model's top-level forward"
    if not shapes:
        return name + where
    operands = "an operand of shape" if len(shapes) == 1 else "operands of shapes"
    return f"{name} on {operands} {' and '.join(shapes)}{where}"


_HINTS = [
    (
        ("memo disaster", "unbacked", "Unbacked"),
        "shapes that depend on the data (such as torch.where/nonzero selecting each expert's tokens in an "
        "MoE loop meshfold could not fold)",
        "if a warning named the MoE layer, write its experts as meshfold folds them (bias-free gated MLPs, "
        "combined by index_add_ or a dense weighted stack) or call meshfold.moe_experts; else keep shapes static",
    ),
    (
        ("data-dependent", "data dependent", "GuardOnDataDependent", "Data-dependent", "generic_jump", "jump"),
        "data-dependent Python control flow (an `if`/`while` on a tensor's value)",
        "use torch.where / torch.cond, or branch on shapes and Python values only",
    ),
    (
        ("mutat", "in-place", "inplace", "set_"),
        "in-place mutation of a parameter or input",
        "write the update out of place (e.g. `w = w + 1`), or do it outside the model's forward",
    ),
    (
        ("item()", "_local_scalar_dense", "tolist"),
        "reading a tensor's value in Python (`.item()`/`.tolist()`)",
        "keep the value a tensor",
    ),
]


def capture_error(e: Exception, stage: str, mutated: Callable[[], str | None] | None = None) -> CaptureError:
    """Turn a dynamo/AOT failure into an error naming the construct, the op, the source line and the fix.

    ``mutated``: asked only when the failure is an in-place update of a parameter that requires grad;
    returns that parameter's FQN (or None when it cannot tell)."""
    inner = inner_error(e)
    where = user_frame(e)
    node = failing_node(e)
    op = f" in {describe_op(node)}" if node is not None else ""
    raised = raised_in_model(e)
    if raised is not None:
        inner = raised
        construct = f"a Python exception ({raised}) raised by the model's code while traced{op}"
        fix = (
            "dynamo names the end of the try block the exception left; run the model once in eager: if it "
            "raises there too, fix the code; if not, the code reads Python state tracing does not reproduce "
            "(a contextvars.ContextVar, a global set during the forward, hooks collecting outputs): turn that "
            "feature off or move it out of the forward"
        )
    elif LEAF_IN_PLACE in inner:
        fqn = mutated() if mutated is not None else None
        what = f"parameter `{fqn}`" if fqn else "a parameter"
        construct = f"in-place mutation of {what}{op}"
        fix = (
            "parameters change only in the optimizer step: compute the new value out of place (`w = w + 1` on a "
            "local), or update it outside the model's forward under torch.no_grad()"
        )
    elif any(k in inner for k in _SHAPE_KEYS):
        construct = f"operands whose shapes do not fit together{op}"
        fix = "this line fails in eager PyTorch too: fix the operands' shapes in the model's code"
    else:
        construct, fix = "an unsupported construct", "rewrite that line with plain tensor ops"
        text = inner if inner != str(e).strip().splitlines()[0] else str(e)
        # NOTE: dynamo's own hints ("torch.compiler.set_stance") are not the model's construct
        text = "\n".join(ln for ln in text.splitlines() if not ln.strip().startswith("Hint:"))
        for keys, what_, how in _HINTS:
            if any(k in text for k in keys):
                construct, fix = what_, how
                break
        construct += op
    loc = f" at {where}" if where else ""
    head = f"cannot capture the model while {stage}: {construct}{loc}."
    return CaptureError(f"{head}\n  torch says: {inner}\n  fix: {fix}")


def in_place_parameter(gm: fx.GraphModule, fqns: dict[str, str]) -> str | None:
    """The FQN of the first parameter ``gm`` (dynamo's graph) updates with an in-place op, if any;
    ``fqns`` maps dynamo's flattened attribute names to the model's."""
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function") or not node.args:
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        first = node.args[0]
        if name.endswith("_") and not name.startswith("_") and isinstance(first, fx.Node) and first.op == "get_attr":
            target = str(first.target)
            return fqns.get(target, target)
    return None


def retried_without_grad(model: torch.nn.Module, capture: Callable[[], Any]) -> Any:
    """``capture()`` with every parameter of ``model`` (fake copies during a capture) not requiring
    grad, then restored: how dynamo lets an in-place parameter update through, to name it."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        return capture()
    finally:
        for p in params:
            p.requires_grad_(True)
