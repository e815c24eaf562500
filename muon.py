"""nanochat's MuonAdamW as pure functions over any pytree:
`init(params, labels, groups) -> state`, `update(grads, state, params, labels, groups) ->
(params, state)`.

The caller says how each leaf is optimized, as data: `labels` is a pytree like params with a group
name per leaf, and `groups` maps names to hyper-parameters, dict(kind="adamw", lr, betas, eps,
weight_decay) or dict(kind="muon", lr, momentum, weight_decay, beta2, dtype); nanochat.param_groups
builds nanochat's. They may be traced values, so schedules never recompile. Muon leaves are
matrices (in, out), `x @ W`, or stacks of them (..., in, out).
- Muon (arXiv 2502.16982): Nesterov momentum in nanochat's lerp form; MuonEq (every output unit's
  weights get the same norm); Polar Express orthogonalization (arXiv 2505.16932: nanochat's five
  (a, b, c) triples, after dividing by 1.01 ||X||_F); Muon+ rescaling to the Frobenius norm of a
  semi-orthogonal matrix; NorMuon's variance reduction (arXiv 2510.05491) with a second moment
  factored per output unit (per input when there are more inputs); cautious weight decay (arXiv
  2510.12402: decay only where update and weight agree in sign); lr * sqrt(max(1, out / in)).
  The matrices of one group and shape are orthogonalized in one batched call.
- AdamW: decoupled weight decay, bias correction, fp32 math.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

POLAR_EXPRESS = (  # (a, b, c) per iteration: X <- aX + (bA + cA^2)X, A = XX^T
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def second_moment_shape(w):
    """NorMuon's factored second moment of a matrix (..., in, out): per output unit, or per input
    when in > out."""
    *k, n, m = w.shape
    return (*k, 1, m) if m >= n else (*k, n, 1)


def init(params, labels, groups):
    """Optimizer state: a step counter, first moments like params, second moments (factored for
    Muon leaves). Host zeros, which jit takes as they are: jnp.zeros would compile a device op for
    every shape."""
    def second(w, label):
        muon = groups[label]["kind"] == "muon"
        return np.zeros(second_moment_shape(w) if muon else w.shape, np.float32)
    return {"step": np.zeros((), np.int32),
            "mom": jax.tree.map(lambda w: np.zeros(w.shape, w.dtype), params),
            "var": jax.tree.map(second, params, labels)}


def polar_express(x):
    """Approximate the orthogonal polar factor U V^T of a stack of matrices x (K, m, n)."""
    m, n = x.shape[-2:]
    norm = jnp.linalg.norm(x.astype(jnp.float32), axis=(-2, -1), keepdims=True)
    x = x / (norm * 1.01 + 1e-6).astype(x.dtype)
    for a, b, c in POLAR_EXPRESS:
        if m > n:  # tall: iterate on the small n x n Gram matrix
            A = x.mT @ x
            x = a * x + x @ (b * A + c * A @ A)
        else:
            A = x @ x.mT
            x = a * x + (b * A + c * A @ A) @ x
    return x


def muon_step(p, g, buf, buf2, lr, momentum, weight_decay, beta2=0.9, dtype=jnp.float32):
    """One Muon step on a stack of matrices p (K, in, out); returns (p, buf, buf2)."""
    n, m = p.shape[-2:]  # fan in, fan out
    buf = buf + (1 - momentum) * (g - buf)  # momentum EMA, lerp(buf, g, 1 - mu)
    g = g + momentum * (buf - g)  # Nesterov: lerp(g, buf, mu)
    # MuonEq: every output unit's weight vector gets the same norm, ||G||_F / sqrt(out)
    units = jnp.maximum(jnp.linalg.norm(g, axis=-2, keepdims=True), 1e-6)
    g = g * (jnp.linalg.norm(g, axis=(-2, -1), keepdims=True) / m**0.5) / units
    g = polar_express(g.astype(dtype)).astype(p.dtype)
    # Muon+: snap to the Frobenius norm of an exactly semi-orthogonal matrix
    g = g * (min(m, n) ** 0.5 / jnp.maximum(jnp.linalg.norm(g, axis=(-2, -1), keepdims=True), 1e-6))
    # NorMuon: a per-unit adaptive scale from an EMA of the mean square, the Frobenius norm kept
    axis = -2 if m >= n else -1
    size = g.shape[axis]
    v_mean = jnp.mean(g * g, axis=axis, keepdims=True)
    v_norm = jnp.sqrt(jnp.sum(v_mean, axis=(-2, -1), keepdims=True) * size)
    buf2 = buf2 + (1 - beta2) * (v_mean - buf2)
    step = jax.lax.rsqrt(jnp.maximum(buf2, 1e-10))
    v_norm_new = jnp.sqrt(jnp.sum(v_mean * size * step * step, axis=(-2, -1), keepdims=True))
    g = g * (step * (v_norm / jnp.maximum(v_norm_new, 1e-10)))
    # cautious weight decay, and the shape-aware lr
    lr = lr * max(1.0, m / n) ** 0.5
    mask = (g * p) >= 0
    return p - (lr * g + lr * weight_decay * p * mask), buf, buf2


def adamw_step(p, g, m, v, t, lr, beta1, beta2, weight_decay, eps=1e-10):
    """One AdamW step, decoupled weight decay first, then the bias-corrected update: (p, m, v)."""
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v + (1 - beta2) * (g * g - v)
    denom = jnp.sqrt(v / (1 - beta2**t)) + eps
    return p - (lr / (1 - beta1**t)) * m / denom, m, v


def update(grads, state, params, labels, groups, shards=1, place=None):
    """One MuonAdamW step: each leaf by the group its label names. Returns (params, state).
    shards, place: split each Muon stack over `shards` devices, padded with zero matrices to a
    multiple of them (zeros stay zeros through the step) and laid out by place(stack), the
    caller's sharding hint: each device then orthogonalizes whole matrices of its share, as
    nanochat's ranks do, whatever the layer count."""
    t, treedef = state["step"] + 1, jax.tree.structure(params)
    trees = (params, grads, state["mom"], state["var"], labels)
    p, g, m, v, names = (treedef.flatten_up_to(tree) for tree in trees)
    out, stacks = [None] * len(p), {}
    for i, name in enumerate(names):
        hp = groups[name]
        if hp["kind"] == "adamw":
            out[i] = adamw_step(p[i], g[i], m[i], v[i], t, hp["lr"], *hp["betas"],
                                hp["weight_decay"], hp["eps"])
        else:
            stacks.setdefault((name, p[i].shape[-2:]), []).append(i)
    # Muon: the matrices of one group and shape in one stack, stepped once, scattered back
    for (name, _), idx in stacks.items():
        hp, sizes = groups[name], [math.prod(p[i].shape[:-2]) for i in idx]

        def cat(xs):
            x = jnp.concatenate([xs[i].reshape(-1, *xs[i].shape[-2:]) for i in idx])
            if shards > 1:
                x = place(jnp.pad(x, ((0, -len(x) % shards), (0, 0), (0, 0))))
            return x
        stack = muon_step(cat(p), cat(g), cat(m), cat(v), hp["lr"], hp["momentum"],
                          hp["weight_decay"], hp["beta2"], hp["dtype"])
        stack = [a[:sum(sizes)] for a in stack]  # the padding dropped
        splits = list(itertools.accumulate(sizes))[:-1]
        for i, *parts in zip(idx, *(jnp.split(a, splits) for a in stack)):
            out[i] = tuple(a.reshape(like.shape) for a, like in zip(parts, (p[i], m[i], v[i])))
    new_p, new_m, new_v = (treedef.unflatten([o[k] for o in out]) for k in range(3))
    return new_p, {"step": t, "mom": new_m, "var": new_v}
