"""Backend fast paths: nanochat.py's numbers, faster on one kind of machine (as nanochat's
flash_attention.py picks FlashAttention-3 or PyTorch's SDPA for its model).

The model calls one attention function, `attn`, with the signature of the plain
`nanochat.causal_attention(q, k, v, window, pos=None)`. `attention_fn(route)` returns the function
for a route; "auto" picks one per call from the backend, the dtype and the shapes, at trace time:
- "cudnn" (a GPU in bf16): cuDNN's fused flash attention, through jax.nn.dot_product_attention
  with is_causal and a local window.
- "splash" (a TPU, T and head_dim multiples of 128): the splash-attention Pallas kernel JAX ships,
  one MQA kernel per kv head for GQA, the sliding window as its local mask. XLA does not
  partition a Pallas call, so under a mesh `shard_map` runs it on each device's own rows.
- "cpu": XLA on a CPU has no fused attention, so heads go first (both matmuls are plain batched
  ones) and the softmax has no max pass, which QK-norm makes safe: q and k are RMS-normed and
  scaled by 1.2, so |score| <= 1.44 sqrt(D) and exp cannot overflow in fp32. Queries go in blocks
  of 128 (64 up to T = 128), each over only the keys from its window's start to its own end, so
  fully masked key blocks are never computed.
- "xla": dot_product_attention's own XLA path; "plain": nanochat.causal_attention itself.
A query chunk over a KV cache (prefill and decode: pos given) takes `attend_cache_cpu` on a CPU,
the same softmax over the cache as it is stored (heads first: no copy of it), and the plain
attention elsewhere. Every route is tested against the plain attention, values and
gradients, with windows and GQA (splash through Pallas's interpreter).

`init_params` compiles the init cheaply (runtime.py sets up the process itself for speed).
"""

import functools

import jax
import jax.numpy as jnp

import nanochat as nc

ROUTES = ("auto", "cudnn", "splash", "cpu", "xla", "plain")


def route(name, backend, dtype, T, head_dim):
    """The route `name` stands for: itself unless "auto"; then cuDNN on a GPU in bf16, splash on a
    TPU when T and head_dim are multiples of 128, "cpu" on a CPU, else the plain attention."""
    if name != "auto":
        return name
    if backend == "gpu" and dtype == jnp.bfloat16:
        return "cudnn"
    if backend == "tpu" and T % 128 == 0 and head_dim % 128 == 0:
        return "splash"
    return "cpu" if backend == "cpu" else "plain"


def attend_cpu(q, k, v, mask):
    """nanochat.attend shaped for XLA on a CPU: heads first, no max pass (see the header)."""
    B, Tq, H, D = q.shape
    K = k.shape[2]
    q = q.reshape(B, Tq, K, H // K, D).transpose(0, 2, 3, 1, 4)  # (B, K, H/K, Tq, D)
    k, v = (a.transpose(0, 2, 1, 3)[:, :, None] for a in (k, v))  # (B, K, 1, Tk, D)
    scores = jnp.matmul(q, k.mT, preferred_element_type=jnp.float32) / D**0.5  # (B, K, H/K, Tq, Tk)
    p = jnp.exp(jnp.where(mask, scores, -jnp.inf))  # masked before exp: one array for the backward
    y = jnp.matmul(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    y = y / p.sum(-1, keepdims=True)
    return y.astype(v.dtype).transpose(0, 3, 1, 2, 4).reshape(B, Tq, H, D)


def attend_cache_cpu(q, k, v, mask):
    """Queries q (B, Tq, H, D) over a KV cache's k, v (B, K, S, D) under mask (B, Tq, S), as
    attend_cpu (no max pass) but on the cache as it lies: XLA's dots then read each head's keys
    in place, where a transposed copy of the whole cache would cost more than the math."""
    B, Tq, H, D = q.shape
    K = k.shape[1]
    q = q.reshape(B, Tq, K, H // K, D)
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k, preferred_element_type=jnp.float32) / D**0.5
    p = jnp.exp(jnp.where(mask[:, None, None], scores, -jnp.inf))  # (B, K, H/K, Tq, S)
    y = jnp.einsum("bkgts,bksd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    y = y / jnp.moveaxis(p.sum(-1), -1, 1)[..., None]
    return y.astype(v.dtype).reshape(B, Tq, H, D)


def blocked_attention(q, k, v, window, block=None):
    """Causal attention over positions 0..T-1 by `attend_cpu` on query blocks, each over only the
    keys its window reaches."""
    T = q.shape[1]
    block = block or (64 if T <= 128 else 128)
    pos, out = jnp.arange(T), []
    for s in range(0, T, block):
        e, lo = s + block, max(0, s - window)
        mask = nc.attention_mask(pos[s:e], pos[lo:e], window)
        out.append(attend_cpu(q[:, s:e], k[:, lo:e], v[:, lo:e], mask))
    return jnp.concatenate(out, axis=1)


def splash_attention(q, k, v, window):
    """Causal attention over positions 0..T-1 by the splash-attention kernel (Pallas; interpreted
    off a TPU, for tests): one MQA kernel per kv head over the query heads it serves."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    B, T, H, D = q.shape
    K, b = k.shape[2], 512 if T % 512 == 0 else 128
    mask = sm.CausalMask((T, T)) if window >= T - 1 else sm.LocalMask((T, T), (window, 0), 0)
    sizes = sk.BlockSizes(*[b] * 8)  # query and key tiles of the forward and backward kernels
    kernel = sk.make_splash_mqa_single_device(sm.MultiHeadMask([mask] * (H // K)),
                                              block_sizes=sizes,
                                              interpret=jax.default_backend() != "tpu")

    def run(q, k, v):  # the kernel takes unscaled (heads, T, D) queries and (T, D) keys, values
        qg = (q * D**-0.5).reshape(-1, T, K, H // K, D).transpose(0, 2, 3, 1, 4)  # (B,K,H/K,T,D)
        y = jax.vmap(jax.vmap(kernel))(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        return y.transpose(0, 3, 1, 2, 4).reshape(q.shape)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or B % mesh.size:  # no mesh, or rows that do not split: one call
        return run(q, k, v)
    rows = jax.sharding.PartitionSpec(mesh.axis_names)  # data parallel: batch over every axis
    return jax.shard_map(run, in_specs=(rows,) * 3, out_specs=rows, check_vma=False)(q, k, v)


def attention_fn(route="auto"):
    """The model's `attn` for a route of ROUTES (see the header)."""
    if route not in ROUTES:
        raise ValueError(f"attention route {route!r} must be one of {ROUTES}")
    return _route_attention(route)


@functools.cache  # one function per route: jit sees the same static argument every time
def _route_attention(name):
    def attn(q, k, v, window, pos=None):
        backend = jax.default_backend()
        if pos is not None:  # a query chunk over a KV cache, each row at its own position
            if backend != "cpu":
                return nc.causal_attention(q, k, v, window, pos)
            q_pos = nc.query_positions(pos, q.shape[1])
            mask = nc.attention_mask(q_pos, jnp.arange(k.shape[2]), window)
            return attend_cache_cpu(q, k, v, mask)
        picked = route(name, backend, q.dtype, q.shape[1], q.shape[-1])
        if picked in ("cudnn", "xla"):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                local_window_size=(window, 0),
                                                implementation=picked)
        if picked == "splash":
            return splash_attention(q, k, v, window)
        if picked == "cpu":
            return blocked_attention(q, k, v, window)
        return nc.causal_attention(q, k, v, window)
    return attn

# ---------------------------------------------------------------------------------- the init


def init_params(cfg, key):
    """nanochat.init_params compiled at LLVM's -O1: it runs once, so a cheaper compile pays, and
    the bits are the same."""
    return _compiled_init(cfg)(key)


@functools.cache  # one compile a config, whatever the key
def _compiled_init(cfg):
    lowered = nc.init_params.lower(cfg, jax.random.key(0))
    return lowered.compile({"xla_backend_optimization_level": 1})
