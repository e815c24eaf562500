"""The slot engine's KV cache: how each layer's cache lies, keys and values written into it
and read out of it, its bytes against the device's memory, and the host's page allocator.

- Three layouts, one a layer (`layouts`). A sliding-window layer never reads further back
  than its window, so a slot holds only a ring of `window` positions, the token at
  position p in slot p modulo the ring: a window of 512 tokens at a context of 2048 holds
  512, not 2048 (a decode chunk reads the ring as it stood at its start, and its own
  tokens apart: the window before the start is all a step reads there). A layer over the
  whole context holds rows, the whole context a slot; or
  pages of `page_size` tokens from one pool (`new_cache` with pages), so that the cache is
  not slots × context: a request holds the pages its prompt and max_tokens can reach, from
  its admission to its end (`PagePool`). Page 0 is the null page, which no slot holds: a
  slot's page table points at it past the slot's pages.
- An int8 cache (kv_dtype "int8") holds each k or v as int8 values (B, K, S, D) and one
  scale per token and head (nc.quantize), stored (B, K, S): the tokens along the lanes (a
  (B, K, S, 1) array took 128 lanes a scale on a TPU).
- A prompt is prefilled whole, then copied into each of its choices' slots (`store_prompt`);
  a decode chunk reads its rows' pages gathered, or on a TPU in place (`read_chunk`), and
  writes its new tokens after its steps (`store_chunk`).
- The shapes the engine compiles for, a program each: prompt buckets and chunk views (one
  for a row count whose chunk reads nothing up to a view: `reads_by_view`); a page tiles
  both. The cache is counted from its shapes before it exists (`check_memory`).
docs/serving.md tells the design. Dimensions: B slots, K kv heads, S sequence_len, D head_dim,
T a prompt bucket.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np

import kernels
import nanochat as nc

PAGE = 32  # tokens a page of the paged layers' cache, at most (page_size)
# an exact ring or row is read in place from chunks of this many rows: at 8 or fewer, a kernel
# like attend_pages read full rings 3-25% slower than XLA (docs/serving.md)
RING_ROWS = 16

# ----------------------------------------------------------------------------------- the shapes


def prompt_bucket(context, n):
    """The padded length of a prompt of n tokens, an admit program each: the context, a
    quarter of it, a sixteenth, ... down to 32 tokens (a prefill costs little next to a
    compile: 512 gives 32, 128, 512; 256 gives 64, 256)."""
    padded = context
    while padded // 4 >= max(n, 32):
        padded //= 4
    return padded


def chunk_views(context):
    """How far into the cache a chunk may read, a program each (each costs seconds of
    start-up): a quarter of the context, or all of it."""
    return sorted({max(1, context // 4), context})


def page_size(context):
    """The tokens of a page: PAGE, or fewer so that pages tile every view and prompt
    bucket."""
    buckets = {prompt_bucket(context, n) for n in range(1, context)}
    return math.gcd(PAGE, *chunk_views(context), *buckets)

# ---------------------------------------------------------------------------------- the layouts


def layouts(cfg, paged):
    """How each layer's cache lies in the engine: "ring", a sliding window's, a ring a
    slot; a layer over the whole context "pages" from one pool when paged, else "rows",
    the whole context a slot."""
    whole = "pages" if paged else "rows"
    return ["ring" if nc.ring_size(window, cfg.sequence_len) else whole
            for window in nc.window_sizes(cfg)]


def new_cache(cfg, slots, kv_dtype=None, pages=None, page=None):
    """The engine's KV cache, every slot empty (layouts: a sliding window's layer a ring of
    the window a slot; a layer over the whole context the whole context a slot,
    or with `pages` a pool of that many pages of `page` tokens, page 0 the null page that
    no slot holds: (pages + 1, K, page, D); page None: page_size's). Each array its own
    buffer: the engine donates its state whole."""
    page = page or page_size(cfg.sequence_len)

    # each layer's k or v: a ring of its window a slot, the whole context a slot, or a
    # pool of pages + 1
    def empty(window, layout):
        if layout == "pages":
            return nc.empty_kv(cfg, pages + 1, page, kv_dtype)
        length = window if layout == "ring" else cfg.sequence_len
        return nc.empty_kv(cfg, slots, length, kv_dtype)
    kinds = layouts(cfg, pages is not None)
    layers = [(empty(window, layout), empty(window, layout))
              for window, layout in zip(nc.window_sizes(cfg), kinds)]
    # (the smear's last embeddings and the positions, as nc.init_cache's)
    return {**nc.init_cache(cfg, slots, 0), "layers": layers}

# ------------------------------------------------------------------------------------ the bytes


def tree_bytes(tree):
    """The bytes of a pytree's arrays (or their shapes)."""
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def free_device_bytes():
    """The bytes free on this process's first device, or None where it has no fixed
    limit (a CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0)


def check_memory(slots, pages, state_bytes, work=lambda slots: 0):
    """One ValueError line, before any cache is allocated, when the state of `slots`
    slots and `pages` pages (None: every slot the whole context; state_bytes(n): the bytes
    of n slots' state) and the bytes of work (work(slots): the largest decode call's beyond
    its arguments, asked only of a device with a limit) do not fit the device's free memory
    (the weights already on it): what they need, what is free and how many slots fit."""
    # a CPU has no fixed limit: nothing to check
    free = free_device_bytes()
    if free is None:
        return

    # what n slots need: their state and the work of their largest decode call
    def need(n):
        return state_bytes(n) + work(n)
    cache = state_bytes(slots)
    decoding = work(slots)
    if cache + decoding <= free:
        return
    # fewer slots, each estimate from the bytes a slot took in the last, until one fits
    null = state_bytes(0)  # the null page; the pages given
    fit, needs = slots, cache + decoding
    while fit and needs > free:
        fit = max(0, min(fit - 1, int((free - null) // ((needs - null) / fit))))
        needs = need(fit) if fit else 0
    decoding = f" and {decoding / 2**30:.2f} GiB to decode" if decoding else ""
    what = f"{slots} slots" + (f" and {pages} pages" if pages is not None else "")
    raise ValueError(f"{what} need {cache / 2**30:.2f} GiB of KV cache{decoding}, more than "
                     f"the {free / 2**30:.2f} GiB the device has free beside the weights; "
                     f"at most {fit} fit")

# ---------------------------------------------------------------------- a prompt into its slots


def ring_of(prompt, length, ring):
    """A prompt's keys or values (1, K, T, D), its first `length` real, as a ring of
    `ring` slots holds them after its last token (nc.ring_positions); zeros where no
    position is yet."""
    held = nc.ring_positions(jnp.reshape(length - 1, (1,)), ring)[0]  # (ring,)
    taken = jnp.take(prompt, jnp.clip(held, 0, prompt.shape[2] - 1), axis=2)
    return jnp.where((held >= 0)[:, None], taken, 0)


def to_pages(a, page):
    """(K, L, D) as its L / page pages, (L / page, K, page, D): a pool's layout (an int8
    cache's scales (K, L) likewise, without D)."""
    K, L, *vector = a.shape
    return jnp.moveaxis(a.reshape(K, L // page, page, *vector), 1, 0)


def store_prompt(layers, prompts, j, request, *, cfg, paged):
    """Choice j of admit's request into the cache `layers` (admit's loop body): its prompt's
    keys and values, from the cache `prompts` the prompts were prefilled into together,
    into its slot's ring or row, or its pages through its page table; a ring takes the
    positions it holds after the prompt's last token, an int8 cache the keys and values
    quantized. request: admit's (its slots, row, length, pages and prompt read)."""
    slots = request["slots"]
    row = request["row"]
    length = request["length"]
    T = request["prompt"].shape[1]

    # how one k or v goes in: at the slot, into the pages, quantized
    def into_slot(cache, new):  # (B, K, ring or S, D) at the slot (scales: no D)
        at = (slots[j],) + (0,) * (new.ndim - 1)
        return jax.lax.dynamic_update_slice(cache, new, at)

    def into_pages(pool, new):  # (pages + 1, K, page, D), the prompt's T / page pages
        page = pool.shape[2]
        return pool.at[request["pages"][j, :T // page]].set(to_pages(new[0], page))

    def store(put, entry, new):  # an int8 cache takes it quantized per token and head
        if isinstance(entry, tuple):
            return tuple(put(a, b) for a, b in zip(entry, nc.quantize(new)))
        return put(entry, new)

    def prompt_of(a):  # (1, K, T, D)
        return jax.lax.dynamic_slice_in_dim(a, row[j], 1)
    # each layer: the choice's prompt, as a ring holds it where the layer is one
    stored = []
    for (k, v), (k_prompt, v_prompt), window, layout in zip(
            layers, prompts["layers"], nc.window_sizes(cfg), layouts(cfg, paged)):
        k_prompt, v_prompt = prompt_of(k_prompt), prompt_of(v_prompt)
        if layout == "ring":
            k_prompt, v_prompt = (ring_of(a, length[row[j]], window)
                                  for a in (k_prompt, v_prompt))
        put = into_pages if layout == "pages" else into_slot
        stored.append((store(put, k, k_prompt), store(put, v, v_prompt)))
    return stored

# --------------------------------------------------- a decode chunk: its reads, then its writes


def from_pages(blocks):
    """Each row's pages as one array: (B, n, K, page, D) as (B, K, n * page, D) (an
    int8 cache's scales likewise, without D)."""
    B, n, K, page, *vector = blocks.shape
    return jnp.moveaxis(blocks, 1, 2).reshape(B, K, n * page, *vector)


def reads_in_place(entry, layout, rows, in_place=None):
    """Whether a decode chunk of `rows` rows reads a layer's k or v in place
    (kernels.attend_pages): as in_place says, or where it is None on a TPU for heads of
    whole lanes: pages always, an int8 cache's rings and rows, an exact cache's rings and
    rows from RING_ROWS rows (XLA read fewer faster)."""
    if in_place is not None:
        return in_place
    int8 = isinstance(entry, tuple)
    _, _, S, D = nc.kv_shape(entry)  # (a pool's S: a page)
    tiles = S % kernels.INT8_TILE_ROWS == 0 or not int8  # int8 pages or rings of whole tiles
    many_rows = layout in ("ring", "rows") and rows >= RING_ROWS
    return jax.default_backend() == "tpu" and D % 128 == 0 and tiles and (
        layout == "pages" or many_rows or int8)


def reads_by_view(layers, kinds, rows, in_place=None):
    """Whether a decode chunk of `rows` rows reads the cache `layers` (layouts `kinds`) only
    up to its view (read_chunk): a row or pages layer gathered. A ring is read whole, and a
    layer read in place (reads_in_place, in_place as there) as far as each row holds: where
    every layer is, a second view is a second program that reads the same."""
    return any(layout != "ring" and not reads_in_place(entry, layout, rows, in_place)
               for layer, layout in zip(layers, kinds) for entry in layer)


def read_in_place(entry, table, count, block=None):
    """A layer's k or v as kernels.Pages: a pool's pages through table (B, n), or with table
    None the rings or rows (their first B: a row is a ring that never wraps), each row
    holding count (B,) tokens from position 0; an int8 cache's values in place, its scales
    gathered into the kernel's blocks of `block` pages (None: kernels.block_of's)."""
    if not isinstance(entry, tuple):
        return kernels.Pages(entry, table, count)
    values, scales = entry
    if table is None:  # a row's slots, and its scales
        S, scales = values.shape[2], scales[:count.shape[0]]
    else:
        S, scales = table.shape[1] * values.shape[2], from_pages(scales[table])
    span = (block or kernels.block_of(S, table, values.dtype)) * kernels.copy_unit(S, table)
    return kernels.Pages(values, table, count, kernels.block_scales(scales, span))


def read_chunk(layers, kinds, start, view, *, table, cfg, in_place=None):
    """The cache `layers` (layouts `kinds`) as a decode chunk's steps read it, its first
    rows: a ring whole, a row up to `view`, pages up to `view` through `table`, the rows'
    page tables (rows, S / page): gathered, or in place where reads_in_place says
    (kernels.Pages, each row read as far as it holds tokens, its `start` (rows,))."""
    rows = table.shape[0]
    page = cfg.sequence_len // table.shape[1]
    pages = table[:, :view // page]

    # each layer by its layout: a ring whole, a row up to the view, pages through the table
    def read(entry, layout):
        if reads_in_place(entry, layout, rows, in_place):
            return read_in_place(entry, pages if layout == "pages" else None, start)
        if layout == "pages":  # (pages + 1, K, page, D) -> (rows, K, view, D)
            return jax.tree.map(lambda a: from_pages(a[pages]), entry)
        if layout == "ring":
            return jax.tree.map(lambda a: a[:rows], entry)
        return jax.tree.map(lambda a: a[:rows, :, :view], entry)
    return [tuple(read(entry, layout) for entry in layer) for layer, layout in zip(layers, kinds)]


def chunk_buffers(layers, rows, kmax, steps_first=False):
    """Each layer's k, v for a decode chunk's own tokens, which its steps write and
    store_chunk moves into the cache after: zeros (kmax, K, rows, D), a step's a slab,
    with steps_first, else (rows, K, kmax, D) (nc.write_step; an int8 cache's scales
    without D)."""
    def own(a):
        K, vector = a.shape[1], a.shape[3:]
        shape = (kmax, K, rows) if steps_first else (rows, K, kmax)
        return jnp.zeros((*shape, *vector), a.dtype)
    return [jax.tree.map(own, layer) for layer in layers]


def chunk_most(cfg, page, paged):
    """The most tokens a decode chunk may write (its kmax): store_chunk takes a row's
    tokens across one page's end or one ring's at most, so a page's tokens (paged) and the
    shortest ring's."""
    rings = [window for window, layout in zip(nc.window_sizes(cfg), layouts(cfg, paged))
             if layout == "ring"]
    return min([page] * paged + rings + [cfg.sequence_len])


def store_chunk(layers, fresh, kinds, start, end, *, table, cfg, steps_first=False):
    """A decode chunk's own k, v (per layer, chunk_buffers' entries) into the first
    rows' cache `layers` (layouts `kinds`): each row's tokens from its position at the
    chunk's start up to its position `end`, the rest dropped; a ring at their positions
    modulo its size, a row at their positions, pages through the slot's page `table`
    (rows, S / page). kernels.write_tokens writes each k or v."""
    fresh = [nc.by_rows(layer, steps_first) for layer in fresh]  # (rows, K, kmax, D) each
    rows, kmax = table.shape[0], jax.tree.leaves(fresh[0])[0].shape[2]
    page = cfg.sequence_len // table.shape[1]
    at = start[:, None] + jnp.arange(kmax)  # (rows, kmax)
    new = at < end[:, None]

    def destination(layout, length):  # (rows, kmax) each: each token's ring, row or page; its place
        if layout == "pages":  # the page each token falls in, through the slot's table
            major = jnp.take_along_axis(table, jnp.minimum(at // page, table.shape[1] - 1),
                                        axis=1)
        else:  # the slot's own ring or row
            major = jnp.broadcast_to(jnp.arange(rows)[:, None], at.shape)
        return major, at % length

    stored = []
    for layer, done, layout in zip(layers, fresh, kinds):
        major, slot = destination(layout, jax.tree.leaves(layer)[0].shape[2])

        def write(whole, d):
            return kernels.write_tokens(whole, d, major, slot, new, wraps=layout == "ring",
                                        own=layout != "pages")
        stored.append(jax.tree.map(write, layer, done))
    return stored

# -------------------------------------------------------------------- the host's page allocator


class PagePool:
    """The host's side of the paged layers: the free pages (the lowest taken first), the
    pages each slot holds, and the page table the device reads, (slots, S / page): a slot's
    pages, then 0, the null page. An engine without pages keeps one too (a context a slot),
    which no layer reads."""

    def __init__(self, pages, slots, context, page):
        self.pages = pages
        self.page = page
        self.context = context
        self.free = list(range(pages, 0, -1))  # the lowest last: pop takes it
        self.held = [[] for _ in range(slots)]
        self.table = np.zeros((slots, context // page), np.int32)

    def pages_for(self, tokens):
        """The pages that hold a choice of `tokens` tokens (at most the context)."""
        return -(-min(tokens, self.context) // self.page)

    def take(self, slot, count):
        """`count` free pages for a slot, the lowest first, into its page table."""
        self.held[slot] = [self.free.pop() for _ in range(count)]
        self.table[slot, :count] = self.held[slot]

    def release(self, slot):
        """A slot's pages back to the free ones; its page table points at the null page."""
        self.free.extend(reversed(self.held[slot]))
        self.held[slot] = []
        self.table[slot] = 0

    def check(self, choices, tokens):
        """A one-line ValueError when `choices` choices of up to `tokens` tokens each need
        more pages than the pool holds: they could never start."""
        need = choices * self.pages_for(tokens)
        if need > self.pages:
            raise ValueError(f"{choices} choices of up to {tokens} tokens need {need} pages of "
                             f"{self.page} tokens, more than the engine's {self.pages}; ask "
                             "for fewer choices or tokens")

    def in_use(self):
        """The pages the slots hold."""
        return self.pages - len(self.free)
