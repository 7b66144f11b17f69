"""jaxamp: mixed-precision training for JAX and Flax.

Precision policies, dynamic loss scaling that skips non-finite steps, and
Tensor Core alignment. Every public name is listed in ``__all__`` and has a page
in the API reference (``docs/api/``).

``import jaxamp`` does not need flax. When flax is installed it imports
``flax.serialization`` (and so flax's package) for one purpose: to register the
loss scales with it, so that ``flax.serialization.to_bytes``/``from_bytes`` and
orbax checkpoints keep their configuration without importing ``jaxamp.flax``.
``jaxamp.flax`` (the NNX and Linen adapters) loads on first use.
"""

import importlib as _importlib
import importlib.util as _importlib_util

from jaxamp._alignment import align_dim, pad_to_multiple, tensor_core_multiple
from jaxamp._autocast import AUTOCAST_RULES, AutocastContext, UnknownPrimitiveWarning, autocast
from jaxamp._casting import cast_floating
from jaxamp._fp8 import Float4Recipe, Float8Recipe
from jaxamp._loss_scaling import (
    AccumulationState,
    DynamicLossScale,
    LossScale,
    LossScalingState,
    NoOpLossScale,
    StaticLossScale,
    TooManySkippedSteps,
    all_finite,
    check_skips,
    get_loss_scale,
    loss_scaling,
    loss_scaling_metrics,
    scaled_value_and_grad,
    select_tree,
)
from jaxamp._low_precision import LowPrecisionState, low_precision_optimizer, stochastic_round
from jaxamp._matmuls import precision_report
from jaxamp._numerics import (
    NumericsMonitor,
    NumericsReport,
    OpStats,
    numerics_monitor,
    numerics_report,
)
from jaxamp._plan import PlanRow, PrecisionPlan, precision_plan
from jaxamp._policy import Policy, get_policy, policy_for_device
from jaxamp._precision_report import MatmulInfo, PrecisionReport
from jaxamp._version import __version__
from jaxamp._wire._collectives import communication_report
from jaxamp._wire._communication_report import Collective, CommunicationReport
from jaxamp._wire._gather import gather_params
from jaxamp._wire._warnings import WireDtypeWarning

if _importlib_util.find_spec("flax") is not None:
    # Eager, so that a checkpoint restores the scale's configuration whether or not
    # the user ever imported jaxamp.flax (flax has no hook to register lazily).
    _importlib.import_module("jaxamp._flax_serialization")

__all__ = [
    "AUTOCAST_RULES",
    "AccumulationState",
    "AutocastContext",
    "Collective",
    "CommunicationReport",
    "DynamicLossScale",
    "Float4Recipe",
    "Float8Recipe",
    "LossScale",
    "LossScalingState",
    "LowPrecisionState",
    "MatmulInfo",
    "NoOpLossScale",
    "NumericsMonitor",
    "NumericsReport",
    "OpStats",
    "PlanRow",
    "Policy",
    "PrecisionPlan",
    "PrecisionReport",
    "StaticLossScale",
    "TooManySkippedSteps",
    "UnknownPrimitiveWarning",
    "WireDtypeWarning",
    "__version__",
    "align_dim",
    "all_finite",
    "autocast",
    "cast_floating",
    "check_skips",
    "communication_report",
    "gather_params",
    "get_loss_scale",
    "get_policy",
    "loss_scaling",
    "loss_scaling_metrics",
    "low_precision_optimizer",
    "numerics_monitor",
    "numerics_report",
    "pad_to_multiple",
    "policy_for_device",
    "precision_plan",
    "precision_report",
    "scaled_value_and_grad",
    "select_tree",
    "stochastic_round",
    "tensor_core_multiple",
]


def __getattr__(name: str):
    # `jaxamp.flax` imports flax, so it loads on first use, not with jaxamp.
    if name == "flax":
        return _importlib.import_module("jaxamp.flax")
    raise AttributeError(f"module 'jaxamp' has no attribute {name!r}")
