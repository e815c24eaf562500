"""nanochat's GPT as pure JAX functions over a plain dict of arrays.

Numerically the model of karpathy/nanochat's `gpt.py` (same logits, loss and gradients for the same weights):
- RoPE, base 100000, split halves, rotating by -theta like nanochat; then QK RMS-norm and q, k *= 1.2
- parameter-free RMSNorm (eps = fp32 machine epsilon, as F.rms_norm), also right after the token embedding
- ReLU^2 MLP (4x), no biases, untied wte / lm_head, GQA, vocab padded to a multiple of 64 and cropped
- sliding windows from a pattern like "SSSL": S = a quarter of the context rounded up to 128, the last layer is L
- value embeddings (ResFormer, arXiv 2410.17897) on alternating layers, the last one included, mixed into V
  through a 3*sigmoid gate that reads the first 12 channels of the block input
- smear: a cheap bigram, x_t += smear_lambda * sigmoid(gate(x_t[:24])) * x_{t-1}
- backout: subtract backout_lambda * (the residual after layer n_layer//2) before the final norm
- per-layer resid_lambdas / x0_lambdas (x = a_i x + b_i x0), fp32 logits softcapped at 15, cross-entropy
  that ignores target -1
Params are fp32 masters; `compute_dtype="bfloat16"` casts them once at the top of the forward pass, while
norm statistics, the attention softmax, logits and loss stay fp32 (nanochat's COMPUTE_DTYPE).

Layout: every weight is (in, out), so a layer is `x @ W`; `to/from_nanochat_state_dict` transpose to and from
PyTorch's (out, in). Per-layer weights of one kind are stacked on a leading axis (n_layer, or the number of
value-embedding layers for `value_embeds` and `ve_gate`), so Muon orthogonalizes them in one batched call.
Dimension letters: B batch, T time, C n_embd, H n_head, K n_kv_head, D head_dim, V padded vocab.
"""

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np

ROPE_BASE = 100000.0
SOFTCAP = 15.0
QK_SCALE = 1.2
SMEAR_CHANNELS = 24  # the smear gate reads this many channels of the current token
VE_GATE_CHANNELS = 12  # the value-embedding gate reads this many channels of the block input
EPS = float(np.finfo(np.float32).eps)  # F.rms_norm's default eps for fp32


@dataclasses.dataclass(frozen=True)
class Config:
    """nanochat's GPTConfig (same field names), plus the compute dtype of the forward pass."""
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "SSSL"
    compute_dtype: str = "float32"  # or "bfloat16": matmuls in bf16, fp32 master weights

    def __post_init__(self):
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd {self.n_embd} must split into n_head {self.n_head} heads of even size")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} must be a multiple of n_kv_head {self.n_kv_head}")
        if not self.window_pattern or set(self.window_pattern.upper()) - set("SL"):
            raise ValueError(f"window_pattern {self.window_pattern!r} must be a non-empty string of S and L")
        if self.n_embd < SMEAR_CHANNELS:
            raise ValueError(f"n_embd must be at least {SMEAR_CHANNELS} (the smear gate reads that many channels)")

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def padded_vocab(self):
        return -(-self.vocab_size // 64) * 64

    @property
    def ve_layers(self):
        """Layers with a value embedding: alternating, the last layer always included."""
        return [i for i in range(self.n_layer) if i % 2 == (self.n_layer - 1) % 2]


# The "885K nano" that trains in minutes on a laptop CPU (vocab: bytes + nanochat's 9 special tokens).
NANO = Config(sequence_len=256, vocab_size=265, n_layer=4, n_head=4, n_kv_head=4, n_embd=128, window_pattern="L")


def config_for_depth(depth, vocab_size, aspect_ratio=64, head_dim=128, **kwargs):
    """nanochat's --depth dial: width = depth * aspect_ratio rounded up to whole heads of head_dim."""
    model_dim = -(-depth * aspect_ratio // head_dim) * head_dim
    n_head = model_dim // head_dim
    return Config(vocab_size=vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_head, n_embd=model_dim, **kwargs)


def window_sizes(cfg):
    """Attention window per layer, in tokens back from the query (nanochat's `(w, 0)`; w >= T is full causal)."""
    short = -(-cfg.sequence_len // 4 // 128) * 128  # a quarter of the context, rounded up to FA3's 128 tile
    pattern = cfg.window_pattern.upper()
    sizes = [short if pattern[i % len(pattern)] == "S" else cfg.sequence_len for i in range(cfg.n_layer)]
    sizes[-1] = cfg.sequence_len
    return sizes


@functools.partial(jax.jit, static_argnames="cfg")
def init_params(cfg, key):
    """nanochat's init_weights: every parameter drawn from its own key, derived from its name."""
    C, L, V, K, D = cfg.n_embd, cfg.n_layer, cfg.padded_vocab, cfg.n_kv_head, cfg.head_dim
    n_ve = len(cfg.ve_layers)
    s = 3**0.5 / C**0.5  # U(-s, s) has std 1/sqrt(C)

    def uniform(name, shape, lo, hi):
        return jax.random.uniform(jax.random.fold_in(key, zlib.crc32(name.encode())), shape, jnp.float32, lo, hi)

    def normal(name, shape, std):
        return std * jax.random.normal(jax.random.fold_in(key, zlib.crc32(name.encode())), shape, jnp.float32)

    ramp = jnp.arange(L, dtype=jnp.float32) / max(L - 1, 1)
    return {
        "wte": normal("wte", (V, C), 0.8),
        "value_embeds": uniform("value_embeds", (n_ve, V, K * D), -s, s),
        "lm_head": normal("lm_head", (C, V), 0.001),
        "h": {
            "attn": {
                "c_q": uniform("c_q", (L, C, cfg.n_head * D), -s, s),
                "c_k": uniform("c_k", (L, C, K * D), -s, s),
                "c_v": uniform("c_v", (L, C, K * D), -s, s),
                "c_proj": jnp.zeros((L, C, C)),  # zero-init projections: each block starts as the identity
                "ve_gate": uniform("ve_gate", (n_ve, VE_GATE_CHANNELS, K), 0.0, 0.02),
            },
            "mlp": {
                "c_fc": uniform("c_fc", (L, C, 4 * C), -0.4 * s, 0.4 * s),
                "c_proj": jnp.zeros((L, 4 * C, C)),
            },
        },
        "resid_lambdas": 1.15 - 0.10 * ramp,
        "x0_lambdas": 0.20 - 0.15 * ramp,
        "smear_gate": uniform("smear_gate", (SMEAR_CHANNELS, 1), 0.0, 0.02),
        "smear_lambda": jnp.zeros((1,), jnp.float32),  # smear starts off
        "backout_lambda": jnp.full((1,), 0.2, jnp.float32),
    }


def rms_norm(x):
    """Parameter-free RMSNorm with fp32 statistics."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)).astype(x.dtype)


def rotary(positions, head_dim):
    """cos, sin tables (T, D/2) for absolute positions."""
    inv_freq = 1.0 / ROPE_BASE ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rotary(x, cos, sin):
    """Rotate split halves of x (B, T, H, D) by -theta, nanochat's (checkpoint-compatible) sign."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)


def attention_mask(q_pos, k_pos, window):
    """(Tq, Tk) bool from absolute positions: causal, and at most `window` tokens back (window + 1 keys)."""
    back = q_pos[:, None] - k_pos[None, :]
    return (back >= 0) & (back <= window)


def smear(x, gate_w, lam):
    """x_t += lam * sigmoid(x_t[:24] @ gate_w) * x_{t-1}, on the normed embeddings (B, T, C)."""
    gate = lam * jax.nn.sigmoid(x[:, 1:, :SMEAR_CHANNELS] @ gate_w)  # (B, T-1, 1)
    return jnp.concatenate([x[:, :1], x[:, 1:] + gate * x[:, :-1]], axis=1)


def attention(a, i, x, ve, cos, sin, mask, cfg):
    """Causal self-attention of layer i on the normed input x (B, T, C); ve is (ve_gate, value embedding) or None."""
    B, T, _ = x.shape
    H, K, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    q = (x @ a["c_q"][i]).reshape(B, T, H, D)
    k = (x @ a["c_k"][i]).reshape(B, T, K, D)
    v = (x @ a["c_v"][i]).reshape(B, T, K, D)
    if ve is not None:
        gate_w, e = ve
        gate = 3 * jax.nn.sigmoid(x[..., :VE_GATE_CHANNELS] @ gate_w)  # (B, T, K), in (0, 3)
        v = v + gate[..., None] * e.reshape(B, T, K, D)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q, k = rms_norm(q) * QK_SCALE, rms_norm(k) * QK_SCALE
    y = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])  # GQA: K kv heads serve H query heads
    return y.reshape(B, T, H * D) @ a["c_proj"][i]


def hidden(params, tokens, cfg):
    """The transformer trunk: tokens (B, T) -> final normed hidden states (B, T, C) in the compute dtype."""
    p = jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params)
    a, m = p["h"]["attn"], p["h"]["mlp"]
    T = tokens.shape[1]
    pos = jnp.arange(T)
    cos, sin = rotary(pos, cfg.head_dim)
    x = rms_norm(p["wte"][tokens])  # (B, T, C)
    x = smear(x, p["smear_gate"], p["smear_lambda"])
    x0, x_backout = x, None
    for i, window in enumerate(window_sizes(cfg)):
        x = p["resid_lambdas"][i] * x + p["x0_lambdas"][i] * x0
        ve = None
        if i in cfg.ve_layers:
            j = cfg.ve_layers.index(i)
            ve = (a["ve_gate"][j], p["value_embeds"][j][tokens])
        x = x + attention(a, i, rms_norm(x), ve, cos, sin, attention_mask(pos, pos, window), cfg)
        x = x + jnp.square(jax.nn.relu(rms_norm(x) @ m["c_fc"][i])) @ m["c_proj"][i]
        if i == cfg.n_layer // 2:
            x_backout = x
    x = x - p["backout_lambda"] * x_backout
    return rms_norm(x)


def logits_from_hidden(params, x, cfg):
    """Softcapped fp32 logits (..., vocab_size) from hidden states (..., C)."""
    w = params["lm_head"][:, :cfg.vocab_size].astype(x.dtype)
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return SOFTCAP * jnp.tanh(logits / SOFTCAP)


def forward(params, tokens, cfg):
    """Logits (B, T, vocab_size), float32, softcapped."""
    return logits_from_hidden(params, hidden(params, tokens, cfg), cfg)


def loss_fn(params, tokens, targets, cfg, reduction="mean"):
    """Cross-entropy, ignoring targets < 0: the mean over valid targets, or per token (B, T) with 'none'."""
    x = hidden(params, tokens, cfg)
    logits = logits_from_hidden(params, x.reshape(-1, x.shape[-1]), cfg)  # (B*T, V): 2-D is ~3x faster on CPU
    t = targets.reshape(-1)
    valid = t >= 0
    picked = jnp.take_along_axis(logits, jnp.where(valid, t, 0)[:, None], axis=-1)[:, 0]
    nll = jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)
    if reduction == "none":
        return nll.reshape(targets.shape)
    return nll.sum() / jnp.maximum(valid.sum(), 1)  # (torch gives nan when every target is ignored)


def param_shapes(cfg):
    """The params pytree of ShapeDtypeStructs, without allocating anything."""
    return jax.eval_shape(init_params, cfg, jax.random.key(0))


def _count(tree):
    return sum(math.prod(a.shape) for a in jax.tree.leaves(tree))


def num_scaling_params(cfg):
    """Parameter counts in nanochat's groups (scaling laws use transformer_matrices + lm_head)."""
    s = param_shapes(cfg)
    groups = {
        "wte": _count(s["wte"]),
        "value_embeds": _count(s["value_embeds"]),
        "lm_head": _count(s["lm_head"]),
        "transformer_matrices": _count(s["h"]),
        "scalars": _count([s[k] for k in ("resid_lambdas", "x0_lambdas", "smear_gate", "smear_lambda",
                                          "backout_lambda")]),
    }
    groups["total"] = _count(s)
    assert sum(groups.values()) == 2 * groups["total"]
    return groups


def estimate_flops(cfg):
    """Training FLOPs per token (forward + backward), nanochat's estimate_flops: 6 N_matmul + attention."""
    s = param_shapes(cfg)
    matmul = _count(s["h"]) + _count(s["smear_gate"]) + _count(s["lm_head"])
    attn = sum(12 * cfg.n_head * cfg.head_dim * min(w, cfg.sequence_len) for w in window_sizes(cfg))
    return 6 * matmul + attn


def _state_dict_layout(cfg):
    """(nanochat state_dict name, our path, index in our stacked array or None, transposed?) per parameter."""
    rows = [("transformer.wte.weight", ("wte",), None, False), ("lm_head.weight", ("lm_head",), None, True),
            ("resid_lambdas", ("resid_lambdas",), None, False), ("x0_lambdas", ("x0_lambdas",), None, False),
            ("smear_gate.weight", ("smear_gate",), None, True), ("smear_lambda", ("smear_lambda",), None, False),
            ("backout_lambda", ("backout_lambda",), None, False)]
    for i in range(cfg.n_layer):
        for mod, names in (("attn", ("c_q", "c_k", "c_v", "c_proj")), ("mlp", ("c_fc", "c_proj"))):
            rows += [(f"transformer.h.{i}.{mod}.{n}.weight", ("h", mod, n), i, True) for n in names]
    for j, i in enumerate(cfg.ve_layers):
        rows.append((f"transformer.h.{i}.attn.ve_gate.weight", ("h", "attn", "ve_gate"), j, True))
        rows.append((f"value_embeds.{i}.weight", ("value_embeds",), j, False))
    return rows


def to_nanochat_state_dict(params, cfg):
    """Our params -> nanochat's state_dict as float32 numpy arrays in PyTorch's (out, in) layout."""
    out = {}
    for name, path, idx, transposed in _state_dict_layout(cfg):
        a = np.asarray(functools.reduce(lambda t, k: t[k], path, params), np.float32)
        a = a if idx is None else a[idx]
        out[name] = a.T if transposed else a
    return out


def from_nanochat_state_dict(state_dict, cfg):
    """nanochat's state_dict (numpy arrays, any float dtype) -> our params; exact inverse of the above."""
    sd = {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}  # torch.compile'd checkpoints
    layout = _state_dict_layout(cfg)
    missing = [name for name, *_ in layout if name not in sd]
    unexpected = sorted(set(sd) - {name for name, *_ in layout})
    if missing or unexpected:
        raise ValueError(f"state_dict does not match {cfg}: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                         "pass the Config the checkpoint was trained with")
    pieces = {}
    for name, path, idx, transposed in layout:
        a = np.asarray(sd[name], np.float32)
        a = a.T if transposed else a
        if idx is None:
            pieces[path] = a
        else:
            pieces.setdefault(path, []).append(a)  # layers arrive in order
    shapes = param_shapes(cfg)
    params = {}
    for path, a in pieces.items():
        a = np.stack(a) if isinstance(a, list) else a
        want = functools.reduce(lambda t, k: t[k], path, shapes).shape
        if a.shape != want:
            raise ValueError(f"{'.'.join(path)} has shape {a.shape}, expected {want} for {cfg}")
        node = params
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = jnp.asarray(a)
    return params
