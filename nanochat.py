"""nanochat's GPT as pure JAX functions over a plain dict of arrays, with its KV-cache
forward: the same logits, loss and gradients as karpathy/nanochat's `gpt.py` for the
same weights.

Read `init_params` (the weights and their names), `param_groups` (how the optimizer
treats each leaf), then `block`: one layer over one layer's weights, shared by training,
prefill and decode. Attention is one function argument, `attn` (default: the plain
`causal_attention`); kernels.py gives faster ones of the same signature, so the model
never names a backend. Under remat the layers run as a scan over groups that repeat
(`scan_layers`: one group compiled and recomputed at a time), and the loss computes its
logits a chunk of rows at a time (`chunked_nll`; training in bf16, `nll_sum`, which takes
the gradients from each chunk's logits as it makes them). `forward_cached` feeds tokens through a
KV cache (exact, or int8: `init_cache`) whose rows each sit at their own position;
engine.py generates. docs/model.md lists nanochat's architecture choices, each with the
function that makes it.

Weights are (in, out), `x @ W`. Dimensions: B batch, T time (S cache slots), C n_embd, H
n_head, K n_kv_head, D head_dim, V vocab.
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
# the smear gate reads this many channels of the current token
SMEAR_CHANNELS = 24
# the value-embedding gate reads this many channels of the block input
VE_GATE_CHANNELS = 12
# the loss computes at most this many logits at a time: 256 MiB in fp32
LOGITS_PER_CHUNK = 2**26
# F.rms_norm's default eps for fp32
EPS = float(np.finfo(np.float32).eps)
# every layer's attention matrices (ve_gate is only some layers')
ATTENTION_MATRICES = ("c_q", "c_k", "c_v", "c_proj")
# the params stacked over the layers (the value-embedding stacks over the ve_layers)
STACKED = ("h", "value_embeds", "resid_lambdas", "x0_lambdas")
# nanochat's scalar parameters
SCALARS = ("resid_lambdas", "x0_lambdas", "smear_gate", "smear_lambda", "backout_lambda")


@dataclasses.dataclass(frozen=True)
class Config:
    """nanochat's GPTConfig (the same field names), plus the compute dtype of the
    forward pass."""
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "SSSL"
    compute_dtype: str = "float32"  # or "bfloat16": bf16 matmuls, fp32 master weights

    def __post_init__(self):
        C = self.n_embd
        H = self.n_head
        K = self.n_kv_head
        pattern = self.window_pattern
        if C % H or (C // H) % 2:
            raise ValueError(f"n_embd {C} must split into n_head {H} heads of even size")
        if H % K:
            raise ValueError(f"n_head {H} must be a multiple of n_kv_head {K}")
        if not pattern or set(pattern.upper()) - set("SL"):
            raise ValueError(f"window_pattern {pattern!r} must be a string of S and L")
        if C < SMEAR_CHANNELS:
            raise ValueError(f"n_embd must be at least {SMEAR_CHANNELS} (the smear gate)")

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def padded_vocab(self):
        return -(-self.vocab_size // 64) * 64

    @property
    def ve_layers(self):
        """Layers with a value embedding: alternating, the last layer always included."""
        last = self.n_layer - 1
        return [i for i in range(self.n_layer) if i % 2 == last % 2]


def config_for_depth(depth, vocab_size, aspect_ratio=64, head_dim=128, **kwargs):
    """nanochat's --depth dial: width = depth * aspect_ratio, rounded up to whole
    heads."""
    model_dim = -(-depth * aspect_ratio // head_dim) * head_dim
    n_head = model_dim // head_dim
    return Config(vocab_size=vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_head,
                  n_embd=model_dim, **kwargs)


def window_sizes(cfg):
    """Each layer's attention window in tokens back from the query (T or more: causal)."""
    # a short window: a quarter of the context, rounded up to FA3's tiles of 128
    short = -(-cfg.sequence_len // 4 // 128) * 128
    pattern = cfg.window_pattern.upper()
    sizes = []
    for i in range(cfg.n_layer):
        # the pattern repeats over the layers; the last layer is always long
        is_short = pattern[i % len(pattern)] == "S" and i < cfg.n_layer - 1
        sizes.append(short if is_short else cfg.sequence_len)
    return sizes


@functools.partial(jax.jit, static_argnames="cfg")
def init_params(cfg, key):
    """nanochat's init_weights; every parameter is drawn from its own key, derived from
    its name. The weights of a kind are stacked over the layers (over the
    value-embedding layers for `value_embeds` and `ve_gate`), so that Muon steps each
    stack in one call."""
    C = cfg.n_embd
    L = cfg.n_layer
    V = cfg.padded_vocab
    H = cfg.n_head
    K = cfg.n_kv_head
    D = cfg.head_dim
    n_ve = len(cfg.ve_layers)
    s = 3**0.5 / C**0.5  # U(-s, s) has std 1 / sqrt(C)

    def uniform(name, shape, lo, hi):
        k = jax.random.fold_in(key, zlib.crc32(name.encode()))
        return jax.random.uniform(k, shape, jnp.float32, lo, hi)

    def normal(name, shape, std):
        k = jax.random.fold_in(key, zlib.crc32(name.encode()))
        return std * jax.random.normal(k, shape, jnp.float32)

    # the per-layer scalars ramp linearly from the first layer to the last
    ramp = jnp.arange(L, dtype=jnp.float32) / max(L - 1, 1)
    attn = {
        "c_q": uniform("c_q", (L, C, H * D), -s, s),
        "c_k": uniform("c_k", (L, C, K * D), -s, s),
        "c_v": uniform("c_v", (L, C, K * D), -s, s),
        # zero projections: every block starts as the identity
        "c_proj": jnp.zeros((L, C, C)),
        "ve_gate": uniform("ve_gate", (n_ve, VE_GATE_CHANNELS, K), 0.0, 0.02),
    }
    mlp = {
        "c_fc": uniform("c_fc", (L, C, 4 * C), -0.4 * s, 0.4 * s),
        "c_proj": jnp.zeros((L, 4 * C, C)),
    }
    # the embeddings are stored in the compute dtype, as nanochat stores them: a row is
    # looked up, never multiplied, and the optimizer tolerates the rounding
    embedding_dtype = cfg.compute_dtype
    return {
        "wte": normal("wte", (V, C), 0.8).astype(embedding_dtype),
        "value_embeds": uniform("value_embeds", (n_ve, V, K * D), -s, s).astype(embedding_dtype),
        "lm_head": normal("lm_head", (C, V), 0.001),
        "h": {"attn": attn, "mlp": mlp},
        "resid_lambdas": 1.15 - 0.10 * ramp,
        "x0_lambdas": 0.20 - 0.15 * ramp,
        "smear_gate": uniform("smear_gate", (SMEAR_CHANNELS, 1), 0.0, 0.02),
        "smear_lambda": jnp.zeros((1,), jnp.float32),  # the smear starts off
        "backout_lambda": jnp.full((1,), 0.2, jnp.float32),
    }


def param_groups(params, lr_mult=1.0, momentum=0.95, weight_decay=0.0, unembedding_lr=0.004,
                 embedding_lr=0.2, matrix_lr=0.02, scalar_lr=0.5, muon_dtype="float32"):
    """nanochat's setup_optimizer as data for muon.py: (labels, a pytree like params
    naming each leaf's group; groups, each group's hyper-parameters). The schedules
    change lr_mult, momentum and weight_decay."""
    # the defaults are nanochat's setup_optimizer's; its base_train passes other learning rates
    # (train.Optim's)
    # embeddings and head: lr / sqrt(n_embd / 768)
    scale = (params["wte"].shape[1] / 768) ** -0.5

    def adamw(lr, beta1, beta2, wd):
        return dict(kind="adamw", lr=lr * lr_mult, betas=(beta1, beta2), eps=1e-10,
                    weight_decay=wd)

    groups = {
        "h": dict(kind="muon", lr=matrix_lr * lr_mult, momentum=momentum,
                  weight_decay=weight_decay, beta2=0.9, dtype=muon_dtype),  # every block matrix
        "lm_head": adamw(unembedding_lr * scale, 0.8, 0.96, 0.01),
        "wte": adamw(embedding_lr * scale, 0.8, 0.995, 0.001),
        "value_embeds": adamw(embedding_lr * scale * 0.5, 0.8, 0.995, 0.01),
        "resid_lambdas": adamw(scalar_lr * 0.01, 0.8, 0.95, 0.05),
        "x0_lambdas": adamw(scalar_lr, 0.96, 0.95, 0.0),
        "smear": adamw(0.2, 0.8, 0.95, 0.0),  # smear and backout scalars: fixed lr, not scaled
    }
    # each leaf is labelled with its top-level name's group; smear and backout share one
    labels = {}
    for name, tree in params.items():
        group = name if name in groups else "smear"
        labels[name] = jax.tree.map(lambda _, group=group: group, tree)
    return labels, groups

# ---------------------------------------------------------------------------- the model


def rms_norm(x):
    """Parameter-free RMSNorm with fp32 statistics."""
    x32 = x.astype(jnp.float32)
    mean_square = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(mean_square + EPS)).astype(x.dtype)


def linear(x, w):
    """x (..., C) @ w (C, D) as one 2-D matmul: the same numbers, and XLA then takes the
    weight gradient without a transposed copy of the output's gradient."""
    y = x.reshape(-1, x.shape[-1]) @ w
    return y.reshape(*x.shape[:-1], w.shape[-1])


def rotary(positions, head_dim):
    """RoPE's tables `rope` = (cos, sin), each (..., T, D/2), for absolute positions
    (T,), or (B, T): one row each."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / ROPE_BASE**exponents
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rotary(x, rope):
    """Rotate the split halves of x (..., D) by -theta, the sign of nanochat's
    checkpoints; rope: rotary's (cos, sin), shaped to broadcast against x's halves."""
    cos, sin = (table.astype(x.dtype) for table in rope)
    D = x.shape[-1]
    d = D // 2
    # (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin) = x * (cos, cos) + (x2, x1) * (sin, -sin)
    cos = jnp.concatenate([cos, cos], axis=-1)
    sin = jnp.concatenate([sin, -sin], axis=-1)
    # (x2, x1) as a matmul by a permutation, exact (a product by 1 each): a matrix unit
    # takes it faster than a vector unit moves half-width lanes
    swap = jnp.eye(D, dtype=x.dtype)[:, (jnp.arange(D) + d) % D]
    swapped = jnp.dot(x, swap, precision=jax.lax.Precision.HIGHEST)
    return x * cos + swapped * sin


def attention_mask(q_pos, k_pos, window):
    """(..., Tq, Tk) bool from absolute positions q_pos (..., Tq) and k_pos (Tk,), or
    (B, Tk) a row each (< 0: a ring's slot that holds none yet): causal, at most
    `window` tokens back (window + 1 keys). Training, prefill and decode share it:
    is_causal=True is wrong when Tq and Tk differ."""
    k_pos = k_pos[..., None, :]
    back = q_pos[..., :, None] - k_pos
    return (back >= 0) & (back <= window) & (k_pos >= 0)


def attend(q, k, v, mask):
    """Softmax attention of q (B, Tq, H, D) over k, v (B, Tk, K, D) under mask (Tq, Tk),
    or (B, Tq, Tk) with a row each; the K kv heads serve the H query heads (GQA);
    scores and softmax in fp32."""
    # (1 or B, 1, Tq, Tk): every head alike
    mask = mask.reshape((-1, 1) + mask.shape[-2:])
    return jax.nn.dot_product_attention(q, k, v, mask=mask)


def query_positions(pos, T):
    """The absolute positions of T tokens fed at pos: (T,) for a scalar pos, (B, T) for
    one position per row (rows of a KV cache at different lengths)."""
    return jnp.asarray(pos)[..., None] + jnp.arange(T)


def causal_attention(q, k, v, window, pos=None, k_pos=None):
    """The model's attention, `attn`: queries at positions pos, pos + 1, ... over keys
    at k_pos (None: 0, 1, ...), causal within `window`. pos None: training, q and k the
    same positions 0..T-1; pos (B,): each row its own, k and v a KV cache's (B, K, S,
    D), k_pos (B, S) where a ring cache holds them (ring_positions); or lists of such
    parts and their k_pos, attended as one (a decode chunk's: `forward_cached`)."""
    if isinstance(k, list):
        k, v, k_pos = joined(k, v, k_pos)
    if pos is not None:  # a cache is stored heads first
        k = k.swapaxes(1, 2)
        v = v.swapaxes(1, 2)
    q_pos = query_positions(0 if pos is None else pos, q.shape[1])
    if k_pos is None:
        k_pos = jnp.arange(k.shape[1])
    mask = attention_mask(q_pos, k_pos, window)
    return attend(q, k, v, mask)


def joined(keys, values, k_pos):
    """A cache's parts (lists of (B, K, S_i, D) and their k_pos, each (S_i,), (B, S_i) or
    None) as one cache: (k, v, k_pos (B, S))."""
    B = keys[0].shape[0]
    k_pos = [jnp.broadcast_to(jnp.arange(k.shape[2]) if p is None else p, (B, k.shape[2]))
             for k, p in zip(keys, k_pos)]
    return (jnp.concatenate(keys, axis=2), jnp.concatenate(values, axis=2),
            jnp.concatenate(k_pos, axis=1))


def smear(x, gate_w, lam, prev=None):
    """x_t += lam * sigmoid(x_t[:24] @ gate_w) * x_{t-1} on the normed embeddings (B, T,
    C); x_{-1} is `prev` (B, C), a KV cache's last token, or zeros: one formula for
    training, prefill and decode."""
    if prev is None:
        prev = jnp.zeros_like(x[:, :1])
    else:
        prev = prev[:, None]
    gate = lam * jax.nn.sigmoid(x[..., :SMEAR_CHANNELS] @ gate_w)  # (B, T, 1)
    before = jnp.concatenate([prev, x[:, :-1]], axis=1)  # each token's predecessor
    return x + gate * before


def write_rows(cache, new, pos):
    """cache (B, K, S, D) with each row's new (B, T, K, D) written at that row's pos
    (B,), moved back to fit as dynamic_update_slice moves it; in place on a donated
    cache. (An int8 cache's scales: (B, K, S) and (B, T, K), no D.)"""
    B, K, S, *vector = cache.shape
    T = new.shape[1]
    # the cache as a table of B * K * S vectors of D, written in one scatter of whole
    # vectors (a vmapped dynamic_update_slice would be a loop over the rows)
    table = cache.reshape(B * K * S, *vector)
    start = jnp.clip(pos, 0, S - T)  # (B,)
    head = jnp.arange(B)[:, None] * K + jnp.arange(K)  # (B, K): each row's heads
    index = head[:, :, None] * S + start[:, None, None] + jnp.arange(T)  # (B, K, T)
    vectors = new.swapaxes(1, 2).reshape(B * K * T, *vector)
    table = table.at[index.reshape(-1)].set(vectors, unique_indices=True,
                                            mode="promise_in_bounds")
    return table.reshape(cache.shape)


def quantize(x):
    """int8 values and one scale per vector of x (..., D), in x's dtype: (q, scale (...)),
    x close to q * scale[..., None] (each value within half a scale)."""
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / 127
    q = jnp.round(x / jnp.maximum(scale, 1e-30)[..., None]).astype(jnp.int8)
    return q, scale.astype(x.dtype)


def write_kv(entry, new, pos):
    """write_rows into one layer's k or v: an array, or an int8 cache's (values,
    scales), new quantized per token and head."""
    if isinstance(entry, tuple):
        return tuple(write_rows(a, b, pos) for a, b in zip(entry, quantize(new)))
    return write_rows(entry, new, pos)


def write_step(own, new, step, steps_first):
    """A decode chunk's own k or v with the step's new (B, 1, K, D) at `step`: with
    steps_first (attn.steps_first: kernels.py says where) a step a slab, (kmax, K, B, D),
    else a row's tokens in its row, (B, K, kmax, D); an int8 cache's (values, scales),
    the scales without D."""
    if isinstance(own, tuple):  # the values and their scales
        values, scales = quantize(new)
        return (write_step(own[0], values, step, steps_first),
                write_step(own[1], scales, step, steps_first))
    if steps_first:  # the step's slab: (K, B, D)
        return own.at[step].set(new[:, 0].swapaxes(0, 1).astype(own.dtype))
    new = new.swapaxes(1, 2).astype(own.dtype)  # each row's token: (B, K, 1, D)
    return jax.lax.dynamic_update_slice_in_dim(own, new, step, axis=2)


def by_rows(own, steps_first):
    """A decode chunk's own k or v (write_step's) as a cache's rows: (B, K, kmax, D)."""
    return jax.tree.map(lambda a: a.swapaxes(0, 2), own) if steps_first else own


def read_kv(entry, attn):
    """One layer's k or v as attn reads it: an int8 cache's values times their scales,
    in the scales' dtype (the compute dtype); or, to an attn that reads a cache as it
    is stored (`attn.reads_stored`: kernels.attend_cache), the (values, scales)."""
    if isinstance(entry, tuple) and not getattr(attn, "reads_stored", False):
        q, scale = entry
        return q.astype(scale.dtype) * scale[..., None]
    return entry


def kv_shape(entry):
    """(B, K, S, D) of one layer's k or v: an array, an int8 cache's (values, scales),
    or a decode chunk's pages, rings or rows read in place (kernels.Pages)."""
    return (entry[0] if isinstance(entry, tuple) else entry).shape


def attention(w, x, ve, rope, *, window, attn, cache=None, pos=0, ring=None):
    """Causal self-attention of x (B, T, C), normed, with one layer's attention weights
    w: (y, cache or None). ve: the tokens' value embeddings (B, T, K*D), or None.

    Without a cache the tokens sit at positions 0..T-1. With one (k, v: (B, K, S, D),
    or int8 ones: init_cache) row b's tokens sit at pos[b]: their k and v are written
    there, and the queries attend over every slot, the mask hiding the slots not written
    yet. ring: the cache is a sliding window's ring of that many slots (ring_size), one
    token written a call, at its position modulo the ring. A decode chunk's cache (k,
    v, (step, start, chunk's k, v)) (`forward_cached`) is only read, as it stood at each
    row's start (a ring of its own length, the window at least); the token's k and v go
    into the chunk's own (write_step) at the step, returned in the cache's place."""
    B, T, C = x.shape
    D = rope[0].shape[-1] * 2
    # heads first where attn takes them so (attn.heads_first: a kernel's layout), projected
    # straight into it: no transposed copies of q, k, v and y
    heads_first = cache is None and getattr(attn, "heads_first", False)
    # 1. queries (B, T, H, D), keys and values (B, T, K, D); heads first (B, H, T, D)
    q, k, v = (project_heads(x, w[name], D, heads_first) for name in ("c_q", "c_k", "c_v"))
    # 2. ResFormer: the token's value embedding mixed into v, gated in (0, 3)
    if ve is not None:
        gate = 3 * jax.nn.sigmoid(x[..., :VE_GATE_CHANNELS] @ w["ve_gate"])  # (B, T, K)
        ve = gate[..., None] * ve.reshape(B, T, -1, D)
        v = v + (ve.swapaxes(1, 2) if heads_first else ve)
    # 3. RoPE (tables (T, D/2), or (B, T, D/2): one for every head), then QK-norm
    if not heads_first:
        rope = tuple(table[..., None, :] for table in rope)
    q = apply_rotary(q, rope)
    k = apply_rotary(k, rope)
    q = rms_norm(q) * QK_SCALE
    k = rms_norm(k) * QK_SCALE
    # 4. attend over this chunk, or write k, v into the cache and attend over it (in
    # place on a donated cache: one compiled step serves every position)
    if cache is None:
        y = attn(q, k, v, window)
    elif len(cache) == 3:  # a decode chunk's: the token into the chunk's own k, v
        step, start, own = cache[2]
        steps_first = getattr(attn, "steps_first", False)
        own = (write_step(own[0], k, step, steps_first),
               write_step(own[1], v, step, steps_first))
        own_k, own_v = by_rows(own, steps_first)
        keys = [read_kv(cache[0], attn), read_kv(own_k, attn)]
        values = [read_kv(cache[1], attn), read_kv(own_v, attn)]
        # the positions each part holds: the cache as it stood at each row's start (a
        # ring's latest positions, or those before the start), then the chunk's own
        S, kmax = kv_shape(keys[0])[2], kv_shape(keys[1])[2]
        if ring is not None:  # (a chunk's ring may hold the window only: S slots)
            held = ring_positions(start - 1, S)
        else:
            held = jnp.where(jnp.arange(S) < start[:, None], jnp.arange(S), -1)
        y = attn(q, keys, values, window, pos, [held, start[:, None] + jnp.arange(kmax)])
        cache = own
    else:
        at = pos if ring is None else pos % ring
        cache = (write_kv(cache[0], k, at), write_kv(cache[1], v, at))
        keys, values = read_kv(cache[0], attn), read_kv(cache[1], attn)
        k_pos = None if ring is None else ring_positions(pos, ring)
        y = attn(q, keys, values, window, pos, k_pos)
    if heads_first:
        return jnp.einsum("bhtd,hdc->btc", y, w["c_proj"].reshape(-1, D, C)), cache
    return linear(y.reshape(B, T, C), w["c_proj"]), cache


def project_heads(x, w, D, heads_first):
    """x (B, T, C) @ w (C, N*D) as N heads of D: (B, T, N, D), or (B, N, T, D) heads
    first."""
    if heads_first:
        return jnp.einsum("btc,cnd->bntd", x, w.reshape(w.shape[0], -1, D))
    return linear(x, w).reshape(*x.shape[:2], -1, D)


def block(layer, x, x0, ve, rope, *, window, attn=causal_attention, cache=None, pos=0,
          ring=None):
    """One transformer layer on the residual stream x (B, T, C): (x, cache). layer: one
    layer's weights (`unstack`); x0: the smeared embeddings; ve, cache, ring: as
    `attention`'s."""
    # 1. nanochat's per-layer mix of the stream and the embeddings
    x = layer["resid_lambdas"] * x + layer["x0_lambdas"] * x0
    # 2. attention
    y, cache = attention(layer["attn"], rms_norm(x), ve, rope,
                         window=window, attn=attn, cache=cache, pos=pos, ring=ring)
    x = x + y
    # 3. the MLP, ReLU^2
    h = linear(rms_norm(x), layer["mlp"]["c_fc"])
    h = jnp.square(jax.nn.relu(h))
    return x + linear(h, layer["mlp"]["c_proj"]), cache


def unstack(params, cfg):
    """The params with the stacked weights sliced into `layers`: layer i's dict is the
    stored tree at index i under the same names (attn, mlp, resid_lambdas, x0_lambdas;
    on a value-embedding layer also value_embeds and attn's ve_gate). Inside jit each
    slice is a copy, small beside a training step but large beside a decode step, so
    `generate` unstacks once, outside jit."""
    # 1. each stack split in one op, whose gradient is one concatenate (slices' would be
    # a full-size pad each)
    def slices(a):
        return [x.reshape(a.shape[1:]) for x in jnp.split(a, len(a))]
    sliced = jax.tree.map(slices, {name: params[name] for name in STACKED})
    # 2. layer i's slices; the value-embedding stacks hold only the ve_layers
    layers = []
    for i in range(cfg.n_layer):
        attn = {name: sliced["h"]["attn"][name][i] for name in ATTENTION_MATRICES}
        mlp = {name: w[i] for name, w in sliced["h"]["mlp"].items()}
        layer = {"attn": attn,
                 "mlp": mlp,
                 "resid_lambdas": sliced["resid_lambdas"][i],
                 "x0_lambdas": sliced["x0_lambdas"][i]}
        if i in cfg.ve_layers:
            j = cfg.ve_layers.index(i)
            attn["ve_gate"] = sliced["h"]["attn"]["ve_gate"][j]
            layer["value_embeds"] = sliced["value_embeds"][j]
        layers.append(layer)
    # (a scanned group's weights hold none of the rest)
    rest = ("wte", "lm_head", "smear_gate", "smear_lambda", "backout_lambda")
    return {"layers": layers, **{name: params[name] for name in rest if name in params}}


def layer_period(cfg):
    """The layers after which the windows and the value embeddings repeat, when the
    layers fall into whole groups of them (training then scans over the groups), else
    0."""
    period = math.lcm(len(cfg.window_pattern), 2)
    if cfg.n_layer % period:
        return 0
    group = dataclasses.replace(cfg, n_layer=period)
    windows = window_sizes(group)
    for i, window in enumerate(window_sizes(cfg)):
        same_ve = (i in cfg.ve_layers) == (i % period in group.ve_layers)
        if window != windows[i % period] or not same_ve:
            return 0
    return period


def scan_layers(params, tokens, x, cfg, period, *, attn, remat=False):
    """trunk's layers without a cache, as a lax.scan over groups of `period` layers:
    XLA compiles one group, not every layer, and under remat each step of the backward
    scan recomputes its own group only (in an unrolled stack XLA may schedule every
    layer's recomputation at once). params: stacked, in the compute dtype. Returns
    (x, x_backout): the last layer's output and the middle one's."""
    L = cfg.n_layer
    n_groups = L // period
    group_cfg = dataclasses.replace(cfg, n_layer=period)
    windows = window_sizes(group_cfg)
    rope = rotary(query_positions(0, tokens.shape[1]), cfg.head_dim)

    # 1. each stack as (groups, a group's layers or value-embedding layers, ...)
    def by_group(a):
        return a.reshape(n_groups, -1, *a.shape[1:])
    groups = jax.tree.map(by_group, {name: params[name] for name in STACKED})
    middle_group, middle_layer = divmod(L // 2, period)
    x0 = x

    # 2. one group: its layers in turn; the middle layer's output kept for the backout
    def group(carry, group_weights):
        x, x_backout = carry
        weights, g = group_weights
        layered = unstack(weights, group_cfg)
        for j, (layer, window) in enumerate(zip(layered["layers"], windows)):
            layer_fn = functools.partial(block, window=window, attn=attn)
            if remat:
                layer_fn = jax.checkpoint(layer_fn)
            ve = layer["value_embeds"][tokens] if "value_embeds" in layer else None
            x, _ = layer_fn(layer, x, x0, ve, rope)
            if j == middle_layer:
                x_backout = jnp.where(g == middle_group, x, x_backout)
        return (x, x_backout), None
    carry = (x, jnp.zeros_like(x))
    (x, x_backout), _ = jax.lax.scan(group, carry, (groups, jnp.arange(n_groups)))
    return x, x_backout


def trunk(layered, tokens, x, cfg, *, attn, caches=None, pos=0, remat=False, rings=False,
          chunk=None):
    """The layers, backout and final norm over the smeared embeddings x (B, T, C) of
    tokens at positions pos, pos + 1, ...; layered is unstacked. Returns (normed hidden
    states, layer caches: with a chunk, the chunk's own k, v). remat: the backward pass
    recomputes each block's activations instead of keeping them. rings: the caches are
    init_cache's with rings. chunk: forward_cached's."""
    rope = rotary(query_positions(pos, tokens.shape[1]), cfg.head_dim)
    caches = caches or [None] * cfg.n_layer
    x0 = x
    x_backout = None
    for i, (layer, window) in enumerate(zip(layered["layers"], window_sizes(cfg))):
        ring = ring_size(window, cfg.sequence_len) if rings else None
        layer_fn = functools.partial(block, window=window, attn=attn, ring=ring)
        if remat:
            layer_fn = jax.checkpoint(layer_fn)
        ve = layer["value_embeds"][tokens] if "value_embeds" in layer else None
        if chunk is not None:  # the layer's cache, read only, and the chunk's own k, v
            caches[i] = (*caches[i], (chunk["step"], chunk["start"], chunk["layers"][i]))
        x, caches[i] = layer_fn(layer, x, x0, ve, rope, cache=caches[i], pos=pos)
        if i == cfg.n_layer // 2:
            x_backout = x
    return backout(x, x_backout, layered["backout_lambda"]), caches


def backout(x, x_backout, backout_lambda):
    """The final normed hidden states: part of the mid-network residual removed."""
    return rms_norm(x - backout_lambda * x_backout)


def hidden(params, tokens, cfg, attn=causal_attention, remat=False):
    """The transformer trunk: tokens (B, T) -> final normed hidden states (B, T, C)."""
    # the weights in the compute dtype
    cast = jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params)
    x = rms_norm(cast["wte"][tokens])  # (B, T, C)
    x = smear(x, cast["smear_gate"], cast["smear_lambda"])
    # with remat, the layers scanned in groups where they repeat (else one by one: XLA
    # schedules an unrolled stack faster, but would compute every recomputation at once)
    period = layer_period(cfg) if remat else 0
    if period:
        x, x_backout = scan_layers(cast, tokens, x, cfg, period, attn=attn, remat=remat)
        return backout(x, x_backout, cast["backout_lambda"])
    x, _ = trunk(unstack(cast, cfg), tokens, x, cfg, attn=attn, remat=remat)
    return x


def logits_from_hidden(params, x, cfg):
    """Softcapped fp32 logits (..., vocab_size) from hidden states (..., C): the matmul in
    the compute dtype, as under nanochat's autocast (XLA may fold the cast to fp32 into the
    matmul, whose fp32 sums then come out unrounded: in a small jit, not in the step)."""
    w = params["lm_head"][:, :cfg.vocab_size].astype(x.dtype)
    logits = jnp.dot(x, w).astype(jnp.float32)
    return SOFTCAP * jnp.tanh(logits / SOFTCAP)


def forward(params, tokens, cfg, attn=causal_attention):
    """Logits (B, T, vocab_size), float32, softcapped."""
    return logits_from_hidden(params, hidden(params, tokens, cfg, attn), cfg)


def token_nll(params, x, targets, cfg):
    """-log p of each target (N,) from hidden states x (N, C); 0 where a target is < 0."""
    logits = logits_from_hidden(params, x, cfg)
    valid = targets >= 0
    # each target's logit (an ignored target reads index 0, then counts 0)
    safe = jnp.where(valid, targets, 0)
    picked = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    return jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)


def row_chunks(x, targets, cfg, chunk=None):
    """Rows x (N, C) and their targets (N,) as n equal chunks, (n, rows, C) and (n,
    rows), the last padded with ignored targets; chunk: rows a chunk at most (None: as
    many as hold LOGITS_PER_CHUNK logits)."""
    N = x.shape[0]
    chunk = chunk or max(1, LOGITS_PER_CHUNK // cfg.vocab_size)
    n = -(-N // chunk)
    rows = -(-N // n)
    x = jnp.pad(x, ((0, n * rows - N), (0, 0)))
    targets = jnp.pad(targets, (0, n * rows - N), constant_values=-1)
    return x.reshape(n, rows, -1), targets.reshape(n, rows)


def chunked_nll(params, x, targets, cfg, chunk=None):
    """token_nll over rows x (N, C) a chunk of rows at a time (row_chunks), each
    chunk's logits computed again in the backward pass: the (N, V) logits never exist
    whole."""
    chunks = row_chunks(x, targets, cfg, chunk)
    if len(chunks[0]) == 1:  # one chunk: the plain loss
        return token_nll(params, x, targets, cfg)
    # jax.checkpoint: the backward keeps each chunk's inputs only, not its logits
    one_chunk = jax.checkpoint(functools.partial(token_nll, cfg=cfg))

    def step(_, chunk_rows):
        return None, one_chunk(params, *chunk_rows)
    _, nll = jax.lax.scan(step, None, chunks)
    return nll.reshape(-1)[:x.shape[0]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def nll_sum(lm_head, x, targets, cfg, chunk=None):
    """The sum of token_nll over rows x (N, C), chunked as chunked_nll; its gradient
    (the training loss's) is computed with it, chunk by chunk, so that no logits are
    computed twice."""
    return chunked_nll({"lm_head": lm_head}, x, targets, cfg, chunk).sum()


def nll_sum_and_grads(lm_head, x, targets, cfg, chunk):
    """nll_sum and, from each chunk's logits as they are made, its gradients with
    respect to lm_head and x: (sum, (d lm_head, dx))."""
    N, C = x.shape
    V = cfg.vocab_size
    w = lm_head[:, :V].astype(x.dtype)

    def step(d_head, chunk_rows):
        x, targets = chunk_rows
        logits = logits_from_hidden({"lm_head": w}, x, cfg)  # (rows, V)
        # the targets' one-hot (an ignored target's row all False) picks each target's logit
        # by a masked sum, which XLA folds into logsumexp's pass over the logits (a gather,
        # as in token_nll, would have the fp32 logits written out for it)
        hit = jnp.arange(V) == targets[:, None]
        valid = targets >= 0
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
        nll = jnp.where(valid, log_z - picked, 0.0)
        # d nll / d logits: the softmax less the target's one-hot, through the cap's tanh
        softmax = jnp.exp(logits - log_z[:, None])
        d = softmax - hit
        d = d * (1 - (logits / SOFTCAP) ** 2)
        d = jnp.where(valid[:, None], d, 0).astype(x.dtype)
        # the gradients of the chunk's matmul
        dx = jnp.dot(d, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
        d_head += jnp.dot(x.T, d, preferred_element_type=jnp.float32)
        return d_head, (nll.sum(), dx)
    d_head = jnp.zeros((C, V), jnp.float32)
    chunks = row_chunks(x, targets, cfg, chunk)
    d_head, (sums, dx) = jax.lax.scan(step, d_head, chunks)
    # lm_head's padded columns take no gradient
    d_head = jnp.pad(d_head, ((0, 0), (0, lm_head.shape[1] - V)))
    dx = dx.reshape(-1, C)[:N]
    return sums.sum(), (d_head.astype(lm_head.dtype), dx)


def nll_sum_backward(cfg, chunk, grads, g):
    """nll_sum's gradients scaled by the cotangent g (targets take none)."""
    d_head, dx = grads
    d_head = (g * d_head).astype(d_head.dtype)
    dx = (g * dx).astype(dx.dtype)
    return d_head, dx, None


nll_sum.defvjp(nll_sum_and_grads, nll_sum_backward)


def loss_fn(params, tokens, targets, cfg, reduction="mean", attn=causal_attention, remat=False,
            chunk=None):
    """Cross-entropy, ignoring targets < 0: the mean over valid targets, or (B, T) with
    'none'. chunk: row_chunks' rows of logits at a time."""
    x = hidden(params, tokens, cfg, attn, remat)
    x = x.reshape(-1, x.shape[-1])
    rows = targets.reshape(-1)
    head = {"lm_head": params["lm_head"]}  # (the scan over chunks closes over this alone)
    if reduction == "none":
        return chunked_nll(head, x, rows, cfg, chunk).reshape(targets.shape)
    # in bf16 the gradients come with the logits (nll_sum: 3 matmuls a chunk, not 4); fp32
    # keeps autodiff's, and so its rounding: the same losses as always
    if jnp.dtype(cfg.compute_dtype) == jnp.float32:
        total = chunked_nll(head, x, rows, cfg, chunk).sum()
    else:
        total = nll_sum(params["lm_head"], x, rows, cfg, chunk)
    # at least 1: torch gives nan when every target is ignored
    return total / jnp.maximum((targets >= 0).sum(), 1)

# ---------------------------------------------------------------------------- inference


def ring_size(window, context):
    """The slots a sliding-window layer's ring cache holds: the window and the token
    written, rounded up to 16; None where that is the whole context (no ring)."""
    ring = -(-(window + 1) // 16) * 16
    return ring if ring < context else None


def ring_positions(pos, ring):
    """The position each slot of a ring holds (B, ring) once each row's token at pos
    (B,) is written: the latest p <= pos with p % ring the slot (< 0: none yet)."""
    slots = jnp.arange(ring)
    return pos[:, None] - (pos[:, None] - slots) % ring


def init_cache(cfg, batch, max_len, kv_dtype=None, rings=False):
    """An empty KV cache: per layer k, v (B, K, S, D), heads first so that a decode step
    reads each head's keys as one block (kv_dtype "int8": each an int8 (B, K, S, D) and
    its scales (B, K, S), one per token and head); the smear's last embedding (B, C);
    each row's position (B,), the number of tokens it holds. Zeros, never uninitialized
    memory: a masked slot still enters the softmax's weighted sum, and 0 * NaN is NaN.
    rings: each sliding-window layer holds a ring of ring_size slots, not max_len (a
    decode cache, one token a call: forward_cached's rings)."""
    layers = []
    for window in window_sizes(cfg):
        ring = ring_size(window, cfg.sequence_len) if rings else None
        length = ring or max_len
        layers.append((empty_kv(cfg, batch, length, kv_dtype),
                       empty_kv(cfg, batch, length, kv_dtype)))  # k, v
    return {"layers": layers,
            "prev": jnp.zeros((batch, cfg.n_embd), cfg.compute_dtype),
            "pos": jnp.zeros((batch,), jnp.int32)}


def empty_kv(cfg, batch, length, kv_dtype=None):
    """One layer's k or v, zeros: (batch, K, length, D) in the compute dtype, or for an
    int8 cache the values and their scales (batch, K, length)."""
    shape = (batch, cfg.n_kv_head, length, cfg.head_dim)
    if kv_dtype == "int8":
        return jnp.zeros(shape, jnp.int8), jnp.zeros(shape[:-1], cfg.compute_dtype)
    return jnp.zeros(shape, cfg.compute_dtype)


def forward_cached(layered, tokens, cache, cfg, attn, length=None, rings=False):
    """(logits (B, vocab_size) after the last of `length` valid tokens, one for all rows
    or (B,) a row each; the advanced cache): prefill (T > 1) or decode. layered:
    unstacked, in the compute dtype; tokens (B, T) go in at each row's position. A
    prompt padded at the end to a bucket writes junk k, v past its length, which later
    writes replace before any query can see them. rings: the cache is init_cache's with
    rings, and tokens one a row (T = 1).

    A decode chunk (engine.py) reads its cache without writing it: cache["chunk"] holds
    step, the call's index within the chunk; start (B,), each row's position at the
    chunk's start; and layers, per layer the chunk's own k, v (write_step's), empty
    entries like init_cache's. The tokens' k and v go there at the step, and the
    returned cache's chunk carries them."""
    if rings and tokens.shape[1] != 1:
        raise ValueError(f"a cache with rings takes one token a row, not {tokens.shape[1]}")
    length = tokens.shape[1] if length is None else length
    # 1. the embeddings, smeared with the cache's last one (e, before the smear, is what
    # the next chunk's smear reads)
    e = rms_norm(layered["wte"][tokens])  # (B, T, C)
    x = smear(e, layered["smear_gate"], layered["smear_lambda"], cache["prev"])
    # 2. the layers, each writing its keys and values at each row's position
    chunk = cache.get("chunk")
    x, layers = trunk(layered, tokens, x, cfg, attn=attn, caches=list(cache["layers"]),
                      pos=cache["pos"], rings=rings, chunk=chunk)

    # 3. the logits after each row's last valid token, and the advanced cache
    lengths = jnp.broadcast_to(length, tokens.shape[:1])

    def last(a):
        return jnp.take_along_axis(a, lengths[:, None, None] - 1, axis=1)[:, 0]
    advanced = {"layers": layers, "prev": last(e), "pos": cache["pos"] + lengths}
    if chunk is not None:  # the cache as it was, the chunk's own k, v advanced
        advanced["layers"] = cache["layers"]
        advanced["chunk"] = {**chunk, "layers": layers}
    return logits_from_hidden(layered, last(x), cfg), advanced

# ----------------------------------------------------------------------------- counting


def param_shapes(cfg):
    """The params pytree as ShapeDtypeStructs, without allocating anything."""
    return jax.eval_shape(init_params, cfg, jax.random.key(0))


def count(tree):
    """The number of elements in a pytree of arrays or shapes."""
    return sum(math.prod(a.shape) for a in jax.tree.leaves(tree))


def num_scaling_params(cfg):
    """Parameter counts in nanochat's groups (scaling laws use transformer_matrices +
    lm_head)."""
    shapes = param_shapes(cfg)
    groups = {k: count(shapes[k]) for k in ("wte", "value_embeds", "lm_head")}
    groups["transformer_matrices"] = count(shapes["h"])
    scalars = [shapes[name] for name in SCALARS]
    groups["scalars"] = count(scalars)
    groups["total"] = count(shapes)
    assert sum(groups.values()) == 2 * groups["total"]
    return groups


def estimate_flops(cfg):
    """Training FLOPs per token (forward + backward), nanochat's estimate_flops: 6
    N_matmul + attention."""
    shapes = param_shapes(cfg)
    matmul = count(shapes["h"]) + count(shapes["smear_gate"]) + count(shapes["lm_head"])
    # attention: 12 FLOPs per query channel and key in reach, forward and backward
    reach = [min(w, cfg.sequence_len) for w in window_sizes(cfg)]
    attn = sum(12 * cfg.n_head * cfg.head_dim * r for r in reach)
    return 6 * matmul + attn
