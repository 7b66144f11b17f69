"""autocast(..., remat_float32=True): keep only 16-bit values for the backward pass.

Under autocast the float32 operations (softmax, normalisation statistics, the
loss) produce float32 intermediates, and reverse-mode AD saves them for the
backward pass: on the GPT of ``benchmarks/activation_memory.py`` a third of the
residual bytes. With this ``jax.checkpoint`` policy only values that are not
float32 (or wider) are saved; the float32 ones are recomputed in the backward
pass from the saved 16-bit values, which is cheap elementwise and reduction work.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxamp._engine import _compat as compat

__all__ = ["save_narrow_values"]


def save_narrow_values(prim: Any, *avals: Any, **params: Any) -> bool:
    """A ``jax.checkpoint`` policy: save an operation's outputs unless one is a wide float.

    An operation whose output types cannot be derived from its input types is
    saved (never recomputed), which is always correct.
    """
    dtypes = compat.output_dtypes(prim, avals, params)
    if dtypes is None:
        return True
    return not any(np.issubdtype(d, np.floating) and d.itemsize >= 4 for d in dtypes)
