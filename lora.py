"""LoRA (arXiv 2106.09685) as a transform of the params pytree: fine-tuning that trains a few
million numbers and keeps the base frozen.

    adapters = init(params, rank=16, targets=TARGETS, key=key)    # A (L, in, r), B (L, r, out) = 0
    merged = merge(params, adapters, scale=alpha / rank)          # W + scale * A @ B per target
    loss, grads = jax.value_and_grad(lambda a: loss_fn(merge(params, a, s), ...))(adapters)

The model never sees an adapter: `merge` makes its weights from (base, adapters), and `jax.grad`
differentiates the adapters alone, so the base gets no gradient and no optimizer state. The
targets are the stacked block matrices (`nanochat.init_params`), named as nanochat's state_dict
names them within a layer: "attn.c_q", ..., "mlp.c_proj". `param_groups` gives muon.py the
adapters' one group. Why merging rather than x @ W + (x @ A) @ B * scale, and the measurements:
docs/lora.md.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np

# every attention and MLP matrix of a layer (ve_gate, a 12 x n_kv_head gate, is not one)
TARGETS = ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def check(params, rank, targets):
    """Raise a one-line ValueError unless every target is known and rank fits each one.
    params: the base (arrays or shapes)."""
    if rank < 1:
        raise ValueError(f"--lora-rank {rank}: pass a rank of at least 1")
    for target in targets:
        if target not in TARGETS:
            raise ValueError(f"--lora-targets {target!r} is unknown: choose among "
                             f"{' '.join(TARGETS)}")
        kind, name = target.split(".")
        *_, n_in, n_out = params["h"][kind][name].shape
        if rank > min(n_in, n_out):
            raise ValueError(f"--lora-rank {rank} exceeds {target}'s smaller dimension "
                             f"{min(n_in, n_out)} ({n_in} x {n_out}): pass a smaller rank")


def init(params, rank, targets, key):
    """Adapters for each target of the base params: {kind: {name: {"A", "B"}}}, A (L, in, r)
    uniform in +-1/sqrt(in) (PEFT's Kaiming init), B (L, r, out) zero, so that the adapted model
    starts as the base. Each A is drawn from its own key, derived from its target's name."""
    check(params, rank, targets)
    adapters = {}
    for target in targets:
        kind, name = target.split(".")
        *stack, n_in, n_out = params["h"][kind][name].shape
        k = jax.random.fold_in(key, zlib.crc32(target.encode()))
        bound = n_in**-0.5
        a = jax.random.uniform(k, (*stack, n_in, rank), jnp.float32, -bound, bound)
        b = np.zeros((*stack, rank, n_out), np.float32)
        adapters.setdefault(kind, {})[name] = {"A": a, "B": b}
    return adapters


def merge(params, adapters, scale):
    """The base params with each adapted matrix replaced by W + scale * A @ B (fp32, stacked
    over the layers); every other leaf is the base's own array."""
    h = {kind: dict(mats) for kind, mats in params["h"].items()}
    for kind, mats in adapters.items():
        for name, ab in mats.items():
            delta = jnp.matmul(ab["A"], ab["B"])  # (L, in, out)
            h[kind][name] = params["h"][kind][name] + scale * delta
    return {**params, "h": h}


def frozen(base, rank, alpha):
    """The frozen part of a LoRA step (train.train_step's `frozen`): the base and the scale."""
    return {"base": base, "scale": np.float32(alpha / rank)}


def merged(fn, frozen):
    """fn(params, ...) given the model's params: the adapters merged onto frozen's base; fn
    itself when frozen is None (no LoRA)."""
    if frozen is None:
        return fn

    def call(adapters, *rest):
        return fn(merge(frozen["base"], adapters, frozen["scale"]), *rest)
    return call


def param_groups(adapters, lr_mult=1.0, momentum=0.95, weight_decay=0.0, lr=0.02,
                 muon_dtype="float32", kind="adamw"):
    """(labels, groups) for muon.py: every adapter in one group "lora", at lr * lr_mult. kind
    "adamw" is PEFT's optimizer (betas 0.9, 0.999, eps 1e-8); "muon" steps A and B as matrices
    (docs/lora.md compares them)."""
    if kind == "muon":
        group = dict(kind="muon", lr=lr * lr_mult, momentum=momentum,
                     weight_decay=weight_decay, beta2=0.9, dtype=muon_dtype)
    else:
        group = dict(kind="adamw", lr=lr * lr_mult, betas=(0.9, 0.999), eps=1e-8,
                     weight_decay=weight_decay)
    labels = jax.tree.map(lambda _: "lora", adapters)
    return labels, {"lora": group}
