"""nanochat's MuonAdamW as pure functions: `init(params) -> state`, `update(grads, state, params) -> (params, state)`.

Routing is by parameter name, never by ndim (stacked layer weights are 3-D):
- Muon (arXiv 2502.16982) for every matrix under params["h"] (the transformer blocks, ve_gate included):
  Nesterov momentum in nanochat's lerp form; MuonEq row equilibration; Polar Express orthogonalization
  (arXiv 2505.16932, nanochat's five (a, b, c) triples, normalized by 1.01 * ||X||_F); Muon+ renormalization
  to the Frobenius norm of a semi-orthogonal matrix; NorMuon variance reduction (arXiv 2510.05491) with a
  factored second moment; cautious weight decay (arXiv 2510.12402, decay only where update and weight agree
  in sign); lr * sqrt(max(1, out/in)) for tall matrices. Same-shape matrices are orthogonalized in one
  batched call, like nanochat's shape groups.
- AdamW for the embeddings, lm_head and scalars, with nanochat's per-group lr, betas and weight decay,
  lr scaled by 1/sqrt(n_embd/768) for the embeddings and the head, eps 1e-10, bias correction, fp32 math.

The Muon math is written in nanochat's (out, in) layout: our (in, out) weights are transposed on the way in
and out. Learning rates, momentum and weight decay may be traced values, so schedules never recompile.
"""

import itertools

import jax
import jax.numpy as jnp

POLAR_EXPRESS = (  # (a, b, c) per iteration: X <- aX + (bA + cA^2)X, A = XX^T
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
MUON_BETA2 = 0.9  # NorMuon's second-moment EMA
ADAM_EPS = 1e-10

# AdamW groups, keyed by top-level parameter name: (which base lr, lr factor, beta1, beta2, weight decay).
ADAMW_GROUPS = {
    "lm_head": ("unembedding", 1.0, 0.8, 0.96, 0.01),
    "wte": ("embedding", 1.0, 0.8, 0.995, 0.001),
    "value_embeds": ("embedding", 0.5, 0.8, 0.995, 0.01),
    "resid_lambdas": ("scalar", 0.01, 0.8, 0.95, 0.05),
    "x0_lambdas": ("scalar", 1.0, 0.96, 0.95, 0.0),
    "smear_gate": ("smear", 1.0, 0.8, 0.95, 0.0),
    "smear_lambda": ("smear", 1.0, 0.8, 0.95, 0.0),
    "backout_lambda": ("smear", 1.0, 0.8, 0.95, 0.0),
}
SMEAR_LR = 0.2  # hard-coded in nanochat: no width or batch scaling


def _torch_layout(w):
    return jnp.swapaxes(w, -1, -2)  # (K, in, out) <-> (K, out, in); its own inverse


def _second_moment_shape(w):
    """NorMuon's factored second moment, in (K, out, in) terms: per row if out >= in, else per column."""
    k, n, m = w.shape  # ours is (K, in, out)
    return (k, m, 1) if m >= n else (k, 1, n)


def init(params):
    """Optimizer state: a step counter, first moments like params, second moments (factored for Muon)."""
    return {
        "step": jnp.zeros((), jnp.int32),
        "mom": jax.tree.map(jnp.zeros_like, params),
        "var": {k: jax.tree.map(lambda w: jnp.zeros(_second_moment_shape(w)), v) if k == "h" else jnp.zeros_like(v)
                for k, v in params.items()},
    }


def polar_express(x):
    """Approximate the orthogonal polar factor U V^T of a stack of matrices x (K, m, n)."""
    m, n = x.shape[-2:]
    x = x / (jnp.linalg.norm(x.astype(jnp.float32), axis=(-2, -1), keepdims=True) * 1.01 + 1e-6).astype(x.dtype)
    for a, b, c in POLAR_EXPRESS:
        if m > n:  # tall: iterate on the small n x n Gram matrix
            A = x.mT @ x
            x = a * x + x @ (b * A + c * A @ A)
        else:
            A = x @ x.mT
            x = a * x + (b * A + c * A @ A) @ x
    return x


def muon_step(p, g, buf, buf2, lr, momentum, weight_decay, dtype=jnp.float32):
    """One Muon step on stacked matrices in nanochat's (K, out, in) layout; returns (p, buf, buf2)."""
    m, n = p.shape[-2:]
    buf = buf + (1 - momentum) * (g - buf)  # momentum EMA, lerp(buf, g, 1 - mu)
    g = g + momentum * (buf - g)  # Nesterov: lerp(g, buf, mu)
    # MuonEq: give every row the same norm, ||G||_F / sqrt(m)
    rows = jnp.maximum(jnp.linalg.norm(g, axis=-1, keepdims=True), 1e-6)
    g = g * (jnp.linalg.norm(g, axis=(-2, -1), keepdims=True) / m**0.5) / rows
    g = polar_express(g.astype(dtype)).astype(p.dtype)
    # Muon+: snap to the Frobenius norm of an exactly semi-orthogonal matrix
    g = g * (min(m, n) ** 0.5 / jnp.maximum(jnp.linalg.norm(g, axis=(-2, -1), keepdims=True), 1e-6))
    # NorMuon: per-row (or per-column) adaptive scale from an EMA of the mean square, Frobenius norm kept
    axis = -1 if m >= n else -2
    size = g.shape[axis]
    v_mean = jnp.mean(g * g, axis=axis, keepdims=True)
    v_norm = jnp.sqrt(jnp.sum(v_mean, axis=(-2, -1), keepdims=True) * size)
    buf2 = buf2 + (1 - MUON_BETA2) * (v_mean - buf2)
    step = jax.lax.rsqrt(jnp.maximum(buf2, 1e-10))
    v_norm_new = jnp.sqrt(jnp.sum(v_mean * size * step * step, axis=(-2, -1), keepdims=True))
    g = g * (step * (v_norm / jnp.maximum(v_norm_new, 1e-10)))
    # cautious weight decay, and the shape-aware lr
    lr = lr * max(1.0, m / n) ** 0.5
    mask = (g * p) >= 0
    return p - (lr * g + lr * weight_decay * p * mask), buf, buf2


def adamw_step(p, g, m, v, t, lr, beta1, beta2, weight_decay):
    """One AdamW step (decoupled weight decay first, then the bias-corrected update); returns (p, m, v)."""
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = v + (1 - beta2) * (g * g - v)
    denom = jnp.sqrt(v / (1 - beta2**t)) + ADAM_EPS
    return p - (lr / (1 - beta1**t)) * m / denom, m, v


def update(grads, state, params, *, lr_mult=1.0, momentum=0.95, weight_decay=0.0, unembedding_lr=0.004,
           embedding_lr=0.2, matrix_lr=0.02, scalar_lr=0.5, muon_dtype=jnp.float32):
    """One MuonAdamW step. Base lrs are setup_optimizer's defaults; lr_mult, momentum and the Muon
    weight_decay are what nanochat's schedules change each step."""
    t = state["step"] + 1
    dmodel_scale = (params["wte"].shape[1] / 768) ** -0.5
    base_lr = {"unembedding": unembedding_lr * dmodel_scale, "embedding": embedding_lr * dmodel_scale,
               "scalar": scalar_lr, "smear": SMEAR_LR}
    new_p, new_m, new_v = {}, {}, {}
    for name, (lr_name, factor, beta1, beta2, wd) in ADAMW_GROUPS.items():
        lr = base_lr[lr_name] * factor * lr_mult
        new_p[name], new_m[name], new_v[name] = adamw_step(
            params[name], grads[name], state["mom"][name], state["var"][name], t, lr, beta1, beta2, wd)

    # Muon: gather the block matrices into stacks of one shape, step each stack once, scatter back
    leaves, treedef = jax.tree.flatten(params["h"])
    flat = [jax.tree.leaves(tree) for tree in (grads["h"], state["mom"]["h"], state["var"]["h"])]
    by_shape = {}
    for i, w in enumerate(leaves):
        by_shape.setdefault(w.shape[1:], []).append(i)
    out = [None] * len(leaves)
    for idx in by_shape.values():
        p, g, buf = (jnp.concatenate([_torch_layout(src[i]) for i in idx]) for src in (leaves, flat[0], flat[1]))
        buf2 = jnp.concatenate([flat[2][i] for i in idx])
        p, buf, buf2 = muon_step(p, g, buf, buf2, matrix_lr * lr_mult, momentum, weight_decay, muon_dtype)
        splits = list(itertools.accumulate(leaves[i].shape[0] for i in idx))[:-1]
        for i, pi, bi, b2i in zip(idx, *(jnp.split(a, splits) for a in (p, buf, buf2))):
            out[i] = (_torch_layout(pi), _torch_layout(bi), b2i)
    for d, k in ((new_p, 0), (new_m, 1), (new_v, 2)):
        d["h"] = jax.tree.unflatten(treedef, [o[k] for o in out])
    return new_p, {"step": t, "mom": new_m, "var": new_v}
