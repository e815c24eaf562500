"""nanochat's GPT as pure JAX functions over a plain dict of arrays.

Numerically the model of karpathy/nanochat's `gpt.py` (same logits, loss and gradients for the same weights):
- RoPE (arXiv 2104.09864), base 100000, split halves, rotating by -theta like nanochat; then QK RMS-norm, q, k *= 1.2
- parameter-free RMSNorm (eps = fp32 machine epsilon, as F.rms_norm), also right after the token embedding
- ReLU^2 MLP (4x), no biases, untied wte / lm_head, GQA, vocab padded to a multiple of 64 and cropped
- sliding windows from a pattern like "SSSL": S = a quarter of the context rounded up to 128, the last layer is L
- value embeddings (ResFormer, arXiv 2410.17897) on alternating layers, the last one included, mixed into V
  through a 3*sigmoid gate that reads the first 12 channels of the block input
- smear: a cheap bigram, x_t += smear_lambda * sigmoid(gate(x_t[:24])) * x_{t-1}
- backout: subtract backout_lambda * (the residual after layer n_layer//2) before the final norm
- per-layer resid_lambdas / x0_lambdas (x = a_i x + b_i x0), fp32 logits softcapped at 15, cross-entropy
  that ignores target -1
Params are fp32 masters; compute_dtype="bfloat16" casts them once at the top of the forward pass, while norm
statistics, the attention softmax, logits and loss stay fp32 (nanochat's COMPUTE_DTYPE).

Read `init_params`, `param_groups` (how the optimizer treats each leaf), then `block`: one layer over one layer's
weights, shared by training, prefill and decode. `attend` is the plain attention; `causal_attention` (training)
takes the backend's fast route to the same numbers (`attention_route`: cuDNN on GPU, Pallas splash attention on
TPU, `attend_cpu` on CPU), each tested against it.
Inference is nanochat's Engine: a preallocated KV cache written in place at a traced position (donated: one
compiled decode step serves every position), masks from absolute positions so sliding windows hold while decoding,
prompts padded to power-of-two buckets, greedy / temperature / top-k / top-p sampling as traced values (a new
setting never recompiles), tools that force tokens.

Layout: weights are (in, out), `x @ W`; `to/from_nanochat_state_dict` convert to and from PyTorch's (out, in).
Per-layer weights of a kind are stacked on a leading axis (layers, or value-embedding layers for `value_embeds`
and `ve_gate`) so Muon steps them in one batched call; `unstack` slices them per layer. Activations and the KV
cache are time-major. Dimensions: B batch, T time (S cache slots), C n_embd, H n_head, K n_kv_head, D head_dim.
"""

import collections
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
ATTENTION = ("auto", "cudnn", "splash", "cpu", "xla", "plain")  # causal_attention's routes (attention_route)


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
    attention: str = "auto"  # causal_attention's route, one of ATTENTION; auto: by backend and shape

    def __post_init__(self):
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd {self.n_embd} must split into n_head {self.n_head} heads of even size")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} must be a multiple of n_kv_head {self.n_kv_head}")
        if not self.window_pattern or set(self.window_pattern.upper()) - set("SL"):
            raise ValueError(f"window_pattern {self.window_pattern!r} must be a non-empty string of S and L")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r} must be one of {ATTENTION}")
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


def config_from(d, where):
    """Config(**d) of a checkpoint's meta: a field this version does not know is a one-line error, not a TypeError."""
    if unknown := sorted(set(d) - {f.name for f in dataclasses.fields(Config)}):
        raise ValueError(f"{where}: config fields {unknown} are unknown to this version of nanochat.py; read it with "
                         "the version that wrote it")
    return Config(**d)


# The nano model that trains in minutes on a laptop CPU (~0.98M params; vocab: train.py's default tokenizer).
NANO = Config(sequence_len=256, vocab_size=384, n_layer=4, n_head=4, n_kv_head=4, n_embd=128, window_pattern="L")


def config_for_depth(depth, vocab_size, aspect_ratio=64, head_dim=128, **kwargs):
    """nanochat's --depth dial: width = depth * aspect_ratio rounded up to whole heads of head_dim."""
    model_dim = -(-depth * aspect_ratio // head_dim) * head_dim
    n_head = model_dim // head_dim
    return Config(vocab_size=vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_head, n_embd=model_dim, **kwargs)


def window_sizes(cfg):
    """Attention window per layer, in tokens back from the query (nanochat's `(w, 0)`; w >= T is full causal)."""
    short = -(-cfg.sequence_len // 4 // 128) * 128  # a quarter of the context, rounded up to FA3's 128 tile
    pattern = cfg.window_pattern.upper()  # the last layer always sees the whole context
    return [short if pattern[i % len(pattern)] == "S" and i < cfg.n_layer - 1 else cfg.sequence_len
            for i in range(cfg.n_layer)]


@functools.partial(jax.jit, static_argnames="cfg")
def init_params(cfg, key):
    """nanochat's init_weights: every parameter drawn from its own key, derived from its name."""
    C, L, V, K, D, n_ve = cfg.n_embd, cfg.n_layer, cfg.padded_vocab, cfg.n_kv_head, cfg.head_dim, len(cfg.ve_layers)
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
        "h": {"attn": {"c_q": uniform("c_q", (L, C, cfg.n_head * D), -s, s),
                       "c_k": uniform("c_k", (L, C, K * D), -s, s),
                       "c_v": uniform("c_v", (L, C, K * D), -s, s),
                       "c_proj": jnp.zeros((L, C, C)),  # zero-init projections: each block starts as the identity
                       "ve_gate": uniform("ve_gate", (n_ve, VE_GATE_CHANNELS, K), 0.0, 0.02)},
              "mlp": {"c_fc": uniform("c_fc", (L, C, 4 * C), -0.4 * s, 0.4 * s), "c_proj": jnp.zeros((L, 4 * C, C))}},
        "resid_lambdas": 1.15 - 0.10 * ramp,
        "x0_lambdas": 0.20 - 0.15 * ramp,
        "smear_gate": uniform("smear_gate", (SMEAR_CHANNELS, 1), 0.0, 0.02),
        "smear_lambda": jnp.zeros((1,), jnp.float32),  # smear starts off
        "backout_lambda": jnp.full((1,), 0.2, jnp.float32),
    }


def param_groups(params, lr_mult=1.0, momentum=0.95, weight_decay=0.0, unembedding_lr=0.004, embedding_lr=0.2,
                 matrix_lr=0.02, scalar_lr=0.5, muon_dtype="float32"):
    """nanochat's setup_optimizer as data for muon.py: (labels, a pytree like params naming each leaf's group;
    groups, each group's hyper-parameters). lr_mult, momentum and weight_decay are what the schedules change."""
    scale = (params["wte"].shape[1] / 768) ** -0.5  # embeddings and head: lr / sqrt(n_embd / 768)
    adamw = lambda lr, b1, b2, wd: dict(kind="adamw", lr=lr * lr_mult, betas=(b1, b2), eps=1e-10, weight_decay=wd)
    groups = {
        "h": dict(kind="muon", lr=matrix_lr * lr_mult, momentum=momentum, weight_decay=weight_decay, beta2=0.9,
                  dtype=muon_dtype),  # every block matrix, ve_gate included
        "lm_head": adamw(unembedding_lr * scale, 0.8, 0.96, 0.01),
        "wte": adamw(embedding_lr * scale, 0.8, 0.995, 0.001),
        "value_embeds": adamw(embedding_lr * scale * 0.5, 0.8, 0.995, 0.01),
        "resid_lambdas": adamw(scalar_lr * 0.01, 0.8, 0.95, 0.05),
        "x0_lambdas": adamw(scalar_lr, 0.96, 0.95, 0.0),
        "smear": adamw(0.2, 0.8, 0.95, 0.0),  # smear_gate/_lambda, backout_lambda: a fixed lr, no width scaling
    }
    labels = {k: jax.tree.map(lambda _: k if k in groups else "smear", v) for k, v in params.items()}
    return labels, groups

# ------------------------------------------------------------------------------------------------ the model


def rms_norm(x):
    """Parameter-free RMSNorm with fp32 statistics."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS)).astype(x.dtype)


def linear(x, w):
    """x (..., C) @ w (C, D) as one 2-D matmul. The same numbers; on a CPU XLA takes the weight gradient of a 3-D
    x @ w through a transposed copy of the output's gradient, 1.6-2x slower."""
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def rotary(positions, head_dim):
    """cos, sin tables (T, D/2) for absolute positions."""
    inv_freq = 1.0 / ROPE_BASE ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rotary(x, cos, sin):
    """Rotate split halves of x (B, T, H, D) by -theta, nanochat's (checkpoint-compatible) sign."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]  # slices: the gradient of jnp.split is a concatenate, slower on a CPU
    cos, sin = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)


def attention_mask(q_pos, k_pos, window):
    """(Tq, Tk) bool from absolute positions: causal, and at most `window` tokens back (window + 1 keys)."""
    back = q_pos[:, None] - k_pos[None, :]
    return (back >= 0) & (back <= window)


def attend(q, k, v, mask):
    """Softmax attention of q (B, Tq, H, D) over k, v (B, Tk, K, D) under mask (Tq, Tk), the K kv heads serving
    the H query heads (GQA); scores and softmax in fp32. The plain reference."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])


def attend_cpu(q, k, v, mask):
    """attend() shaped for XLA on a CPU, which has no fused attention kernel: heads first, so both matmuls are plain
    batched ones, and no max pass in the softmax. That is only safe with QK-norm: q, k are RMS-normed and scaled by
    1.2, so |score| <= 1.44 sqrt(D) and exp cannot overflow in fp32."""
    B, Tq, H, D = q.shape
    K = k.shape[2]
    q = q.reshape(B, Tq, K, H // K, D).transpose(0, 2, 3, 1, 4)  # (B, K, H/K, Tq, D): query heads by kv head
    k, v = (a.transpose(0, 2, 1, 3)[:, :, None] for a in (k, v))  # (B, K, 1, Tk, D)
    scores = jnp.matmul(q, k.mT, preferred_element_type=jnp.float32) / D**0.5  # (B, K, H/K, Tq, Tk)
    p = jnp.exp(jnp.where(mask, scores, -jnp.inf))  # masked before exp: one (Tq, Tk) array for the backward to keep
    y = jnp.matmul(p.astype(v.dtype), v, preferred_element_type=jnp.float32) / p.sum(-1, keepdims=True)
    return y.astype(v.dtype).transpose(0, 3, 1, 2, 4).reshape(B, Tq, H, D)


def attention_route(impl, backend, dtype, T, head_dim):
    """The route causal_attention takes: `impl` unless "auto"; then cuDNN's fused flash attention on a GPU in bf16,
    the Pallas splash kernel on a TPU (T and head_dim multiples of 128), blocked `attend_cpu` on a CPU, else the plain
    attend(). "xla" is jax.nn.dot_product_attention's own XLA path."""
    if impl != "auto":
        return impl
    if backend == "gpu" and dtype == jnp.bfloat16:
        return "cudnn"
    if backend == "tpu" and T % 128 == 0 and head_dim % 128 == 0:
        return "splash"
    return "cpu" if backend == "cpu" else "plain"


def splash_attention(q, k, v, window):
    """attend() by the splash-attention kernel JAX ships for TPUs (Pallas; interpreted on other backends, for tests):
    one MQA kernel per kv head over the query heads it serves. Under a mesh (jax.set_mesh) each device runs it on its
    own rows: a Pallas call is not partitioned by XLA, so shard_map splits the batch over the mesh's axes."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    B, T, H, D = q.shape
    K, b = k.shape[2], 512 if T % 512 == 0 else 128
    mask = sm.CausalMask((T, T)) if window >= T - 1 else sm.LocalMask((T, T), (window, 0), 0)
    sizes = sk.BlockSizes(*[b] * 8)  # query and key tiles of the forward and backward kernels
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([mask] * (H // K)), block_sizes=sizes,
                                              interpret=jax.default_backend() != "tpu")

    def run(q, k, v):  # the kernel takes unscaled (heads, T, D) queries and (T, D) keys and values
        qg = (q * D**-0.5).reshape(-1, T, K, H // K, D).transpose(0, 2, 3, 1, 4)  # (B, K, H/K, T, D)
        y = jax.vmap(jax.vmap(kernel))(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        return y.transpose(0, 3, 1, 2, 4).reshape(q.shape)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or B % mesh.size:  # no mesh, or rows that do not split: one call (XLA gathers what it needs)
        return run(q, k, v)
    rows = jax.sharding.PartitionSpec(mesh.axis_names)  # data parallel: the batch is split over every axis
    return jax.shard_map(run, in_specs=(rows,) * 3, out_specs=rows, check_vma=False)(q, k, v)


def causal_attention(q, k, v, window, impl="auto", block=None):
    """attend() over positions 0..T-1 (training) by the route `attention_route` picks, all to the same numbers: on a
    CPU, `attend_cpu` on blocks of 128 queries (64 up to T = 128, so that short rows also skip a quarter of their
    scores), each over only the keys from its window's start to its own end (fully masked key blocks are never
    computed); cuDNN or splash attention on accelerators (tested against attend)."""
    route = attention_route(impl, jax.default_backend(), q.dtype, q.shape[1], q.shape[-1])
    if route in ("cudnn", "xla"):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window, 0),
                                            implementation=route)
    if route == "splash":
        return splash_attention(q, k, v, window)
    pos = jnp.arange(q.shape[1])
    if route == "plain":
        return attend(q, k, v, attention_mask(pos, pos, window))
    block = block or (64 if q.shape[1] <= 128 else 128)
    blocks = [(s, s + block, max(0, s - window)) for s in range(0, q.shape[1], block)]
    return jnp.concatenate([attend_cpu(q[:, s:e], k[:, lo:e], v[:, lo:e], attention_mask(pos[s:e], pos[lo:e], window))
                            for s, e, lo in blocks], axis=1)


def smear(x, gate_w, lam, prev=None):
    """x_t += lam * sigmoid(x_t[:24] @ gate_w) * x_{t-1} on the normed embeddings (B, T, C); x_{-1} is `prev`
    (B, C), a KV cache's last token, or zeros at the start: one formula for training, prefill and decode."""
    prev = jnp.zeros_like(x[:, :1]) if prev is None else prev[:, None]
    gate = lam * jax.nn.sigmoid(x[..., :SMEAR_CHANNELS] @ gate_w)  # (B, T, 1)
    return x + gate * jnp.concatenate([prev, x[:, :-1]], axis=1)


def attention(w, x, ve, cos, sin, window, cache=None, pos=0, impl="auto"):
    """Causal self-attention of x (B, T, C), normed, with one layer's weights w -> (y (B, T, C), cache or None).

    Without a cache the tokens sit at positions 0..T-1. With one (k, v: (B, S, K, D)) they sit at `pos`: their k, v
    are written there and the queries attend over every slot, the mask hiding the unwritten ones."""
    B, T, C = x.shape
    D = cos.shape[-1] * 2
    q = linear(x, w["c_q"]).reshape(B, T, -1, D)  # (B, T, H, D)
    k = linear(x, w["c_k"]).reshape(B, T, -1, D)  # (B, T, K, D)
    v = linear(x, w["c_v"]).reshape(B, T, -1, D)
    if ve is not None:  # ResFormer: mix the token's value embedding into v through a gate in (0, 3)
        gate = 3 * jax.nn.sigmoid(x[..., :VE_GATE_CHANNELS] @ w["ve_gate"])  # (B, T, K)
        v = v + gate[..., None] * ve.reshape(v.shape)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q, k = rms_norm(q) * QK_SCALE, rms_norm(k) * QK_SCALE
    if cache is None:
        y = causal_attention(q, k, v, window, impl)
    else:  # in place on the donated cache: one compiled step serves every position
        k, v = cache = tuple(jax.lax.dynamic_update_slice(c, a, (0, pos, 0, 0)) for c, a in zip(cache, (k, v)))
        mask = attention_mask(pos + jnp.arange(T), jnp.arange(k.shape[1]), window)
        y = (attend_cpu if jax.default_backend() == "cpu" else attend)(q, k, v, mask)
    return linear(y.reshape(B, T, C), w["c_proj"]), cache


def block(layer, x, x0, ve, cos, sin, window, cache=None, pos=0, impl="auto"):
    """One transformer layer on the residual stream x (B, T, C); x0: the smeared embeddings; returns (x, cache)."""
    x = layer["resid_lambda"] * x + layer["x0_lambda"] * x0
    y, cache = attention(layer["attn"], rms_norm(x), ve, cos, sin, window, cache, pos, impl)
    x = x + y
    x = x + linear(jnp.square(jax.nn.relu(linear(rms_norm(x), layer["mlp"]["c_fc"]))), layer["mlp"]["c_proj"])  # ReLU^2
    return x, cache


def unstack(params, cfg):
    """The params with the stacked weights split into `layers`, one dict per layer as `block` takes it. Inside jit
    each slice is a copy: nothing next to a training step, 4x a decode step, so `generate` unstacks outside jit."""
    s = jax.tree.map(list, {k: params[k] for k in ("h", "value_embeds", "resid_lambdas", "x0_lambdas")})
    h, layers = s["h"], []  # list(a) slices a stacked array in one op; a[i] for each i would dispatch one op each
    for i in range(cfg.n_layer):
        layer = {"attn": {k: h["attn"][k][i] for k in ("c_q", "c_k", "c_v", "c_proj")},
                 "mlp": {k: w[i] for k, w in h["mlp"].items()},
                 "resid_lambda": s["resid_lambdas"][i], "x0_lambda": s["x0_lambdas"][i]}
        if i in cfg.ve_layers:
            j = cfg.ve_layers.index(i)
            layer["attn"]["ve_gate"], layer["value_embed"] = h["attn"]["ve_gate"][j], s["value_embeds"][j]
        layers.append(layer)
    rest = ("wte", "lm_head", "smear_gate", "smear_lambda", "backout_lambda")
    return {"layers": layers, **{k: params[k] for k in rest}}


def trunk(p, tokens, x, cfg, caches=None, pos=0):
    """The layers, backout and final norm over the smeared embeddings x (B, T, C) of tokens at positions pos..;
    p is unstacked. Returns (final normed hidden states, the per-layer caches or Nones)."""
    cos, sin = rotary(pos + jnp.arange(tokens.shape[1]), cfg.head_dim)
    caches = caches or [None] * cfg.n_layer
    x0, x_backout = x, None
    for i, (layer, window) in enumerate(zip(p["layers"], window_sizes(cfg))):
        ve = layer["value_embed"][tokens] if "value_embed" in layer else None
        x, caches[i] = block(layer, x, x0, ve, cos, sin, window, caches[i], pos, cfg.attention)
        if i == cfg.n_layer // 2:
            x_backout = x
    x = x - p["backout_lambda"] * x_backout  # backout: remove part of the mid-network residual before the head
    return rms_norm(x), caches


def hidden(params, tokens, cfg):
    """The transformer trunk: tokens (B, T) -> final normed hidden states (B, T, C) in the compute dtype."""
    p = unstack(jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params), cfg)
    x = rms_norm(p["wte"][tokens])  # (B, T, C)
    x = smear(x, p["smear_gate"], p["smear_lambda"])
    return trunk(p, tokens, x, cfg)[0]


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
    logits = logits_from_hidden(params, x.reshape(-1, x.shape[-1]), cfg)  # (B*T, V): one 2-D matmul
    t = targets.reshape(-1)
    valid = t >= 0
    picked = jnp.take_along_axis(logits, jnp.where(valid, t, 0)[:, None], axis=-1)[:, 0]
    nll = jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)
    if reduction == "none":
        return nll.reshape(targets.shape)
    return nll.sum() / jnp.maximum(valid.sum(), 1)  # (torch gives nan when every target is ignored)

# ------------------------------------------------------------------------------------------------ inference


def init_cache(cfg, batch, max_len):
    """An empty KV cache: per layer k, v (B, max_len, K, D), the smear's previous embedding (B, C), the position."""
    zeros = lambda: jnp.zeros((batch, max_len, cfg.n_kv_head, cfg.head_dim), cfg.compute_dtype)
    return {"layers": [(zeros(), zeros()) for _ in range(cfg.n_layer)],
            "prev": jnp.zeros((batch, cfg.n_embd), cfg.compute_dtype), "pos": jnp.zeros((), jnp.int32)}


def forward_cached(p, tokens, cache, cfg, length=None):
    """(logits (B, vocab_size) after the last of `length` valid tokens, advanced cache): prefill (T > 1) or decode.

    p: unstacked, in the compute dtype. tokens (B, T) go in at the cache's position. A prompt padded at the end to a
    bucket length writes junk k/v past `length`, which later writes replace before any query can see it.
    """
    length = tokens.shape[1] if length is None else length
    e = rms_norm(p["wte"][tokens])  # (B, T, C) before the smear: the next chunk's smear reads the last one
    x = smear(e, p["smear_gate"], p["smear_lambda"], cache["prev"])
    x, layers = trunk(p, tokens, x, cfg, list(cache["layers"]), cache["pos"])
    last = lambda a: jax.lax.dynamic_index_in_dim(a, length - 1, axis=1, keepdims=False)
    cache = {"layers": layers, "prev": last(e), "pos": cache["pos"] + length}
    return logits_from_hidden(p, last(x), cfg), cache


TOP_K_MAX = 256  # top_k is traced under a static bound: lax.top_k of a fixed size is fast, a full sort is not


def sample(logits, key, temperature, top_k, top_p=1.0):
    """Next ids (B,) from logits (B, V): argmax at temperature 0, else a draw from softmax(logits / temperature) over
    the top_k likeliest (0: all; at most TOP_K_MAX), then over the smallest set of those holding top_p of the
    probability (nucleus sampling, arXiv 1904.09751; taken among the TOP_K_MAX likeliest). All three are traced values:
    a new setting never recompiles."""
    scaled = logits / jnp.maximum(temperature, 1e-6)

    def truncated():
        vals, idx = jax.lax.top_k(scaled, min(TOP_K_MAX, scaled.shape[-1]))  # (B, K), likeliest first
        vals = jnp.where((jnp.arange(vals.shape[-1]) < top_k) | (top_k == 0), vals, -jnp.inf)
        whole = jax.nn.logsumexp(scaled, -1, keepdims=True)  # top_k 0: top_p is a share of the whole distribution
        p = jnp.exp(vals - jnp.where(top_k > 0, jax.nn.logsumexp(vals, -1, keepdims=True), whole))
        vals = jnp.where(jnp.cumsum(p, -1) - p < top_p, vals, -jnp.inf)  # keep while the mass before is under top_p
        return jnp.take_along_axis(idx, jax.random.categorical(key, vals)[:, None], axis=-1)[:, 0]

    full = lambda: jax.random.categorical(key, scaled).astype(jnp.int32)
    picked = jax.lax.cond((top_k > 0) | (top_p < 1), truncated, full)  # one branch runs
    return jnp.where(temperature > 0, picked, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "num_samples"))
def prefill(p, tokens, length, key, settings, cfg, max_len, num_samples=1):
    """One prompt (1, T), the first `length` real, into a fresh cache of max_len copied to num_samples rows: (each
    row's sampled first token (num_samples,), the logits it was drawn from, the cache). p as for forward_cached;
    settings: (temperature, top_k, top_p) for `sample`."""
    logits, cache = forward_cached(p, tokens, init_cache(cfg, 1, max_len), cfg, length)
    cache, logits = jax.tree.map(lambda a: jnp.repeat(a, num_samples, axis=0) if a.ndim else a, (cache, logits))
    return sample(logits, jax.random.fold_in(key, cache["pos"]), *settings), logits, cache


@functools.partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def decode(p, column, cache, key, settings, cfg):
    """Feed one token per row (B,) and sample the next: (ids (B,), logits (B, vocab_size), cache), one dispatch."""
    logits, cache = forward_cached(p, column[:, None], cache, cfg)
    return sample(logits, jax.random.fold_in(key, cache["pos"]), *settings), logits, cache


def _bucket(n):
    return max(16, 1 << (n - 1).bit_length())  # powers of two: a growing chat compiles once per doubling


def generate(params, cfg, prompt_ids, *, max_tokens, key, temperature=1.0, top_k=None, top_p=1.0, num_samples=1,
             stop_ids=(), tool=None, cache_len=None, logits=False):
    """nanochat's Engine.generate: yields (token_column, mask_column), lists of num_samples ints, one per step.

    Prefill at batch 1, then decode all rows together until every row has emitted a stop id, max_tokens, or a full
    context. `tool(row, token)` (e.g. data.calculator_tool(tok), a fresh one per call) sees every emitted token and
    returns ids to force into that row, one per step with mask 0 (nanochat's forced_tokens deque). The KV cache holds
    the bucket of prompt + max_tokens, or cache_len (a server passes cfg.sequence_len: one cache size for all).
    logits=True: also yield the step's logits (num_samples, vocab_size), a device array, third."""
    n, top_k = len(prompt_ids), top_k or 0
    if not 0 < n < cfg.sequence_len:
        raise ValueError(f"the prompt has {n} tokens; it must have 1 to {cfg.sequence_len - 1} (the model's context)")
    if not 0 <= top_k <= TOP_K_MAX:
        raise ValueError(f"top_k is {top_k}; it must be 0 (all tokens) to {TOP_K_MAX}")
    max_tokens = min(max_tokens, cfg.sequence_len - n)
    if max_tokens < 1:
        return
    max_len = cache_len or min(_bucket(n + max_tokens), cfg.sequence_len)
    tokens = np.zeros((1, min(_bucket(n), max_len)), np.int32)  # padded at the end: positions stay true
    tokens[0, :n] = prompt_ids
    p = unstack(jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params), cfg)  # once, not every step
    settings = float(temperature), int(top_k), float(top_p)  # traced: new values (0 after 0.6 too) compile nothing
    sampled, out, cache = prefill(p, tokens, n, key, settings, cfg, max_len, num_samples)
    forced, done, stop_ids = [collections.deque() for _ in range(num_samples)], [False] * num_samples, set(stop_ids)
    for step in range(max_tokens):
        column, masks = [], []
        for row, token in enumerate(np.asarray(sampled).tolist()):  # the one host sync per token
            masks.append(0 if forced[row] else 1)
            column.append(forced[row].popleft() if forced[row] else token)
            done[row] = done[row] or column[-1] in stop_ids
            if tool is not None:
                forced[row].extend(tool(row, column[-1]))
        yield (column, masks, out) if logits else (column, masks)
        if all(done) or step == max_tokens - 1:
            return
        sampled, out, cache = decode(p, np.asarray(column, np.int32), cache, key, settings, cfg)


def param_shapes(cfg):
    """The params pytree of ShapeDtypeStructs, without allocating anything."""
    return jax.eval_shape(init_params, cfg, jax.random.key(0))


def _count(tree):
    return sum(math.prod(a.shape) for a in jax.tree.leaves(tree))


def num_scaling_params(cfg):
    """Parameter counts in nanochat's groups (scaling laws use transformer_matrices + lm_head)."""
    s = param_shapes(cfg)
    groups = {k: _count(s[k]) for k in ("wte", "value_embeds", "lm_head")}
    groups["transformer_matrices"] = _count(s["h"])
    groups["scalars"] = _count([s[k] for k in ("resid_lambdas", "x0_lambdas", "smear_gate", "smear_lambda",
                                               "backout_lambda")])
    groups["total"] = _count(s)
    assert sum(groups.values()) == 2 * groups["total"]
    return groups


def estimate_flops(cfg):
    """Training FLOPs per token (forward + backward), nanochat's estimate_flops: 6 N_matmul + attention."""
    s = param_shapes(cfg)
    matmul = _count(s["h"]) + _count(s["smear_gate"]) + _count(s["lm_head"])
    attn = sum(12 * cfg.n_head * cfg.head_dim * min(w, cfg.sequence_len) for w in window_sizes(cfg))
    return 6 * matmul + attn


def nanochat_names(path, cfg):
    """nanochat's state_dict names of our leaf at `path` (a tuple of keys): one per layer for a stacked leaf."""
    if path[0] == "h":
        layers = cfg.ve_layers if path[-1] == "ve_gate" else range(cfg.n_layer)
        return [f"transformer.h.{i}.{path[1]}.{path[2]}.weight" for i in layers]
    if path[0] == "value_embeds":
        return [f"value_embeds.{i}.weight" for i in cfg.ve_layers]
    return [{"wte": "transformer.wte.weight", "lm_head": "lm_head.weight", "smear_gate": "smear_gate.weight"}.get(
        path[0], path[0])]


STACKED, TRANSPOSED = ("h", "value_embeds"), ("h", "lm_head", "smear_gate")  # by top-level key; embeddings are (V, C)


def to_nanochat_state_dict(params, cfg):
    """Our params -> nanochat's state_dict as float32 numpy arrays in PyTorch's (out, in) layout."""
    out = {}
    for keys, w in jax.tree_util.tree_leaves_with_path(params):
        path, w = tuple(k.key for k in keys), np.asarray(w, np.float32)
        for name, a in zip(nanochat_names(path, cfg), w if path[0] in STACKED else [w]):
            out[name] = a.T if path[0] in TRANSPOSED else a
    return out


def from_nanochat_state_dict(state_dict, cfg):
    """nanochat's state_dict (numpy arrays, any float dtype) -> our params; exact inverse of the above."""
    sd = {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}  # torch.compile'd checkpoints
    shapes = param_shapes(cfg)
    names = {n for keys, _ in jax.tree_util.tree_leaves_with_path(shapes)
             for n in nanochat_names(tuple(k.key for k in keys), cfg)}
    missing, unexpected = sorted(names - set(sd)), sorted(set(sd) - names)
    if missing or unexpected:
        raise ValueError(f"state_dict does not match {cfg}: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                         "pass the Config the checkpoint was trained with")

    def leaf(keys, want):
        path = tuple(k.key for k in keys)
        rows = [np.asarray(sd[n], np.float32) for n in nanochat_names(path, cfg)]
        rows = [a.T for a in rows] if path[0] in TRANSPOSED else rows
        a = np.stack(rows) if path[0] in STACKED else rows[0]
        if a.shape != want.shape:
            raise ValueError(f"{'.'.join(path)} has shape {a.shape}, expected {want.shape} for {cfg}")
        return jnp.asarray(a)
    return jax.tree_util.tree_map_with_path(leaf, shapes)
