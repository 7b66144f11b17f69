"""Dynamic loss scaling: the loss scales, the optax transformation, its state and helpers.

How it works and how to extend it: README.md in this folder.
"""

from jaxamp._loss_scaling._finite import all_finite, select, select_tree
from jaxamp._loss_scaling._scaled_grad import scaled_value_and_grad
from jaxamp._loss_scaling._scales import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jaxamp._loss_scaling._skip_guard import TooManySkippedSteps, check_skips
from jaxamp._loss_scaling._state import (
    AccumulationState,
    LossScalingState,
    get_loss_scale,
    loss_scaling_metrics,
    loss_scaling_state,
    loss_scaling_states,
)
from jaxamp._loss_scaling._transform import loss_scaling

__all__ = [
    "AccumulationState",
    "DynamicLossScale",
    "LossScale",
    "LossScalingState",
    "NoOpLossScale",
    "StaticLossScale",
    "TooManySkippedSteps",
    "all_finite",
    "check_skips",
    "get_loss_scale",
    "loss_scaling",
    "loss_scaling_metrics",
    "loss_scaling_state",
    "loss_scaling_states",
    "scaled_value_and_grad",
    "select",
    "select_tree",
]
