"""Flax adapters (NNX and Linen): policies with per-module overrides, a loss-scaled TrainState.

``nnx.Optimizer(model, jaxamp.loss_scaling(tx), wrt=nnx.Param)`` needs nothing
from here: :func:`jaxamp.get_loss_scale` reads ``optimizer.opt_state`` directly.
Importing this package imports flax's NNX and Linen. Core ``jaxamp`` uses flax
for one thing only, and only when flax is installed: it registers the loss scales
with ``flax.serialization`` (``jaxamp/_flax_serialization.py``).
"""

from jaxamp.flax._linen import LossScaledTrainState, linen_policy
from jaxamp.flax._nnx import set_policy

__all__ = ["LossScaledTrainState", "linen_policy", "set_policy"]
