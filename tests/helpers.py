"""Assertions shared by the test files: bit-equality, matmul dtypes, closeness.

Import as ``from tests.helpers import bits`` (``tests`` is a package; pytest puts
the repository root on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import jax
import numpy as np

import jaxamp


def bits(tree: Any) -> list[tuple[np.dtype, bytes]]:
    """Each leaf's dtype and raw bytes: equal exactly when two trees are bit-identical.

    >>> import jax.numpy as jnp
    >>> bits({"a": jnp.float32(0.0)}) == bits({"a": jnp.float32(-0.0)})
    False
    """
    return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


def dot_dtypes(fun: Any, *args: Any) -> list[tuple[str, str]]:
    """Operand dtypes of every matmul ``fun`` runs on ``args``, as ``precision_report`` lists them.

    >>> import jax.numpy as jnp
    >>> dot_dtypes(lambda a: a @ a, jnp.ones((2, 2), jnp.bfloat16))
    [('bfloat16', 'bfloat16')]
    """
    return [m.operand_dtypes for m in jaxamp.precision_report(fun, *args).matmuls]


def rel_err(got: Any, want: Any) -> float:
    """Largest absolute error relative to the reference's largest magnitude.

    Relative to the whole array, not per element: the right measure for a 16-bit
    computation against its float32 reference, whose small elements carry the
    large ones' absolute rounding error.

    >>> round(rel_err(np.array([1.0, 2.01]), np.array([1.0, 2.0])), 6)
    0.005
    """
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


def assert_close(got: Any, want: Any, tol: float = 3e-2) -> None:
    """:func:`rel_err` of ``got`` against the reference ``want`` is at most ``tol``."""
    assert rel_err(got, want) <= tol


def run_with_devices(
    script: str, n_devices: int = 8, timeout: int = 300, args: tuple[str, ...] = ()
) -> Any:
    """Runs ``script`` (with ``args``) in a subprocess with ``n_devices`` CPU devices.

    Returns its last stdout line, parsed as JSON.

    ``XLA_FLAGS`` must be set before jax is imported, so a test that needs several
    devices runs its measurements in a fresh interpreter (the file itself, as a
    script) and asserts on what it prints.
    """
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, script, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def conditioned(rows: int, cols: int, cond: float, seed: int = 0) -> np.ndarray:
    """A ``rows x cols`` matrix with singular values from 1 down to ``1 / cond``."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((rows, rows)))
    v, _ = np.linalg.qr(rng.standard_normal((cols, cols)))
    s = np.zeros((rows, cols))
    k = min(rows, cols)
    s[:k, :k] = np.diag(np.geomspace(1.0, 1.0 / cond, k))
    return (u @ s @ v.T).astype(np.float32)
