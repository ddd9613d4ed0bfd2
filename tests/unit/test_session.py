"""The one compile path: options read once, progress per stage, pass-debug replaying parallelize's
compilation, and the package's light import."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Iterator

import pytest
from torch import nn

from meshfold import Options, compile_model, ir
from meshfold.passes import PassError
from meshfold.passes.moe.spec import MoeSpec
from meshfold.passes.sharding.plans import Plan
from meshfold.tools.pass_debug import main as pass_debug
from meshfold.tools.zoo import build


def test_options_read_every_user_form_once() -> None:
    opts = Options.of(
        mesh="dp=2,tp=2", plan="fsdp+tp", moe={"ep": 4}, cluster="h100:8x1", memory="40GiB", backend="eager"
    )
    assert opts.mesh == ir.Mesh(("dp", "tp"), (2, 2))
    assert opts.plan == Plan.of("fsdp+tp") and opts.moe == MoeSpec(ep=4)
    assert (
        opts.memory == 40 * 2**30
        and opts.cluster is not None
        and (opts.cluster.devices_per_node, opts.cluster.nodes) == (8, 1)
    )
    assert Options.of(mesh="dp=2,tp=2").effective_plan() == Plan.of("fsdp+tp")
    assert Options.of(mesh="dp=2", plan={"fc1.weight": {"dp": "S(0)"}}).effective_plan() == Plan.of(
        "fsdp", {"fc1.weight": {"dp": "S(0)"}}
    )


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"mesh": "dp=2", "backend": "tpu"}, "backend 'tpu' is not available"),
        ({"plan": "fsdp"}, "give a mesh"),
        ({"mesh": "dp=two"}, "write e.g. dp=2,tp=2"),
        ({"mesh": "dp=2", "plan": "fsdp+tp"}, "mesh axis named 'tp'"),
        ({"mesh": "dp=2", "cluster": "h900:8x1"}, "cluster 'h900:8x1'"),
        ({"mesh": "dp=2", "memory": "lots"}, "is neither a size"),
        ({"mesh": "dp=2", "moe": {"ep": 2}, "pipeline": "cleanup,sharding"}, "needs the moe-fold pass"),
        ({"mesh": "dp=2", "moe": {"ep": 2}, "plan": "auto"}, "chooses the expert mapping itself"),
        ({"mesh": "dp=2", "pipeline": "cleanup,sharding{mode=fast}"}, "takes one of solve, greedy"),
        ({"mesh": "dp=2", "pipeline": "cleanup,shard"}, "unknown pass 'shard'"),
    ],
)
def test_bad_requests_are_refused_before_anything_is_captured(kwargs: dict[str, object], needle: str) -> None:
    # NOTE: a module without a forward: capturing it would raise NotImplementedError, not PassError
    with pytest.raises(PassError, match=None) as e:
        compile_model(nn.Module(), (), Options.of(**kwargs))
    assert needle in str(e.value)


def test_every_stage_shows_what_it_is_doing() -> None:
    shown: list[str] = []

    @contextlib.contextmanager
    def status(message: str) -> Iterator[None]:
        shown.append(message)
        yield

    model, inputs = build("mlp")
    result = compile_model(model, inputs, Options.of(mesh="dp=2", pipeline="cleanup,sharding"), status=status)
    assert shown[0] == "capturing MLP"
    assert [m for m in shown if m.startswith("pass ")] == ["pass 1 of 2: cleanup", "pass 2 of 2: sharding"]
    assert [t.name for t in result.timings] == ["cleanup", "sharding"]


def test_pass_debug_replays_the_compilation_parallelize_runs() -> None:
    """The flags spell the same ``Options`` as ``parallelize``'s arguments, so the IR is the same.
    NOTE: the greedy choice, since the solve's result may depend on machine load at its time limit."""
    pipeline = "cleanup,moe-fold,sharding{mode=greedy},boxing,bucket,verify"
    model, inputs = build("mixtral-tiny")
    moe = {"ep": 4, "dispatcher": "allgather"}
    options = Options.of(mesh="dp=2,tp=2", plan="fsdp+tp", moe=moe, pipeline=pipeline)
    expected = str(compile_model(model, inputs, options).graph)
    out = io.StringIO()
    argv = [
        "mixtral-tiny",
        "-p",
        pipeline,
        "--mesh",
        "dp=2,tp=2",
        "--plan",
        "fsdp+tp",
        "--moe",
        "ep=4,dispatcher=allgather",
    ]
    with contextlib.redirect_stdout(out):
        assert pass_debug([*argv, "--print-result"]) == 0
    assert out.getvalue() == expected


def test_moe_fold_shows_the_mapping_as_its_own_step() -> None:
    out = io.StringIO()
    argv = ["mixtral-tiny", "-p", "cleanup,moe-fold", "--mesh", "dp=2,tp=2", "--moe", "ep=4,capacity_factor=1.0"]
    with contextlib.redirect_stdout(out):
        assert pass_debug([*argv, "--print-between-passes"]) == 0
    cleaned, folded = out.getvalue().split("// ----- IR after pass 2 of 2 (moe-fold) -----")
    experts = [line for line in folded.splitlines() if "meshfold.moe_experts(" in line]
    assert experts and all('"probs", "alltoall")' in line for line in experts)
    # NOTE: 32 tokens * top-2 / 4 experts * 1.0 = 16 rows per expert
    assert all(', 16, "probs"' in line for line in experts)
    assert ', 16, "probs"' not in cleaned.split("// ----- IR after pass 1 of 2 (cleanup) -----")[1]


def test_the_package_and_the_simulator_import_without_torch() -> None:
    code = "import sys, meshfold, meshfold.sim.simulate; assert 'torch' not in sys.modules, 'torch'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_a_preset_with_experts_solves_without_falling_back(dispatcher: str) -> None:
    """The batch stays split on the data-parallel axis, and the all-gather dispatcher may still gather
    tokens inside the experts op: the solve finds a plan, no greedy fallback."""
    model, inputs = build("mixtral-tiny")
    options = Options.of(mesh="dp=2,tp=2", plan="fsdp+tp", moe={"ep": 4, "dispatcher": dispatcher})
    result = compile_model(model, inputs, options)
    assert not [d for d in result.diagnostics if "fall back" in d], result.diagnostics


def test_every_option_a_shell_can_spell_is_a_pass_debug_flag_with_its_default() -> None:
    """pass-debug's option flags are generated from ``Options``: a new field is a new flag."""
    import dataclasses

    from meshfold.tools.pass_debug import _arg_parser

    actions = {a.dest: a for a in _arg_parser()._actions}
    flagged = {f.name: f for f in Options.flags()}
    assert {n: actions[n].default for n in flagged} == {n: f.default for n, f in flagged.items()}
    assert all(actions[n].help == f.metadata["help"] for n, f in flagged.items())
    # NOTE: set from Python only: a function (memory_policy, through memory=), the runtime's knobs, and
    # what the front door derives per call
    python_only = {f.name for f in dataclasses.fields(Options)} - set(flagged)
    assert python_only == {"memory_policy", "verify", "cache_size", "timeout", "dynamic", "grad"}


def test_an_unknown_option_is_refused_naming_the_nearest() -> None:
    with pytest.raises(PassError, match="unknown option memroy='6GiB'; did you mean 'memory'"):
        Options.of(mesh="dp=2", memroy="6GiB")
    with pytest.raises(PassError, match="timeout must be positive"):
        Options.of(timeout=0)
    assert Options.of(mesh="dp=2,tp=2").effective_plan() == Plan.of("fsdp+tp")
