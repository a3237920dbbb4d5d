"""The ZeRO stage is chosen once (runtime/zero/stage.py) and the engine never tests it."""

import ast
from pathlib import Path

import pytest

from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.stage import (
    GradientPhase,
    ReplicatedParameters,
    ShardedParameters,
    choose_strategy,
)
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

ENGINE = Path(__file__).resolve().parents[2] / "deepspeed" / "runtime" / "engine.py"


def _strategy(stage: int):
    return choose_strategy(DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": stage}}))


@pytest.mark.parametrize(
    "stage, family, partitions_gradients, wrapper",
    [
        (0, ReplicatedParameters, False, DeepSpeedZeroOptimizer),
        (1, ReplicatedParameters, False, DeepSpeedZeroOptimizer),
        (2, ReplicatedParameters, True, DeepSpeedZeroOptimizer),
        (3, ShardedParameters, True, DeepSpeedZeroOptimizer_Stage3),
    ],
)
def test_one_strategy_per_family_with_the_stage_knobs(stage, family, partitions_gradients, wrapper):
    strategy = _strategy(stage)
    assert type(strategy) is family
    assert strategy.partitions_gradients is partitions_gradients
    assert strategy.partitions_weights is (stage == 3)
    assert strategy.optimizer_class is wrapper
    if family is ReplicatedParameters:
        assert strategy.averages_whole_grads is (stage == 0)
        assert strategy.phase is GradientPhase.ACCUMULATING


def test_no_sync_is_refused_where_gradients_are_partitioned():
    from deepspeed.runtime.engine import NoSyncError

    for stage in (2, 3):
        with pytest.raises(NoSyncError, match=f"ZeRO stage {stage}"):
            with _strategy(stage).no_sync():
                pass
    strategy = _strategy(1)
    with strategy.no_sync():
        assert strategy.inside_no_sync
        with pytest.raises(NoSyncError, match="reentry"):
            with strategy.no_sync():
                pass
    assert not strategy.inside_no_sync


def test_the_engine_code_never_reads_the_stage():
    """Only upstream's query methods (in engine_queries.py) answer with the stage; the engine's
    own code, docstrings and comments aside, names neither the stage nor partitioned weights."""
    tree = ast.parse(ENGINE.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            assert "stage" not in node.value.lower(), node.value
    stage_queries = {
        "stage",
        "zero_optimization_stage",
        "zero_optimization_partition_gradients",
        "zero_optimization_partition_weights",
        "partitions_gradients",
        "partitions_weights",
    }
    assert not names & stage_queries
