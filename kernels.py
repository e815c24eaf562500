"""Backend fast paths: nanochat.py's numbers, faster on one kind of machine (as
nanochat's flash_attention.py picks FlashAttention-3 or PyTorch's SDPA for its model).

The model calls one attention function, `attn`, with the signature of the plain
`nanochat.causal_attention(q, k, v, window, pos=None, k_pos=None)`; where
`attn.heads_first`, a whole sequence comes heads first, (B, H, T, D), as the splash
kernel takes it. `attention_fn(route)` returns the one for a route of ROUTES, "auto"
picking at trace time by backend, dtype, shapes:
- "cudnn" (a GPU in bf16): cuDNN's fused flash attention (jax.nn.dot_product_attention).
- "splash" (a TPU): the splash-attention Pallas kernel; `shard_map` under a mesh.
- "cpu": heads first and no max pass (QK-norm bounds |score| by 1.44 sqrt(D), so exp
  cannot overflow in fp32), each query block over only the keys its window reaches.
- "xla", "plain": dot_product_attention's XLA path, nanochat.causal_attention itself.
A query chunk over a KV cache takes `attend_cache` on every backend. Every route is tested
against the plain attention; docs/performance.md says why each exists and what it saves.
On a TPU a decode step reads a paged layer's pages and a window's ring in place (an exact
ring from 16 rows; an int8 cache's rows too), each row's only as far as it holds tokens
(`attend_pages`, a Pallas kernel), and a decode chunk's tokens go into the cache by whole
tiles (`write_windows`); elsewhere the pages are gathered and the tokens scattered
(`write_tokens`). Both kernels are jitted: a program's layers of one shape share one trace and
lowering of each. `init_params` compiles the init cheaply.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import nanochat as nc

ROUTES = ("auto", "cudnn", "splash", "cpu", "xla", "plain")


def resolve_route(name, backend, dtype, T, head_dim):
    """The route `name` stands for: itself unless "auto"; then cuDNN on a GPU in bf16,
    splash on a TPU when T and head_dim are multiples of 128, "cpu" on a CPU, else the
    plain attention."""
    if name != "auto":
        return name
    if backend == "gpu" and dtype == jnp.bfloat16:
        return "cudnn"
    if backend == "tpu" and T % 128 == 0 and head_dim % 128 == 0:
        return "splash"
    return "cpu" if backend == "cpu" else "plain"


def attend_cpu(q, k, v, mask):
    """nanochat.attend shaped for XLA on a CPU: heads first, no max pass (see the
    header)."""
    B, Tq, H, D = q.shape
    K = k.shape[2]
    # 1. heads first, so that both matmuls are plain batched ones
    q = q.reshape(B, Tq, K, H // K, D)
    q = q.transpose(0, 2, 3, 1, 4)  # (B, K, H/K, Tq, D)
    k = k.transpose(0, 2, 1, 3)[:, :, None]  # (B, K, 1, Tk, D)
    v = v.transpose(0, 2, 1, 3)[:, :, None]
    # 2. the softmax without its max pass, masked before exp: one array for the backward
    scores = jnp.matmul(q, k.mT, preferred_element_type=jnp.float32)
    scores = scores / D**0.5  # (B, K, H/K, Tq, Tk)
    p = jnp.exp(jnp.where(mask, scores, -jnp.inf))
    # 3. the weighted values, normalized, back to (B, Tq, H, D)
    y = jnp.matmul(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    y = y / p.sum(-1, keepdims=True)
    y = y.astype(v.dtype).transpose(0, 3, 1, 2, 4)
    return y.reshape(B, Tq, H, D)


def attend_cache(q, keys, values, masks, first=None):
    """Queries q (B, Tq, H, D) over a KV cache's parts, keys and values lists of (B, K,
    S_i, D) under masks (B, Tq, S_i), as one softmax over every part's keys (a decode
    chunk's: the cache and the chunk's own tokens), without a max pass (see the
    header). The cache is read as it lies: XLA's dots then read each head's keys in
    place, where a transposed copy, or the parts joined, would cost more than the
    math. A part may be `Pages` (a decode step's, one query a row, the earliest
    position each sees first (B,)): attend_pages reads it; or an int8 cache's (values,
    scales (B, K, S_i)): the dots read the int8 values, and the scales multiply the
    scores and the weights, S_i along their lanes."""
    B, Tq, H, D = q.shape
    K = nc.kv_shape(keys[0])[1]
    q = q.reshape(B, Tq, K, H // K, D)
    # each part's weighted values (B, Tq, K, H/K, D) and weights' sum, unnormalized
    y = sums = 0
    for k, v, mask in zip(keys, values, masks):
        if isinstance(k, Pages):
            num, den = attend_pages(q[:, 0], k, v, first)
            num, den = num[:, None], den[:, None]
        else:
            k, k_scale = split_scales(k)
            v, v_scale = split_scales(v)
            scores = jnp.einsum("btkgd,bksd->bkgts", q, k.astype(q.dtype),
                                preferred_element_type=jnp.float32) * k_scale
            p = jnp.exp(jnp.where(mask[:, None, None], scores / D**0.5, -jnp.inf))
            den = jnp.moveaxis(p.sum(-1), -1, 1)  # (B, Tq, K, H/K)
            num = jnp.einsum("bkgts,bksd->btkgd", (p * v_scale).astype(q.dtype),
                             v.astype(q.dtype), preferred_element_type=jnp.float32)
        y, sums = y + num, sums + den
    y = y / sums[..., None]
    return y.astype(q.dtype).reshape(B, Tq, H, D)


def split_scales(part):
    """A cache part's values and the scales that multiply its scores (B, K, H/K, Tq, S):
    an int8 part's (B, K, S) along the scores' lanes; an exact part's 1."""
    if isinstance(part, tuple):
        values, scales = part
        return values, scales[:, :, None, None, :]
    return part, 1


def blocked_attention(q, k, v, window, block=None):
    """Causal attention over positions 0..T-1 by `attend_cpu` on query blocks, each over
    only the keys its window reaches."""
    T = q.shape[1]
    block = block or (64 if T <= 128 else 128)
    pos = jnp.arange(T)
    out = []
    for start in range(0, T, block):
        end = start + block
        first = max(0, start - window)  # the first key the block's window reaches
        mask = nc.attention_mask(pos[start:end], pos[first:end], window)
        keys = k[:, first:end]
        values = v[:, first:end]
        out.append(attend_cpu(q[:, start:end], keys, values, mask))
    return jnp.concatenate(out, axis=1)


def splash_attention(q, k, v, window):
    """Causal attention over positions 0..T-1 by the splash-attention kernel (Pallas;
    interpreted off a TPU, for tests), heads first as the kernel takes them: q (B, H, T,
    D), k and v (B, K, T, D). One MQA kernel per kv head over the query heads it serves."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk, splash_attention_mask as sm)
    B, H, T, D = q.shape
    K = k.shape[1]
    causal = window >= T - 1
    # tiles of 512 (1024 for a causal mask: 0.5% faster at d12 on a v5e)
    tile = 512 if T % 512 == 0 else 128
    if causal and T % 1024 == 0:
        tile = 1024
    # 1. one kernel for the H/K query heads of a kv head: causal, or a local window
    mask = sm.CausalMask((T, T)) if causal else sm.LocalMask((T, T), (window, 0), 0)
    heads = sm.MultiHeadMask([mask] * (H // K))
    # the forward and backward kernels' tiles; one backward kernel for dq, dk and dv
    compute = min(tile, 512)
    sizes = sk.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=compute,
                          block_q_dkv=tile, block_kv_dkv=tile, block_kv_dkv_compute=compute,
                          use_fused_bwd_kernel=True)
    interpret = jax.default_backend() != "tpu"
    kernel = sk.make_splash_mqa_single_device(heads,
                                              block_sizes=sizes,
                                              interpret=interpret)

    # 2. the kernel takes unscaled queries, a kv head's (H/K, T, D) over its (T, D)
    def run(q, k, v):
        grouped = (q * D**-0.5).reshape(-1, K, H // K, T, D)
        return jax.vmap(jax.vmap(kernel))(grouped, k, v).reshape(q.shape)
    # 3. one call, or under a mesh one per device's rows (XLA does not split Pallas)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or B % mesh.size:  # no mesh, or rows that do not split
        return run(q, k, v)
    # data parallel: the batch split over every axis
    rows = jax.sharding.PartitionSpec(mesh.axis_names)
    per_device = jax.shard_map(run, in_specs=(rows,) * 3, out_specs=rows,
                               check_vma=False)
    return per_device(q, k, v)


def attention_fn(route="auto"):
    """The model's `attn` for a route of ROUTES (see the header)."""
    if route not in ROUTES:
        raise ValueError(f"attention route {route!r} must be one of {ROUTES}")
    return _route_attention(route)


@functools.cache  # one function per route: jit sees the same static argument every time
def _route_attention(name):
    def attn(q, k, v, window, pos=None, k_pos=None):
        backend = jax.default_backend()
        # a query chunk over a KV cache, each row at its own position; a decode chunk's
        # in parts
        if pos is not None:
            if not isinstance(k, list):
                k, v, k_pos = [k], [v], [k_pos]
            q_pos = nc.query_positions(pos, q.shape[1])
            masks = [nc.attention_mask(q_pos, p if p is not None else
                                       jnp.arange(nc.kv_shape(a)[2]), window)
                     for a, p in zip(k, k_pos)]
            return attend_cache(q, k, v, masks, first=q_pos[..., 0] - window)
        # a whole sequence: the route's attention. Heads first where attn.heads_first says
        # so (the model then projects q, k, v into it): splash's layout; the others take
        # (B, T, H, D)
        T = q.shape[2 if attn.heads_first else 1]
        picked = resolve_route(name, backend, q.dtype, T, q.shape[-1])
        swap = (picked == "splash") != attn.heads_first  # the layouts differ
        if swap:
            q, k, v = (a.swapaxes(1, 2) for a in (q, k, v))
        y = sequence_attention(picked, q, k, v, window)
        return y.swapaxes(1, 2) if swap else y
    # heads first where the route is the splash kernel's: "splash", or "auto" on a TPU
    attn.heads_first = name == "splash" or (name == "auto" and jax.default_backend() == "tpu")
    attn.reads_stored = True  # attend_cache reads Pages in place, int8 values and scales
    # a decode chunk's own k, v a step a slab (nc.write_step) on a TPU, where a token a row
    # written along the rows' tiles rewrote every tile (0.44 ms of a 128-row d20 step, v5e);
    # elsewhere in rows, which a CPU's dots read without a transposed copy
    attn.steps_first = jax.default_backend() == "tpu"
    return attn


def sequence_attention(route, q, k, v, window):
    """Causal attention over positions 0..T-1 by a resolved route: q (B, T, H, D), k and
    v (B, T, K, D), heads first (B, H, T, D) for "splash"."""
    if route in ("cudnn", "xla"):
        return jax.nn.dot_product_attention(q, k, v,
                                            is_causal=True,
                                            local_window_size=(window, 0),
                                            implementation=route)
    if route == "splash":
        return splash_attention(q, k, v, window)
    if route == "cpu":
        return blocked_attention(q, k, v, window)
    return nc.causal_attention(q, k, v, window)


# ---------------------------------------------------- a decode chunk's pages, read in place


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
    """A layer's k or v as a decode step reads it in place (`attend_pages`): a pool of pages
    (pages, K, page, D) through the rows' page tables (B, n), or with table None the rows'
    rings (at least B, K, S, D), position p at slot p modulo S; count (B,), the tokens each
    row holds from position 0 (a ring the last S of them); an int8 cache's scales as the
    kernel reads them (`block_scales`), else None. Its shape is the gathered array's, (B, K,
    n * page or S, D)."""
    pool: jax.Array
    table: jax.Array | None
    count: jax.Array
    scales: jax.Array | None = None

    @property
    def shape(self):
        if self.table is None:  # (a chunk's first rows of the rings)
            _, K, S, D = self.pool.shape
            return (self.count.shape[0], K, S, D)
        B, n = self.table.shape
        _, K, page, D = self.pool.shape
        return (B, K, n * page, D)

    @property
    def dtype(self):
        return self.pool.dtype


BLOCK = 16  # copy units a block of attend_pages reads of exact caches: 512 tokens (2% over 8, v5e)
INT8_BLOCK = 32  # an int8 cache's: blocks of up to 1,024 tokens read 1.2-1.7x as fast as 8 (v5e)


def copy_unit(S, table):
    """The tokens attend_pages copies at once: a page (S / n, table (B, n)), or of a ring of S
    slots (table None) an int8 tile's rows where they divide it."""
    return S // table.shape[1] if table is not None else math.gcd(S, INT8_TILE_ROWS)


def block_of(S, table, dtype):
    """The copy units a block of attend_pages reads of a row's S slots (copy_unit): BLOCK,
    an int8 cache's INT8_BLOCK, at most the row's."""
    block = INT8_BLOCK if jnp.dtype(dtype).itemsize == 1 else BLOCK
    return min(block, S // copy_unit(S, table))


def block_scales(scales, span):
    """An int8 cache's scales (B, K, L), a row's tokens along lanes, as attend_pages reads
    them: a block's (B, blocks, K, span), the tokens padded with zeros to whole blocks."""
    B, K, L = scales.shape
    scales = jnp.pad(scales, ((0, 0), (0, 0), (0, -L % span)))
    return scales.reshape(B, K, -1, span).swapaxes(1, 2)


# jitted: a decode program's layers of one shape share one trace and one Mosaic lowering,
# seconds each on a TPU's host
@functools.partial(jax.jit, static_argnames="block")
def attend_pages(q, keys, values, first=None, block=None):
    """Queries q (B, K, G, D), one a row, over the tokens of Pages keys and values (one table
    and count) that each row's query sees, positions first[b] (None: 0) to count[b] - 1: (num
    (B, K, G, D), den (B, K, G)) in fp32, the sums of w v and of w, w = exp(q.k / sqrt D) (no
    max: see the header). A Pallas kernel over the rows in turn reads `block` pages at a time
    (None: block_of's) of a row's pages or ring, those it holds, the next block's copies in
    flight while it computes one (a row's first while the last row finishes); an int8 block
    widened in VMEM (`int8_block_sums`). Off a TPU interpreted (tests)."""
    B, K, G, D = q.shape
    S = keys.shape[2]  # a row's slots
    page = copy_unit(S, keys.table)
    block = block or block_of(S, keys.table, keys.dtype)
    span = block * page  # a block's tokens
    ring = keys.table is None

    def kernel(table, held, newest, reach, q, *refs):
        *scales, k_pool, v_pool, num_out, den_out, k_buf, v_buf, sems, turn = refs
        r = pl.program_id(0)

        def copies(row, b, slot, start):  # block b of a row's slots into buffer slot
            pools = ((k_pool, k_buf, sems.at[0, slot]), (v_pool, v_buf, sems.at[1, slot]))
            block_copies(pools, slot, b, row, start, table=table, held=held, page=page,
                         block=block, pages=S // page, ring=ring)

        def blocks(row):  # at least one: a row holding nothing takes its zeros from one
            return jnp.maximum(1, (held[row] + span - 1) // span)

        @pl.when(r == 0)
        def _():
            turn[0] = 0
            copies(0, 0, 0, True)

        def body(b, sums):
            slot = turn[0]
            # 1. the next block's copies in flight: this row's next, or the next row's first
            last = b + 1 == blocks(r)
            after = jnp.where(last, r + 1, r)

            @pl.when(after < B)
            def _():
                copies(after, jnp.where(last, 0, b + 1), 1 - slot, True)
            copies(r, b, slot, False)
            # 2. the block's sums, added to the row's, over the slots whose token the query
            # sees (an int8 block's tokens along lanes, an exact one's along sublanes)
            shape = (8, span) if scales else (span, D)
            seen = seen_slots(b * span, shape, 1 if scales else 0, (held, newest, reach), r,
                              S, ring=ring)
            if scales:
                sums = int8_block_sums(q, k_buf, v_buf, slot, seen, sums,
                                       [s.at[0, b] for s in scales])
            else:
                sums = block_sums(q, k_buf, v_buf, slot, seen, sums)
            turn[0] = 1 - slot
            return sums

        zeros = [(jnp.zeros((8, D), jnp.float32),) * 2] * (K * G)
        sums = jax.lax.fori_loop(0, blocks(r), body, zeros)
        store_sums(sums, num_out, den_out)
    num, den = pages_call(kernel, row_scalars(keys, first), q, keys, values, span)
    return num, den[..., 0]


def row_scalars(pages, first):
    """attend_pages' scalars of each row (B,), for SMEM: its page table (a ring's: zeros);
    the slots that hold its tokens, the first `held` (a ring's S once full); the slot of its
    newest token; and `reach`: a token at most that much older than the newest is one its
    query sees (first (B,) its earliest position, None: 0)."""
    B, _, S, _ = pages.shape
    table = jnp.zeros((B, 1), jnp.int32) if pages.table is None else pages.table
    held = jnp.minimum(pages.count, S)
    newest = jnp.maximum(pages.count - 1, 0) % S
    reach = pages.count - 1 - (0 if first is None else first)
    return table, held, newest, reach


def block_copies(pools, slot, b, row, start, *, table, held, page, block, pages, ring):
    """attend_pages' copies of a row's block b, its `block` pages of `pages` (of a ring, its
    slots from b * block * page), k's and v's, into buffer `slot`: pools, (pool, buffer,
    semaphore) k's and v's. Started, or else waited for; none past the slots the row holds
    (held)."""
    for j in range(block):
        at = b * block + j
        clamped = jnp.minimum(at, pages - 1)
        for pool, buf, sem in pools:
            if ring:
                source = pool.at[row, :, pl.ds(clamped * page, page)]
            else:
                source = pool.at[table[row, clamped]]
            copy = pltpu.make_async_copy(source, buf.at[slot, :, pl.ds(j * page, page)], sem)

            @pl.when(at * page < held[row])
            def _():
                copy.start() if start else copy.wait()


def seen_slots(first, shape, axis, scalars, r, S, *, ring):
    """Which of a block's slots, first, first + 1, ... along `axis` of `shape`, hold a token
    row r's query sees: of scalars (held, newest, reach), those the row holds (not an
    earlier block's left in the buffer); of a ring, those at most reach[r] tokens older
    than the newest (at slot newest[r])."""
    held, newest, reach = scalars
    slot = first + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    seen = slot < held[r]
    if ring:
        age = newest[r] - slot
        age = jnp.where(age < 0, age + S, age)  # across the ring's end
        seen &= age <= reach[r]
    return seen


def pages_call(kernel, scalars, q, keys, values, span):
    """attend_pages' kernel over the rows in turn, a grid step a row: the scalars
    (row_scalars) prefetched into SMEM, the row's q and an int8 cache's scales (block_scales)
    in, its num and den (1, K, G, D) out, the Pages' pools or rings left in HBM for the
    kernel's copies into two buffers of `span` tokens."""
    B, K, G, D = q.shape
    scales = () if keys.scales is None else (keys.scales, values.scales)

    def per_row(r, *_):
        return (r, 0, 0, 0)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, K, G, D), jnp.float32),) * 2,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(B,),
            in_specs=[pl.BlockSpec((1, K, G, D), per_row),
                      *(pl.BlockSpec((1, *s.shape[1:]), per_row) for s in scales),
                      pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[pl.BlockSpec((1, K, G, D), per_row)] * 2,
            scratch_shapes=[pltpu.VMEM((2, K, span, D), keys.pool.dtype),
                            pltpu.VMEM((2, K, span, D), values.pool.dtype),
                            pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.SMEM((1,), jnp.int32)]),
        # the rows in turn: a row's copies start in the one before
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=jax.default_backend() != "tpu",
    )(*scalars, q, *scales, keys.pool, values.pool)


def store_sums(sums, num_out, den_out):
    """attend_pages' sums for a row (block_sums'), each summed over its 8 rows, into the
    row's outputs num_out and den_out (1, K, G, D)."""
    _, K, G, _ = num_out.shape
    for h in range(K):
        for g in range(G):
            num, den = sums[h * G + g]
            num_out[0, h, pl.ds(g, 1)] = num.sum(0, keepdims=True)
            den_out[0, h, pl.ds(g, 1)] = den.sum(0, keepdims=True)


def block_sums(q, k_buf, v_buf, slot, seen, sums):
    """attend_pages' sums (a list of (num, den), (8, D) each, per head and query head)
    with one block's: q (1, K, G, D), the block in buffer `slot` of k_buf and v_buf (2,
    K, span, D), seen (span, D) the tokens the query sees. Each head's weights come out
    broadcast over lanes: every column of the scores' product is the same (the query in
    every row of its right side)."""
    _, K, G, D = q.shape
    span = k_buf.shape[2]
    # an fp32 cache's scores in fp32 (Mosaic's default rounds them to bf16), as XLA's at
    # the highest precision
    exact = jax.lax.Precision.HIGHEST if k_buf.dtype == jnp.float32 else None
    out = []
    for h in range(K):
        keys = k_buf[slot, h]  # (span, D)
        values = v_buf[slot, h].astype(jnp.float32)
        for g in range(G):
            num, den = sums[h * G + g]
            query = jnp.broadcast_to(q[0, h, pl.ds(g, 1)], (D, D))
            scores = jax.lax.dot_general(keys, query, (((1,), (1,)), ((), ())),
                                         precision=exact, preferred_element_type=jnp.float32)
            w = jnp.where(seen, jnp.exp(scores / D**0.5), 0.0)  # (span, D)
            # (a seen token's only: the buffer past them holds an earlier block's)
            wv = jnp.where(seen, w * values, 0.0)
            out.append((num + wv.reshape(span // 8, 8, D).sum(0),
                        den + w.reshape(span // 8, 8, D).sum(0)))
    return out


def int8_block_sums(q, k_buf, v_buf, slot, seen, sums, scales):
    """block_sums of an int8 block, its tokens along lanes: each head's scores (8, span), the
    query's in row 0 (the rest 0), by a product with the keys transposed, times the keys'
    scales; the weights times the values' scales, by a product with the values. seen (8,
    span); scales, the block's k and v scales (K, span), refs."""
    _, K, G, D = q.shape
    span = k_buf.shape[2]
    exact = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    seen &= jax.lax.broadcasted_iota(jnp.int32, (8, span), 0) == 0  # row 0's alone
    out = []
    for h in range(K):
        # the values widened to the queries' dtype (exactly: int8 fits bf16)
        keys = k_buf[slot, h].astype(jnp.float32).astype(q.dtype)  # (span, D)
        values = v_buf[slot, h].astype(jnp.float32).astype(q.dtype)
        k_scale, v_scale = (s[pl.ds(h, 1)].astype(jnp.float32) for s in scales)  # (1, span)
        for g in range(G):
            num, den = sums[h * G + g]
            query = jnp.broadcast_to(q[0, h, pl.ds(g, 1)], (8, D))
            scores = jax.lax.dot_general(query, keys, (((1,), (1,)), ((), ())),
                                         precision=exact, preferred_element_type=jnp.float32)
            w = jnp.where(seen, jnp.exp(scores * k_scale / D**0.5), 0.0)
            wv = jnp.dot((w * v_scale).astype(q.dtype), values, precision=exact,
                         preferred_element_type=jnp.float32)  # (8, D)
            out.append((num + wv, den + w.sum(1, keepdims=True)))  # (8, D) each
    return out


# ------------------------------------------------------------- a decode chunk's writes

TILE_ROWS = 8  # a TPU array's tile rows: a copy into one starts at a multiple of them
INT8_TILE_ROWS = 32  # an int8 array's, where its rows divide by them (tile_rows)


def tile_rows(dtype, L):
    """The rows of a TPU tile of a (..., L, 128) array of dtype as XLA lays it out: TILE_ROWS,
    or an int8 array's 32 where L is a multiple of 32 (seen on a v5e: a pool of 32-token pages
    and rows of 64 in tiles of 32, a ring of 528 in tiles of 8)."""
    int8 = jnp.dtype(dtype).itemsize == 1
    return INT8_TILE_ROWS if int8 and L % INT8_TILE_ROWS == 0 else TILE_ROWS


def write_tokens(whole, new, major, slot, valid, *, wraps, own=False, windows=None):
    """Each row's tokens new (rows, K, n, D) into whole (N, K, L, D): token j of row r
    at whole[major[r, j], :, slot[r, j]] where valid[r, j] (a prefix of the row). A
    row's tokens lie at consecutive slots, across one boundary at most: into slot 0 of
    another major (the next page), or with `wraps` of the same one (a ring's end); `own`:
    each row's major is the row itself. windows: by `write_windows` (None: on a TPU, where
    one scatter is slow), an int8 cache's scales of own rows by `place_scales`; else that
    scatter."""
    rows, K, n, *vector = new.shape  # (D,), or () for an int8 cache's scales
    N, _, L = whole.shape[:3]
    tile = tile_rows(whole.dtype, L)
    width = min(token_window(n, tile), L)  # at most a page: a page whole
    if windows is None:
        windows = jax.default_backend() == "tpu"
    # the windows where rows of D are whole lanes (an int8 cache's scales are not), and
    # where a row's tokens cross one boundary at most and a wrap cannot overlap its two
    tiles = vector and vector[0] % 128 == 0 and n <= L
    if windows and tiles and L >= (2 * width if wraps else width):
        return write_windows(whole, *windows_of(new, major, slot, valid, L, width, tile),
                             tile=tile)
    if windows and own and not vector:
        return place_scales(whole, new, slot, valid)
    index = (major[:, None] * K + jnp.arange(K)[:, None]) * L + slot[:, None]  # (rows, K, n)
    index = jnp.where(valid[:, None], index, N * K * L)  # past the end: dropped
    flat = whole.reshape(-1, *vector).at[index.reshape(-1)].set(new.reshape(-1, *vector),
                                                                 mode="drop")
    return flat.reshape(whole.shape)


def place_scales(whole, new, slot, valid):
    """write_tokens of an int8 cache's scales new (rows, K, n) into the first rows' own
    rings or rows of whole (N, K, L): those rows rewritten whole, each token moved to its
    slot by a product with a one-hot (exact at the highest precision). A scatter of
    single values took 62 µs a layer's k or v at 32 rows on a v5e."""
    rows = new.shape[0]
    picks = valid[..., None] & (slot[..., None] == jnp.arange(whole.shape[2]))  # (rows, n, L)
    placed = jnp.einsum("rkj,rjl->rkl", new, picks.astype(new.dtype),
                        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    kept = jnp.where(picks.any(1)[:, None], placed.astype(whole.dtype), whole[:rows])
    return whole.at[:rows].set(kept)


def token_window(n, tile=TILE_ROWS):
    """The rows of a window that holds n consecutive slots from any start: from the
    tile row at or before the first, n + tile - 1 rounded up to whole tiles."""
    return -(-(n + tile - 1) // tile) * tile


def windows_of(new, major, slot, valid, L, width, tile=TILE_ROWS):
    """write_tokens' tokens as two windows a row of `width` rows, whole tiles of one major
    each: the first from the tile of the row's first token (no further than L - width),
    the second from slot 0 of the major its tokens cross into, or the first again where
    they cross nothing (the same bytes written twice). (majors, offsets, lo, hi: (2 *
    rows,); blocks (2 * rows, K, width, D)): window w takes its rows lo[w]..hi[w] - 1
    from blocks[w], the row's tokens moved to their rows."""
    rows, K, n, D = new.shape
    first = jnp.minimum(slot[:, 0] // tile * tile, L - width)  # (rows,)
    inside = (major == major[:, :1]) & (slot >= first[:, None]) & (slot < first[:, None] + width)
    beyond = valid & ~inside  # (rows, n)
    crosses = beyond.any(1)
    into = jnp.take_along_axis(major, jnp.argmax(beyond, 1)[:, None], axis=1)[:, 0]
    majors = jnp.stack([major[:, 0], jnp.where(crosses, into, major[:, 0])], 1)  # (rows, 2)
    offsets = jnp.stack([first, jnp.where(crosses, 0, first)], 1)
    # window row i of window w takes token j: one-hot (rows, 2, width, n), then the move
    # (a product by one exact at the highest precision; a TPU's default rounds fp32 to bf16)
    row = offsets[..., None] + jnp.arange(width)  # (rows, 2, width)
    picks = (valid[:, None, None] & (major[:, None, None] == majors[..., None, None])
             & (slot[:, None, None] == row[..., None]))
    blocks = jnp.einsum("rwij,rkjd->rwkid", picks.astype(new.dtype), new,
                        precision=jax.lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32).astype(new.dtype)
    # the rows a window takes are consecutive: lo..hi - 1 (none: 0..-1)
    taken = picks.any(-1)
    lo = jnp.argmax(taken, -1)
    hi = jnp.where(taken.any(-1), width - jnp.argmax(taken[..., ::-1], -1), 0)
    return (majors.reshape(-1), offsets.reshape(-1), lo.reshape(-1), hi.reshape(-1),
            blocks.reshape(2 * rows, K, width, D))


@functools.partial(jax.jit, static_argnames=("group", "tile"))  # as attend_pages
def write_windows(whole, majors, offsets, lo, hi, blocks, group=16, tile=TILE_ROWS):
    """whole (N, K, L, D) with window w, its rows lo[w]..hi[w] - 1 of whole[majors[w],
    :, offsets[w] + (0..width-1)] from blocks (windows, K, width, D), in place: a Pallas
    kernel that copies each window in, takes the block's rows and copies it back,
    `group` windows at a time (offsets at whole tiles of `tile` rows). Windows of one group
    overlap only where they are equal or take no rows (idle rows on a null page); off a
    TPU interpreted (tests)."""
    count, K, width, D = blocks.shape
    group = math.gcd(count, group)

    def kernel(majors, offsets, lo, hi, blocks, _, whole, buffer, done):
        first = pl.program_id(0) * group

        def copy(i, inward):
            at = pl.multiple_of(offsets[first + i], tile)
            window = whole.at[majors[first + i], :, pl.ds(at, width)]
            ends = (window, buffer.at[i]) if inward else (buffer.at[i], window)
            return pltpu.make_async_copy(*ends, done.at[i])
        # 1. the group's windows in, all copies in flight at once
        for i in range(group):
            copy(i, True).start()
        for i in range(group):
            copy(i, True).wait()
        # 2. each window takes its block's rows lo..hi - 1
        row = jax.lax.broadcasted_iota(jnp.int32, (K, width, D), 1)
        for i in range(group):
            take = (row >= lo[first + i]) & (row < hi[first + i])
            buffer[i] = jnp.where(take, blocks[i], buffer[i])
        # 3. and back
        for i in range(group):
            copy(i, False).start()
        for i in range(group):
            copy(i, False).wait()

    interpret = jax.default_backend() != "tpu"
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(whole.shape, whole.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(count // group,),
            in_specs=[pl.BlockSpec((group, K, width, D), lambda g, *_: (g, 0, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.VMEM((group, K, width, D), whole.dtype),
                            pltpu.SemaphoreType.DMA((group,))]),
        input_output_aliases={5: 0},  # whole, after the 4 scalar arrays and blocks
        interpret=interpret,
    )(majors, offsets, lo, hi, blocks, whole)


# ----------------------------------------------------------------------------- the init


def init_params(cfg, key):
    """nanochat.init_params compiled at LLVM's -O1: it runs once, so a cheaper compile
    pays, and the bits are the same."""
    return _compiled_init(cfg)(key)


@functools.cache  # one compile a config, whatever the key
def _compiled_init(cfg):
    lowered = nc.init_params.lower(cfg, jax.random.key(0))
    return lowered.compile({"xla_backend_optimization_level": 1})
