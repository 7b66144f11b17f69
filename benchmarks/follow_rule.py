"""The "follow" rule of autocast against the alternatives: accuracy, activation memory, speed.

"follow" decides the dtype of an elementwise operation whose operands are a 16-bit
activation and a float32 parameter or constant. Three rule sets, each under
``jaxamp.autocast(..., rules=...)`` on the same float32 code:

- ``autocast``: the built-in rule: the activation's dtype wins, except where 16 bits
  would break the float32 value (powers before a sum, loop accumulators, traced
  divisors, constants that underflow; docs/api/autocast.md, "The follow rule,
  re-decided");
- ``promotion``: JAX's and torch's type promotion (float32 + bfloat16 -> float32;
  a weakly typed Python scalar takes the other operand's dtype), a callable rule
  for every "follow" primitive;
- ``f32_elementwise``: every "follow" primitive runs in float32 (bfloat16 only as
  matmul operands).

Measured, all in one process:

- accuracy on a zoo of small functions (norm statistics with an outlier, Flax's
  fast variance, a streaming mean-pool, an EMA, a small divisor, ``log(p + eps)``,
  an MLP with LayerNorm, causal attention), under ``mixed_bfloat16`` and
  ``mixed_float16``: relative error of the output and of ``grad`` against float32,
  next to the hand-cast reference's (16-bit params and inputs under JAX's promotion);
- activation memory: bytes of the residuals ``jax.vjp`` keeps on the GPT of
  ``benchmarks/activation_memory.py``, with and without ``remat_float32=True``;
- speed: the compiled ``value_and_grad`` of ``examples/charlm.py``'s transformer and
  of a 2-block GPT, each rule set with and without ``remat_float32`` (``<setup>_remat``),
  every setup once per round in rotating order, medians, ratios to float32.

The narrowing "follow" of before the exceptions cannot be expressed with ``rules``
(the exceptions live in the rule itself), so it is not a setup here.

    python -m benchmarks.follow_rule            # full run (a few minutes)
    python -m benchmarks.follow_rule --smoke    # seconds
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxamp
from benchmarks import _harness, _models, activation_memory, autocast_cpu_speed

NAME = "follow_rule"
POLICIES = ("mixed_bfloat16", "mixed_float16")
FOLLOW = [name for name, rule in jaxamp.AUTOCAST_RULES.items() if rule == "follow"]


def _promote(context: jaxamp.AutocastContext, eqn: Any, *args: Any) -> list[Any]:
    """JAX's promotion: operands traced with one dtype meet in the widest of theirs."""
    groups: dict[np.dtype, list[int]] = {}
    for i, atom in enumerate(eqn.invars):
        if jnp.issubdtype(atom.aval.dtype, jnp.floating):
            groups.setdefault(np.dtype(atom.aval.dtype), []).append(i)
    args = list(args)
    for idxs in groups.values():
        strong = [np.dtype(args[i].dtype) for i in idxs if not eqn.invars[i].aval.weak_type]
        if strong:
            target = max(strong, key=lambda d: d.itemsize)
            for i in idxs:
                args[i] = context.cast(args[i], target)
    return context.bind(eqn, *args)


RULES: dict[str, dict[str, Any] | None] = {
    "autocast": None,
    "promotion": {name: _promote for name in FOLLOW},
    "f32_elementwise": {name: "float32" for name in FOLLOW},
}


# ---------------------------------------------------------------- the zoo: f(w, x)


def _rms_norm_outlier(w, x):
    h = x @ w
    return h * jax.lax.rsqrt(jnp.mean(h**2, -1, keepdims=True) + 1e-6)


def _fast_variance(w, x):
    h = x @ w + 8.0
    mean = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(h * h, -1, keepdims=True) - mean * mean
    return (h - mean) * jax.lax.rsqrt(var + 1e-6)


def _mean_pool(w, x):
    total = jax.lax.scan(lambda a, r: (a + jnp.tanh(r @ w), None), jnp.zeros(x.shape[1:]), x)[0]
    return total / x.shape[0]


def _ema(w, x):
    step = lambda a, r: (0.99 * a + 0.01 * jnp.tanh(r @ w), None)  # noqa: E731
    return jax.lax.scan(step, jnp.zeros(x.shape[1:]), x)[0]


def _divisor(w, x):
    counts = jnp.sum(jnp.zeros_like(x), 0)  # a float32 count that is 0: 0 + eps
    return (x @ w) / (counts + 1e-5)


def _log_eps(w, x):
    return jnp.log(jax.nn.relu(x @ w) + 1e-8)


def _mlp_layernorm(w, x):
    h = x @ w + w[0]
    mean = jnp.mean(h, -1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(jnp.var(h, -1, keepdims=True) + 1e-5)
    return jax.nn.gelu(h) @ w


def _attention(w, x):
    q = x @ w
    scores = q @ x.T / np.sqrt(x.shape[-1]).astype(np.float32)
    mask = jnp.arange(x.shape[0])[:, None] >= jnp.arange(x.shape[0])[None, :]
    filled = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(filled, -1) @ x


def _zoo(width: int, rows: int, steps: int) -> dict[str, tuple[Callable, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    x = rng.standard_normal((rows, width)).astype(np.float32)
    outlier = x.copy()
    outlier[:, 0] = 300.0 * np.sqrt(width)  # x @ w of order 300: its square overflows float16
    seq = rng.standard_normal((steps, rows, width)).astype(np.float32)
    return {
        "rms_norm_outlier": (_rms_norm_outlier, w, outlier),
        "fast_variance": (_fast_variance, w, 0.5 * x),
        "mean_pool": (_mean_pool, w, seq),
        "ema": (_ema, w, seq),
        "divisor": (_divisor, w, x),
        "log_eps": (_log_eps, w, x),
        "mlp_layernorm": (_mlp_layernorm, w, x),
        "attention": (_attention, w, x),
    }


def _value_and_grad(fun: Callable) -> Callable:
    def total(w, x):
        out = fun(w, x).astype(jnp.float32)
        return jnp.sum(jnp.tanh(out)), out

    return jax.jit(jax.grad(total, has_aux=True))


def _hand_cast(fun: Callable, dtype: Any) -> Callable:
    def run(w, x):
        with jax.numpy_dtype_promotion("standard"):
            return fun(w.astype(dtype), x.astype(dtype))

    return run


def _rel_error(got: Any, want: Any) -> float:
    """Relative error in norm where float32 is finite; inf where ``got`` is not finite there."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    ok = np.isfinite(want)
    if not np.isfinite(got[ok]).all():
        return float("inf")
    return float(np.linalg.norm(got[ok] - want[ok]) / max(np.linalg.norm(want[ok]), 1e-30))


def accuracy(
    width: int, rows: int, steps: int, names: Sequence[str] = (), policies: Sequence[str] = POLICIES
) -> list[dict[str, Any]]:
    """Errors of every (zoo function, policy, rule set) and of the hand-cast reference.

    ``names``: the zoo functions to run (all when empty).
    """
    rows_out = []
    for name, (fun, w, x) in _zoo(width, rows, steps).items():
        if names and name not in names:
            continue
        grad, out = _value_and_grad(fun)(w, x)
        for policy in policies:
            dtype = jaxamp.get_policy(policy).compute_dtype
            candidates = {"hand_cast": _hand_cast(fun, dtype)}
            for setup, rules in RULES.items():
                candidates[setup] = jaxamp.autocast(fun, policy, rules=rules)
            for setup, candidate in candidates.items():
                g, o = _value_and_grad(candidate)(w, x)
                rows_out.append(
                    {
                        "part": "accuracy",
                        "function": name,
                        "policy": policy,
                        "setup": setup,
                        "output_error": _rel_error(o, out),
                        "grad_error": _rel_error(g, grad),
                    }
                )
    return rows_out


# --------------------------------------------------------------- memory and speed


def _gpt_losses(config: _models.GPTConfig) -> tuple[Callable, Any]:
    model = _models.GPT(config)
    return _models.gpt_loss_fn(model), _models.gpt_init(model, config)


def memory(config: _models.GPTConfig) -> list[dict[str, Any]]:
    """Residual bytes of every rule set, with and without ``remat_float32``, on the GPT."""
    loss, params = _gpt_losses(config)
    batch = _models.gpt_batch(config)
    reference = activation_memory.residual_bytes(loss, params, batch)["total"]
    out = []
    for setup, rules in RULES.items():
        for remat in (False, True):
            wrapped = jaxamp.autocast(loss, "mixed_bfloat16", rules=rules, remat_float32=remat)
            res = activation_memory.residual_bytes(wrapped, params, batch)
            out.append(
                {
                    "part": "memory",
                    "setup": setup,
                    "remat_float32": remat,
                    "residual_bytes": res,
                    "residual_ratio": res["total"] / reference,
                }
            )
    return out


def _charlm_work(charlm: dict[str, int]) -> tuple[Callable, Any, Any]:
    module = autocast_cpu_speed._charlm()
    keys = ("width", "layers", "context")
    dims = module.sizes(argparse.Namespace(head_dim=32, **{k: charlm[k] for k in keys}))
    model, loss_fn = module.build("float32", dims, seed=0)
    graphdef, state = nnx.split(model)

    def loss(state, tokens):
        return loss_fn(nnx.merge(graphdef, state), tokens)

    rng = np.random.default_rng(0)
    shape = (charlm["batch"], dims["context"] + 1)
    tokens = jnp.asarray(rng.integers(0, dims["vocab"], shape), jnp.int32)
    return loss, state, tokens


def _steps(loss: Callable, params: Any, batch: Any) -> dict[str, tuple]:
    funs = {"float32": loss}
    for setup, rules in RULES.items():
        funs[setup] = jaxamp.autocast(loss, "mixed_bfloat16", rules=rules)
        funs[f"{setup}_remat"] = jaxamp.autocast(
            loss, "mixed_bfloat16", rules=rules, remat_float32=True
        )
    steps = {}
    for setup, fun in funs.items():
        compiled = jax.jit(jax.value_and_grad(fun)).lower(params, batch).compile()
        steps[setup] = (compiled, float(compiled(params, batch)[0]))
    return steps


def _time(model: str, steps: dict[str, tuple], params: Any, batch: Any, rounds: int) -> list:
    seconds: dict[str, list[float]] = {setup: [] for setup in steps}
    for rep in range(rounds):
        for setup in _harness.rotated(list(steps), rep):
            start = time.perf_counter()
            jax.block_until_ready(steps[setup][0](params, batch))
            seconds[setup].append(time.perf_counter() - start)
    reference = _harness.median(seconds["float32"])
    return [
        {
            "part": "speed",
            "model": model,
            "setup": setup,
            "loss": steps[setup][1],
            "median_ms": 1e3 * _harness.median(seconds[setup]),
            "ratio_to_float32": _harness.median(seconds[setup]) / reference,
            "per_round_ms": [1e3 * s for s in seconds[setup]],
        }
        for setup in steps
    ]


def speed(charlm: dict[str, int], gpt: _models.GPTConfig, rounds: int) -> list[dict[str, Any]]:
    """``value_and_grad`` time of every rule set on charlm's transformer and on a GPT."""
    loss, state, tokens = _charlm_work(charlm)
    rows = _time("charlm", _steps(loss, state, tokens), state, tokens, rounds)
    loss, params = _gpt_losses(gpt)
    batch = _models.gpt_batch(gpt)
    return rows + _time("gpt", _steps(loss, params, batch), params, batch, rounds)


# ------------------------------------------------------------------------ tables


def table(results: Sequence[dict[str, Any]]) -> str:
    """Three tables: accuracy (error / hand-cast error), residual bytes, speed."""
    acc = [r for r in results if r["part"] == "accuracy"]
    hand = {(r["function"], r["policy"]): r for r in acc if r["setup"] == "hand_cast"}
    rows = []
    for r in acc:
        h = hand[(r["function"], r["policy"])]
        rows.append([r["function"], r["policy"], r["setup"], r["output_error"], r["grad_error"]])
        rows[-1] += [_ratio(r["output_error"], h["output_error"])]
        rows[-1] += [_ratio(r["grad_error"], h["grad_error"])]
    headers = ["function", "policy", "setup", "output error", "grad error"]
    text = [_harness.format_table([*headers, "x hand (out)", "x hand (grad)"], rows)]
    mem = [
        [r["setup"], r["remat_float32"], r["residual_bytes"]["total"] / 2**20, r["residual_ratio"]]
        for r in results
        if r["part"] == "memory"
    ]
    text.append(_harness.format_table(["setup", "remat_float32", "MiB", "x float32"], mem))
    spd = [
        [r["model"], r["setup"], r["loss"], r["median_ms"], r["ratio_to_float32"]]
        for r in results
        if r["part"] == "speed"
    ]
    text.append(_harness.format_table(["model", "setup", "loss", "ms", "x float32"], spd))
    return "\n\n".join(text)


def _ratio(err: float, ref: float) -> float | str:
    if not np.isfinite(ref):
        return "hand not finite"
    return err / ref if ref > 0 else ("exact" if err == 0 else "hand exact")


FULL = {
    "zoo": {"width": 64, "rows": 16, "steps": 256},
    "gpt_memory": {
        "vocab": 1024,
        "seq": 256,
        "d_model": 256,
        "n_heads": 8,
        "d_ff": 1024,
        "n_layers": 4,
        "batch": 8,
    },
    "charlm": {"width": 128, "layers": 2, "context": 64, "batch": 32},
    "gpt_speed": {
        "vocab": 1024,
        "seq": 256,
        "d_model": 128,
        "n_heads": 4,
        "d_ff": 512,
        "n_layers": 2,
        "batch": 4,
    },
    "rounds": 15,
}
SMOKE = {
    "zoo": {
        "width": 8,
        "rows": 4,
        "steps": 8,
        "names": ["rms_norm_outlier", "mean_pool"],
        "policies": ["mixed_float16"],
    },
    "gpt_memory": {"vocab": 32, "seq": 8, "d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1},
    "charlm": {"width": 32, "layers": 1, "context": 8, "batch": 2},
    "gpt_speed": {"vocab": 32, "seq": 8, "d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": 1},
    "rounds": 2,
}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _harness.parse_args(__doc__.splitlines()[0], argv)
    config = SMOKE if args.smoke else FULL
    gpt_memory = _models.GPTConfig(**config["gpt_memory"])
    gpt_speed = _models.GPTConfig(**config["gpt_speed"])
    with jax.numpy_dtype_promotion("standard"):  # the hand-cast reference, Flax's layers
        results = accuracy(**config["zoo"])
        results += memory(gpt_memory)
        results += speed(config["charlm"], gpt_speed, config["rounds"])
    print(table(results))
    return _harness.save(NAME, NAME, args, config, results)


if __name__ == "__main__":
    main()
