"""LoRA (arXiv 2106.09685) as a transform of the params pytree: fine-tuning that
trains a few million numbers and keeps the base frozen.

    adapters = init(params, 16, TARGETS, key)   # A (L, in, r), B (L, r, out) = 0
    model = merge(params, adapters, scale)       # W + scale * A @ B on each target
    grads = jax.grad(lambda a: loss(merge(params, a, scale)))(adapters)

The model never sees an adapter: `merge` makes its weights from (base, adapters),
and `jax.grad` differentiates the adapters alone, so the base gets no gradient and
no optimizer state. The targets are the stacked block matrices, named as nanochat's
state_dict names them within a layer ("attn.c_q", ..., "mlp.c_proj"). A few token
ids (the chat's special tokens, which pretraining never taught) also get a trainable
delta of their wte row and lm_head column, as PEFT's trainable_token_indices. Why
merging rather than x @ W + (x @ A) @ B * scale, and the measurements: docs/lora.md.
"""

import zlib

import jax
import jax.numpy as jnp
import numpy as np

# every attention and MLP matrix of a layer (ve_gate, 12 x n_kv_head, is a gate)
TARGETS = ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def check(params, rank, targets):
    """Raise a one-line ValueError unless every target is known and the rank fits
    each one. params: the base (arrays or shapes)."""
    if rank < 1:
        raise ValueError(f"--lora-rank {rank}: pass a rank of at least 1")
    for target in targets:
        if target not in TARGETS:
            raise ValueError(f"--lora-targets {target!r} is unknown: choose among "
                             f"{' '.join(TARGETS)}")
        part, name = target.split(".")
        *_, n_in, n_out = params["h"][part][name].shape
        # a rank past the smaller side adds parameters and no expressiveness
        if rank > min(n_in, n_out):
            raise ValueError(f"--lora-rank {rank} exceeds {target}'s smaller "
                             f"dimension {min(n_in, n_out)} ({n_in} x {n_out}): pass a "
                             "smaller rank")


def init(params, rank, targets, key, tokens=()):
    """Adapters of the base params' targets, {part: {name: {"A", "B"}}}: A (L, in, r)
    uniform in +-1/sqrt(in), PEFT's Kaiming init; B (L, r, out) zero, so that the
    adapted model starts as the base. Each A has its own key, from its target's name.
    With token ids, "tokens" holds zero deltas of their wte rows (N, C) and lm_head
    columns (C, N)."""
    check(params, rank, targets)
    adapters = {}
    if len(tokens):
        n_embd = params["wte"].shape[1]
        adapters["tokens"] = {"wte": np.zeros((len(tokens), n_embd), np.float32),
                              "lm_head": np.zeros((n_embd, len(tokens)), np.float32)}
    for target in targets:
        part, name = target.split(".")
        *stack, n_in, n_out = params["h"][part][name].shape
        k = jax.random.fold_in(key, zlib.crc32(target.encode()))
        bound = n_in**-0.5
        a = jax.random.uniform(k, (*stack, n_in, rank), jnp.float32, -bound, bound)
        # B = 0: the first step moves B alone (A's gradient, scale * dW B^T, is zero)
        b = np.zeros((*stack, rank, n_out), np.float32)
        adapters.setdefault(part, {})[name] = {"A": a, "B": b}
    return adapters


def merge(params, adapters, scale, tokens=None):
    """The base params with each adapted matrix W replaced by W + scale * A @ B (fp32,
    stacked over the layers), and the token deltas added at the ids `tokens`; every
    other leaf is the base's own array."""
    merged = dict(params)
    h = {part: dict(mats) for part, mats in params["h"].items()}
    for part, mats in adapters.items():
        if part == "tokens":  # not a block matrix: below
            continue
        for name, ab in mats.items():
            # the product has W's shape (L, in, out); B = 0 adds exact zeros
            delta = jnp.matmul(ab["A"], ab["B"])
            h[part][name] = params["h"][part][name] + scale * delta
    # the token deltas: added at their ids (the gradient gathers those rows alone)
    if "tokens" in adapters:
        rows = adapters["tokens"]
        merged["wte"] = jnp.asarray(params["wte"]).at[tokens].add(rows["wte"])
        merged["lm_head"] = jnp.asarray(params["lm_head"]).at[:, tokens].add(rows["lm_head"])
    return {**merged, "h": h}


def frozen(base, rank, alpha, tokens=()):
    """The frozen part of a LoRA step (train.train_step's `frozen`): the base params,
    the scale alpha / rank (an fp32 array, laid out and traced as one) and the ids of
    the token deltas."""
    return {"base": base, "scale": np.float32(alpha / rank),
            "tokens": np.asarray(tokens, np.int32)}


def apply(frozen, adapters):
    """The model's params: the adapters merged onto frozen's base."""
    return merge(frozen["base"], adapters, frozen["scale"], frozen["tokens"])


def merged(fn, frozen):
    """fn(params, ...) given the model's params: the adapters merged onto frozen's
    base; fn itself when frozen is None (no LoRA)."""
    if frozen is None:
        return fn

    def call(adapters, *rest):
        return fn(apply(frozen, adapters), *rest)
    return call


def param_groups(adapters, lr_mult=1.0, momentum=0.95, weight_decay=0.0, lr=0.02,
                 muon_dtype="float32", kind="muon"):
    """(labels, groups) for muon.py: the A and B factors in group "lora", at lr *
    lr_mult, the token deltas in "lora_tokens" (AdamW). kind "muon": A and B stepped
    as matrices, which won on the default run (docs/lora.md); "adamw": PEFT's optimizer
    (betas 0.9, 0.999, eps 1e-8)."""
    # the schedules trace lr_mult, momentum and weight_decay: nothing recompiles
    adamw = dict(kind="adamw", lr=lr * lr_mult, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=weight_decay)
    groups = {"lora": adamw, "lora_tokens": adamw}
    if kind == "muon":
        groups["lora"] = dict(kind="muon", lr=lr * lr_mult, momentum=momentum,
                              weight_decay=weight_decay, beta2=0.9, dtype=muon_dtype)
    # each leaf labelled with its group, the token deltas apart
    labels = {}
    for name, tree in adapters.items():
        group = "lora_tokens" if name == "tokens" else "lora"
        labels[name] = jax.tree.map(lambda _, group=group: group, tree)
    return labels, groups
