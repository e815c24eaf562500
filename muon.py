"""nanochat's MuonAdamW as pure functions over any pytree:

    state = init(params, labels, groups)
    params, state = update(grads, state, params, labels, groups)

`labels` is a pytree like params with a group name per leaf; `groups` maps each name to its
hyper-parameters, dict(kind="adamw", ...) or dict(kind="muon", ...). nanochat.param_groups builds
nanochat's. docs/optimizer.md tells what each part of the Muon step does, and where it comes from.
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
    """NorMuon's factored second moment of a matrix (..., in, out): one number per output unit,
    or per input unit when there are more inputs."""
    *stack, n_in, n_out = w.shape
    if n_out >= n_in:
        return (*stack, 1, n_out)
    return (*stack, n_in, 1)


def init(params, labels, groups):
    """Optimizer state: a step counter, first moments like params, second moments (factored for
    Muon leaves). Host zeros, which jit takes as they are: jnp.zeros would compile a device op
    for every shape."""
    def first(w):
        return np.zeros(w.shape, w.dtype)

    def second(w, label):
        if groups[label]["kind"] == "muon":
            return np.zeros(second_moment_shape(w), np.float32)
        return np.zeros(w.shape, w.dtype)  # AdamW's moments in the leaf's dtype, as nanochat's

    return {"step": np.zeros((), np.int32),
            "mom": jax.tree.map(first, params),
            "var": jax.tree.map(second, params, labels)}


def frobenius(x):
    """The Frobenius norm of each matrix of a stack (..., m, n), kept as (..., 1, 1)."""
    return jnp.linalg.norm(x, axis=(-2, -1), keepdims=True)


def matrix_sum(x):
    """The sum over each matrix of a stack (..., m, n), kept as (..., 1, 1)."""
    return jnp.sum(x, axis=(-2, -1), keepdims=True)


def polar_express(x):
    """Approximate the orthogonal polar factor U V^T of a stack of matrices x (K, m, n)."""
    rows, cols = x.shape[-2:]
    # scale so that every singular value is at most 1
    norm = frobenius(x.astype(jnp.float32))
    x = x / (norm * 1.01 + 1e-6).astype(x.dtype)
    for a, b, c in POLAR_EXPRESS:
        if rows > cols:
            # tall: iterate on the small cols x cols Gram matrix
            A = x.mT @ x
            x = a * x + x @ (b * A + c * A @ A)
        else:
            A = x @ x.mT
            x = a * x + (b * A + c * A @ A) @ x
    return x


def muon_step(p, g, buf, buf2, *, lr, momentum, weight_decay, beta2=0.9, dtype=jnp.float32):
    """One Muon step on a stack of matrices p (K, in, out): (p, buf, buf2), buf the momentum and
    buf2 NorMuon's second moment."""
    n_in, n_out = p.shape[-2:]
    # 1. Nesterov momentum in nanochat's lerp form
    buf = buf + (1 - momentum) * (g - buf)  # lerp(buf, g, 1 - momentum)
    g = g + momentum * (buf - g)  # lerp(g, buf, momentum)
    # 2. MuonEq: every output unit's weight vector gets the same norm, ||G||_F / sqrt(out)
    units = jnp.linalg.norm(g, axis=-2, keepdims=True)  # (K, 1, out)
    units = jnp.maximum(units, 1e-6)
    g = g * (frobenius(g) / n_out**0.5) / units
    # 3. orthogonalize, in `dtype`
    g = polar_express(g.astype(dtype)).astype(p.dtype)
    # 4. Muon+: snap to the Frobenius norm of an exactly semi-orthogonal matrix
    g = g * (min(n_out, n_in) ** 0.5 / jnp.maximum(frobenius(g), 1e-6))
    # 5. NorMuon: a per-unit scale from an EMA of the mean square, the Frobenius norm kept
    axis = -2 if n_out >= n_in else -1
    size = g.shape[axis]
    v_mean = jnp.mean(g * g, axis=axis, keepdims=True)
    v_norm = jnp.sqrt(matrix_sum(v_mean) * size)
    buf2 = buf2 + (1 - beta2) * (v_mean - buf2)
    unit_scale = jax.lax.rsqrt(jnp.maximum(buf2, 1e-10))
    v_norm_new = jnp.sqrt(matrix_sum(v_mean * size * unit_scale * unit_scale))
    g = g * (unit_scale * (v_norm / jnp.maximum(v_norm_new, 1e-10)))
    # 6. the shape-aware learning rate, and cautious weight decay: only where the update and
    # the weight agree in sign
    lr = lr * max(1.0, n_out / n_in) ** 0.5
    agree = (g * p) >= 0
    p = p - (lr * g + lr * weight_decay * p * agree)
    return p, buf, buf2


def adamw_step(p, g, m, v, t, *, lr, beta1, beta2, weight_decay, eps=1e-10):
    """One AdamW step at step t (from 1): decoupled weight decay first, then the bias-corrected
    update. Returns (p, m, v) in p's dtype, which its moments share (init); the math is fp32,
    so a bf16 embedding keeps bf16 moments, rounded once a step, as nanochat's do."""
    dtype = p.dtype
    p, g, m, v = (a.astype(jnp.float32) for a in (p, g, m, v))
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v + (1 - beta2) * (g * g - v)
    denom = jnp.sqrt(v / (1 - beta2**t)) + eps
    p = p - (lr / (1 - beta1**t)) * m / denom
    return p.astype(dtype), m.astype(dtype), v.astype(dtype)


def stacked(leaves, shards=1, constrain_stack=None):
    """The matrices of leaves (each (..., rows, cols)) as one stack (N, rows, cols); with
    shards > 1 padded with zero matrices at its end to a multiple of shards and laid out by
    constrain_stack(stack)."""
    x = jnp.concatenate([leaf.reshape(-1, *leaf.shape[-2:]) for leaf in leaves])
    if shards > 1:
        zero_matrices = ((0, -len(x) % shards), (0, 0), (0, 0))
        x = constrain_stack(jnp.pad(x, zero_matrices))
    return x


def update(grads, state, params, labels, groups, shards=1, constrain_stack=None):
    """One MuonAdamW step: each leaf by the group its label names. Returns (params, state).

    shards, constrain_stack: split each Muon stack over `shards` devices, padded with zero
    matrices to a multiple of them (zeros stay zeros through the step) and laid out by
    constrain_stack(stack), the caller's sharding hint. Each device then orthogonalizes
    whole matrices of its share, as nanochat's ranks do, whatever the layer count."""
    t = state["step"] + 1
    treedef = jax.tree.structure(params)
    trees = (params, grads, state["mom"], state["var"], labels)
    p, g, m, v, names = (treedef.flatten_up_to(tree) for tree in trees)
    out = [None] * len(p)  # (p, m, v) of each leaf
    # 1. AdamW leaves one by one; Muon leaves gathered by group and matrix shape to be
    # split over devices. On one device each leaf (a stack of its layers' matrices) is a
    # stack alone: concatenating would copy each matrix, gradient and momentum
    stacks = {}
    for i, name in enumerate(names):
        hp = groups[name]
        if hp["kind"] == "adamw":
            beta1, beta2 = hp["betas"]
            out[i] = adamw_step(p[i], g[i], m[i], v[i], t,
                                lr=hp["lr"],
                                beta1=beta1,
                                beta2=beta2,
                                weight_decay=hp["weight_decay"],
                                eps=hp["eps"])
        else:
            key = (name, p[i].shape[-2:]) if shards > 1 else (name, i)
            stacks.setdefault(key, []).append(i)
    # 2. each Muon stack stepped in one call
    for (name, _), idx in stacks.items():
        hp = groups[name]
        sizes = [math.prod(p[i].shape[:-2]) for i in idx]  # matrices in each leaf
        stack = muon_step(*(stacked([leaves[i] for i in idx], shards, constrain_stack)
                            for leaves in (p, g, m, v)),
                          lr=hp["lr"],
                          momentum=hp["momentum"],
                          weight_decay=hp["weight_decay"],
                          beta2=hp["beta2"],
                          dtype=hp["dtype"])
        # 3. the padding dropped, each leaf's matrices back in its shape
        stack = [a[:sum(sizes)] for a in stack]
        splits = list(itertools.accumulate(sizes))[:-1]
        pieces = [jnp.split(a, splits) for a in stack]
        for j, i in enumerate(idx):
            new_p, new_m, new_v = (piece[j] for piece in pieces)
            out[i] = (new_p.reshape(p[i].shape),
                      new_m.reshape(m[i].shape),
                      new_v.reshape(v[i].shape))
    # 4. back to trees
    new_params = treedef.unflatten([leaf[0] for leaf in out])
    new_mom = treedef.unflatten([leaf[1] for leaf in out])
    new_var = treedef.unflatten([leaf[2] for leaf in out])
    return new_params, {"step": t, "mom": new_mom, "var": new_var}
