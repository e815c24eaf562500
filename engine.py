"""Generation: nanochat's Engine, and an engine that serves many requests at once.

- `generate` is nanochat's Engine.generate token for token: the specification, which the
  golden test pins to nanochat's own Engine and against which the slot engine is tested.
- `Engine` serves many requests at once (continuous batching): slots, rows of one KV
  cache over the whole context (a sliding-window layer's over its window, a ring; or
  pages from one pool: kvcache.py holds how the cache lies), each at its own position.
  The prompts waiting are prefilled together into free slots (`admit`); one jitted call
  decodes up to K tokens for every live slot (`decode_chunk`) with the sampling, stop
  ids, budgets and the calculator's forced tokens on the device, and hands back early
  only when the calculator must run (`resume`). A choice's samples depend on its own
  seed. docs/serving.md tells the design. Dimensions: B slots, S sequence_len, V vocab, C
  choices, P prompts, N choices admitted at once.
"""
import collections
import concurrent.futures
import dataclasses
import functools
import os
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvcache
import nanochat as nc
import runtime

TOP_K_MAX = 256  # top_k is traced under this bound: a fixed-size lax.top_k is fast, a sort is not
MAX_STOPS = 4  # stop ids per request
MAX_CHOICES = 16  # choices that share one prefill
TOP_LOGPROBS = 20  # OpenAI's most
# an idle engine's first request may lead a burst: it waits for the line to stop growing
BURST_QUIET = 0.002  # seconds without a new request
BURST_MOST = 0.05  # seconds at most
# warm_up compiles its programs in this many threads first where the host has 8 cores or
# more (a v5e's host of 13: over 3× faster); one elsewhere (2 cores: threads took 13% longer)
CORES = os.cpu_count() or 1
WARM_UP_THREADS = CORES // 2 if CORES >= 8 else 1
# a record's flags: the token was forced (mask 0), it closed a python block, the choice ended
FORCED = 1
CLOSES = 2
DONE = 4

# ------------------------------------------------------------------------------------- sampling


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a request's choices are drawn and when they end (max_tokens, a stop id, the
    context)."""
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0
    seed: int = 0  # choice c draws with fold_in(key(seed), c)
    stop_ids: tuple = ()
    logprobs: bool = False  # each token's log-probability and the TOP_LOGPROBS likeliest


def row_keys(key, rows):
    """A key for each row index of rows (a choice of a request): fold_in(key, row)."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows)


def step_keys(keys, pos):
    """Each row's key for the token after its first pos: the same draw whatever else is
    batched."""
    return jax.vmap(jax.random.fold_in)(keys, pos)


def last_positive(x):
    """The index of each row's last positive entry of x (B, N)."""
    flipped = x[:, ::-1] > 0
    return x.shape[-1] - 1 - jnp.argmax(flipped, axis=-1)


def draw(vals, keys):
    """One id per row of vals (B, N), drawn from softmax(vals) with each row's key."""
    # softmax(vals)'s cumulative sum inverted at a uniform from each row's key: one
    # random number a row, where the Gumbel trick draws one for every logit. In two
    # levels, as a cumulative sum over a long axis is slow: the block of 64 that
    # holds the uniform's mass, then the token within it
    u = jax.vmap(jax.random.uniform)(keys)[:, None]  # (B, 1)
    probs = jnp.exp(vals - jnp.max(vals, axis=-1, keepdims=True))
    # padded to whole blocks with zeros, which are never drawn
    pad = -probs.shape[-1] % 64
    probs = jnp.pad(probs, ((0, 0), (0, pad)))
    blocks = probs.reshape(probs.shape[0], -1, 64)  # (B, V / 64, 64)
    sums = blocks.sum(-1)
    ends = jnp.cumsum(sums, axis=-1)  # the mass up to each block's end
    target = u * ends[:, -1:]
    # (rounding can carry a sum past the last token that has mass: never beyond it)
    passed = jnp.sum(ends <= target, axis=-1)
    j = jnp.minimum(passed, last_positive(sums))[:, None]
    before = jnp.take_along_axis(ends - sums, j, axis=1)  # the mass before block j
    inside = jnp.take_along_axis(blocks, j[:, :, None], axis=1)[:, 0]  # (B, 64)
    within = before + jnp.cumsum(inside, axis=-1)
    passed = jnp.sum(within <= target, axis=-1)
    k = jnp.minimum(passed, last_positive(inside))
    return j[:, 0] * 64 + k


def sample_next_token(logits, keys, temperature, top_k, top_p):
    """Next ids (B,) from logits (B, V), row b drawn with keys[b]: the argmax at
    temperature 0, else a draw from softmax(logits / temperature) over the top_k
    likeliest (0: all; at most TOP_K_MAX), then over the smallest set of those holding
    top_p of the probability (nucleus sampling, arXiv 1904.09751, among the TOP_K_MAX
    likeliest). Settings are traced, one per row or one for all: a new value never
    recompiles."""
    rows = logits.shape[:1]
    temperature = jnp.broadcast_to(temperature, rows)[:, None]  # (B, 1)
    top_k = jnp.broadcast_to(top_k, rows)[:, None]
    top_p = jnp.broadcast_to(top_p, rows)[:, None]
    scaled = logits / jnp.maximum(temperature, 1e-6)

    def truncated():
        width = min(TOP_K_MAX, scaled.shape[-1])
        vals, idx = jax.lax.top_k(scaled, width)  # likeliest first
        # top_k: keep the first top_k (0 keeps them all)
        kept = (jnp.arange(width) < top_k) | (top_k == 0)
        vals = jnp.where(kept, vals, -jnp.inf)
        # top_p: probabilities within the top_k (all of the vocab when top_k is 0)
        whole = jax.nn.logsumexp(scaled, -1, keepdims=True)
        within = jax.nn.logsumexp(vals, -1, keepdims=True)
        probs = jnp.exp(vals - jnp.where(top_k > 0, within, whole))
        # a token stays while the mass before it is under top_p
        mass_before = jnp.cumsum(probs, -1) - probs
        vals = jnp.where(mass_before < top_p, vals, -jnp.inf)
        picked = draw(vals, keys)
        return jnp.take_along_axis(idx, picked[:, None], axis=-1)[:, 0]

    def full():
        return draw(scaled, keys).astype(jnp.int32)

    def sample():
        # one branch runs: the top-k one only when some row truncates
        truncating = jnp.any((top_k > 0) | (top_p < 1))
        return jax.lax.cond(truncating, truncated, full)

    def greedy():
        return jnp.zeros(rows, jnp.int32)

    # all-greedy batches (evaluations) skip the draw
    picked = jax.lax.cond(jnp.any(temperature > 0), sample, greedy)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.where(temperature[:, 0] > 0, picked, argmax)

# ---------------------------------------------------------------- the reference: nanochat's Engine


@functools.partial(jax.jit, static_argnames=("cfg", "max_len", "num_samples", "attn"))
def prefill(layered, tokens, length, key, settings, *, cfg, max_len, num_samples=1,
            attn=nc.causal_attention):
    """One prompt (1, T), its first `length` tokens real, into a fresh cache of max_len
    slots copied to num_samples rows: (each row's first sampled token (num_samples,),
    the logits it was drawn from, the cache). layered: unstacked, in the compute dtype;
    settings: sample_next_token's (temperature, top_k, top_p); row r draws with
    fold_in(key, r)."""
    empty = nc.init_cache(cfg, 1, max_len)
    logits, cache = nc.forward_cached(layered, tokens, empty, cfg, attn, length)

    # nanochat's prefill once, replicate: every row starts from the prompt's cache
    def rows(a):
        return jnp.repeat(a, num_samples, axis=0)
    cache = jax.tree.map(rows, cache)
    logits = rows(logits)
    keys = step_keys(row_keys(key, jnp.arange(num_samples)), cache["pos"])
    return sample_next_token(logits, keys, *settings), logits, cache


@functools.partial(jax.jit, static_argnames=("cfg", "attn"), donate_argnames="cache")
def decode(layered, column, cache, key, settings, *, cfg, attn=nc.causal_attention):
    """Feed one token per row (B,) and sample the next: (ids (B,), logits (B, V),
    cache)."""
    logits, cache = nc.forward_cached(layered, column[:, None], cache, cfg, attn)
    rows = jnp.arange(column.shape[0])
    keys = step_keys(row_keys(key, rows), cache["pos"])
    return sample_next_token(logits, keys, *settings), logits, cache


def bucket(n):
    """The padded length of n prompt tokens, a power of two: a chat compiles once per
    doubling."""
    return max(16, 1 << (n - 1).bit_length())


def prepare(params, cfg):
    """The params as generation reads them: in the compute dtype, unstacked (once,
    outside jit: inside, each layer's slice would be a copy every step). Prepared ones
    as they are: engines can share them, and the stacked ones need not stay on the
    device beside them."""
    if "layers" in params:
        return params
    cast = jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params)
    return nc.unstack(cast, cfg)


def check_prompt(n, cfg, top_k=0):
    """A one-line error for a prompt of n tokens that leaves no room, or a top_k out of
    range."""
    if not 0 < n < cfg.sequence_len:
        raise ValueError(f"the prompt has {n} tokens; it must have 1 to {cfg.sequence_len - 1} "
                         "(the model's context)")
    if not 0 <= top_k <= TOP_K_MAX:
        raise ValueError(f"top_k is {top_k}; it must be 0 (all tokens) to {TOP_K_MAX}")


def generate(params, cfg, prompt_ids, sampling, *, num_samples=1, tool=None,
             attn=nc.causal_attention):
    """nanochat's Engine.generate: yields (token_column, mask_column), lists of
    num_samples ints.

    Prefill at batch 1, then decode every row together until each has emitted a stop
    id, or sampling.max_tokens, or the context is full; row r draws with
    fold_in(key(seed), r). `tool(row, token)` (e.g. data.calculator_tool(tok), fresh
    per call) sees every emitted token and returns ids to force into that row, one
    per step with mask 0 (nanochat's forced_tokens deque). The cache holds the bucket
    of the prompt and max_tokens."""
    n = len(prompt_ids)
    check_prompt(n, cfg, sampling.top_k)
    max_tokens = min(sampling.max_tokens, cfg.sequence_len - n)
    if max_tokens < 1:
        return
    max_len = min(bucket(n + max_tokens), cfg.sequence_len)
    # the prompt padded at the end to its bucket: a later write replaces each junk slot
    tokens = np.zeros((1, min(bucket(n), max_len)), np.int32)
    tokens[0, :n] = prompt_ids
    layered = prepare(params, cfg)
    key = jax.random.key(sampling.seed)
    # traced: a new setting compiles nothing
    settings = (float(sampling.temperature), int(sampling.top_k), float(sampling.top_p))
    sampled, _, cache = prefill(layered, tokens, n, key, settings, cfg=cfg, max_len=max_len,
                                num_samples=num_samples, attn=attn)
    forced = [collections.deque() for _ in range(num_samples)]
    done = [False] * num_samples
    stop_ids = set(sampling.stop_ids)
    for step in range(max_tokens):
        column = []
        masks = []
        # each row: its forced token if one waits, else its sample (the one host sync
        # per token)
        for row, token in enumerate(np.asarray(sampled).tolist()):
            masks.append(0 if forced[row] else 1)
            column.append(forced[row].popleft() if forced[row] else token)
            done[row] = done[row] or column[-1] in stop_ids
            if tool is not None:
                forced[row].extend(tool(row, column[-1]))
        yield column, masks
        if all(done) or step == max_tokens - 1:
            return
        column = np.asarray(column, np.int32)
        sampled, _, cache = decode(layered, column, cache, key, settings, cfg=cfg, attn=attn)

# ------------------------------------------------------------- the slot engine: device functions


def new_state(cfg, slots, kv_dtype=None, pages=None, page=None):
    """The engine's device state, every slot empty: the KV cache (kvcache.new_cache: with
    `pages`, the layers over the whole context a pool of that many pages of `page`
    tokens), and per slot (a leading B on every array) what its request asked and where it
    stands. Each array its own buffer: the state is donated whole."""

    def zeros(dtype=jnp.int32):
        return jnp.zeros((slots,), dtype)
    return {
        "cache": kvcache.new_cache(cfg, slots, kv_dtype, pages, page),
        "token": zeros(),  # the last token emitted, fed next
        "live": zeros(bool),  # emitting: admitted, not ended, not waiting for the calculator
        "left": zeros(),  # tokens it may still emit
        "in_py": zeros(bool),  # inside <|python_start|> ... <|python_end|>
        "queue": jnp.zeros((slots, cfg.sequence_len), jnp.int32),  # forced tokens (never cut)
        "qpos": zeros(),  # the next forced token's index in the queue
        "qlen": zeros(),
        "key": row_keys(jax.random.key(0), jnp.arange(slots)),
        "temperature": zeros(jnp.float32),
        "top_k": zeros(),
        "top_p": jnp.ones((slots,), jnp.float32),
        "stops": jnp.full((slots, MAX_STOPS), -1, jnp.int32),
    }


def state_bytes(cfg, slots, kv_dtype=None, pages=None, page=None):
    """The bytes of new_state's arrays."""
    return kvcache.tree_bytes(state_shapes(cfg, slots, kv_dtype, pages, page))


def state_shapes(cfg, slots, kv_dtype=None, pages=None, page=None):
    """new_state's arrays as shapes and dtypes, none allocated."""
    return jax.eval_shape(functools.partial(new_state, cfg, slots, kv_dtype, pages, page))


def logprob_columns(logits, token):
    """(B, 1 + 2 * TOP_LOGPROBS) int32: token's log-probability under logits (B, V),
    then the likeliest ids and their log-probabilities; floats as their bits, so a
    record is one array."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(lp, token[:, None], axis=1)
    top_lp, top_ids = jax.lax.top_k(lp, TOP_LOGPROBS)
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([bits(chosen), top_ids, bits(top_lp)], axis=1)


def emit(slot, logits, pos, python, logprobs):
    """Each live slot's next token after logits (B, V), nanochat's Engine loop body: (slot,
    records (B, W) int32: the token, or -1 where a slot is idle; its flags; when the
    traced bool logprobs holds, logprob_columns). slot: per-slot arrays (new_state's but
    the cache); pos (B,): the tokens in each slot's cache."""
    live = slot["live"]
    # 1. a draw from each slot's own key at its position
    keys = step_keys(slot["key"], pos)
    sampled = sample_next_token(logits, keys, slot["temperature"], slot["top_k"], slot["top_p"])
    # 2. a queued token replaces the draw (nanochat's forced_tokens deque)
    forced = live & (slot["qpos"] < slot["qlen"])
    at = jnp.minimum(slot["qpos"], slot["queue"].shape[1] - 1)
    queued = jnp.take_along_axis(slot["queue"], at[:, None], axis=1)
    queued = queued[:, 0]
    token = jnp.where(forced, queued, sampled)
    # 3. the calculator's state machine: <|python_end|> in a block hands the slot to the host
    opens = live & (token == python[0])
    closes = live & slot["in_py"] & (token == python[1])
    in_py = opens | (slot["in_py"] & ~closes)
    # 4. a stop id or the last token of its budget ends the choice
    left = slot["left"] - live
    stopped = jnp.any(token[:, None] == slot["stops"], axis=1)
    done = live & (stopped | (left <= 0))
    waits = closes & ~done
    slot = {**slot,
            "token": jnp.where(live, token, slot["token"]),
            "live": live & ~done & ~waits,
            "left": left,
            "in_py": in_py,
            "qpos": slot["qpos"] + forced}
    # 5. what the host reads
    flags = FORCED * forced + CLOSES * waits + DONE * done
    shown = jnp.where(live, token, -1)[:, None]

    def none(logits, token):
        return jnp.zeros((token.shape[0], 1 + 2 * TOP_LOGPROBS), jnp.int32)
    probs = jax.lax.cond(logprobs, logprob_columns, none, logits, token)
    flags = flags.astype(jnp.int32)[:, None]
    return slot, jnp.concatenate([shown, flags, probs], axis=1)


@functools.partial(jax.jit, static_argnames=("cfg", "attn", "paged"), donate_argnames="state")
def admit(layered, state, request, python, *, cfg, attn=nc.causal_attention, paged=False):
    """Start requests in their slots: prefill their prompts together, copy each prompt's
    cache into each of its choices' slots (nanochat's prefill once, replicate), and emit
    each choice's first token: (state, records (N, W), emit's). request, every value
    traced: per prompt (P rows): prompt (P, T), its first `length` tokens real; seed;
    temperature, top_k, top_p; budget (tokens it may emit); stops (P, MAX_STOPS), -1
    padded. Per choice (N rows, the first n real): row, its prompt; choice, its number
    within the request; slots, its slot (B past n); pages, its slot's page table (N, S /
    page), 0 past the pages it holds. logprobs: emit's, whether any prompt asks for them.
    python: the ids of <|python_start|> and <|python_end|> (-1: no calculator). paged:
    the state's layers over the whole context are pages (kvcache.layouts)."""
    slots = request["slots"]
    row = request["row"]
    length = request["length"]
    # 1. the prompts together, in their bucket, each at its own length
    P, T = request["prompt"].shape
    empty = nc.init_cache(cfg, P, T)
    logits, prompts = nc.forward_cached(layered, request["prompt"], empty, cfg, attn, length)

    # 2. a prompt's keys and values into each of its choices' slot or pages
    def copy(j, layers):
        return kvcache.store_prompt(layers, prompts, j, request, cfg=cfg, paged=paged)
    cache = dict(state["cache"])
    cache["layers"] = jax.lax.fori_loop(0, request["n"], copy, cache["layers"])
    cache["pos"] = cache["pos"].at[slots].set(length[row], mode="drop")
    cache["prev"] = cache["prev"].at[slots].set(prompts["prev"][row], mode="drop")
    # 3. each choice's settings, then its first token from its prompt's logits; choice c
    # of a request draws with fold_in(key(seed), c)
    N = slots.shape[0]
    seeds = jax.vmap(jax.random.key)(request["seed"][row])
    fresh = {
        "token": jnp.zeros(N, jnp.int32),
        "live": jnp.arange(N) < request["n"],
        "left": request["budget"][row],
        "in_py": jnp.zeros(N, bool),
        "queue": jnp.zeros((N, 1), jnp.int32),
        "qpos": jnp.zeros(N, jnp.int32),
        "qlen": jnp.zeros(N, jnp.int32),
        "key": jax.vmap(jax.random.fold_in)(seeds, request["choice"]),
        "temperature": request["temperature"][row],
        "top_k": request["top_k"][row],
        "top_p": request["top_p"][row],
        "stops": request["stops"][row],
    }
    fresh, records = emit(fresh, logits[row], length[row], python, request["logprobs"])
    # 4. into the slots (an index of B, past the n choices, writes nothing)
    state = {**state, "cache": cache}
    del fresh["queue"]
    for name, value in fresh.items():
        state[name] = state[name].at[slots].set(value, mode="drop")
    return state, records


def per_slot(state):
    """Every array of an engine's state but the cache's layers: a row a slot."""
    return {**state, "cache": {**state["cache"], "layers": None}}


@functools.partial(jax.jit, static_argnames=("cfg", "attn", "rows", "view", "kmax", "paged"),
                   donate_argnames="state")
def decode_chunk(layered, state, control, *, cfg, attn, rows, view, kmax, paged=False):
    """Up to control["steps"] (at most kmax) tokens for every live slot of the first
    `rows`, whose positions stay under `view`: (state, records (kmax, rows, W), -1 where
    a slot emitted nothing). control, traced: steps; exit_on_done, hand back when a
    choice ends (requests wait for a slot); cancel (B,), slots to stop first; pages, the
    slots' page tables (B, S / page), 0 past the pages each holds; python, as admit's;
    logprobs, emit's; paged, admit's. Hands back early when a slot closes a python
    block."""
    # 1. stop the cancelled slots, then take the first `rows`, their cache over the whole
    # context up to `view` (pages gathered, a copy once a chunk, or read in place:
    # kvcache.read_chunk). The steps only read it: each writes its token's k, v into the
    # chunk's own (nanochat.write_step)
    live = state["live"] & ~control["cancel"]
    state = {**state, "live": live}
    table = control["pages"][:rows]  # (rows, S / page)
    kinds = kvcache.layouts(cfg, paged)
    cache = state["cache"]
    start = cache["pos"][:rows]
    read = kvcache.read_chunk(cache["layers"], kinds, start, view, table=table, cfg=cfg,
                              in_place=in_place_of(attn))
    active = jax.tree.map(lambda a: a[:rows], per_slot(state))
    steps_first = getattr(attn, "steps_first", False)  # the chunk's own tokens' layout
    fresh = kvcache.chunk_buffers(cache["layers"], rows, kmax, steps_first)
    records = jnp.full((kmax, rows, 3 + 2 * TOP_LOGPROBS), -1, jnp.int32)

    # 2. the steps (chunk_step), until kmax or control's steps, no slot live, or one hands back
    def more(carry):
        i, active, _, _, back = carry
        return (i < control["steps"]) & jnp.any(active["live"]) & ~back

    step = functools.partial(chunk_step, layered, read, start, control, cfg=cfg, attn=attn)
    carry = (0, active, fresh, records, False)
    _, active, fresh, records, _ = jax.lax.while_loop(more, step, carry)

    # 3. each slot's new tokens into the cache, and the slots' values back in place
    layers = kvcache.store_chunk(cache["layers"], fresh, kinds, start, active["cache"]["pos"],
                                 table=table, cfg=cfg, steps_first=steps_first)
    state = jax.tree.map(lambda whole, done: whole.at[:rows].set(done),
                         per_slot(state), per_slot(active))
    state["cache"]["layers"] = layers
    return state, records


def in_place_of(attn):
    """read_chunk's in_place for attention attn: None (reads_in_place decides) where attn
    reads a stored cache in place (kernels.attend_cache), else False."""
    return None if getattr(attn, "reads_stored", False) else False


def chunk_step(layered, read, start, control, carry, *, cfg, attn):
    """One step of decode_chunk's loop, carry (i, active, fresh, records, back): each
    live slot of `active` (per-slot values) fed its last token over the cache `read` as
    it stood at each row's `start` and the chunk's own k, v `fresh`, its next token
    emitted into records[i]; back when a slot closes a python block or (control's
    exit_on_done) a choice ends."""
    i, active, fresh, records, _ = carry
    # 1. feed each live slot its last token; an idle slot's position and smear stay put
    old = active["cache"]
    chunk = {"step": i, "start": start, "layers": fresh}
    logits, cache = nc.forward_cached(layered, active["token"][:, None],
                                      {**old, "layers": read, "chunk": chunk}, cfg, attn,
                                      rings=True)
    live = active["live"]
    moved = {"layers": None,
             "pos": jnp.where(live, cache["pos"], old["pos"]),
             "prev": jnp.where(live[:, None], cache["prev"], old["prev"])}
    # 2. each live slot's next token
    slot_values = {k: v for k, v in active.items() if k != "cache"}
    slot_values, record = emit(slot_values, logits, moved["pos"], control["python"],
                               control["logprobs"])
    active = {**slot_values, "cache": moved}
    records = records.at[i].set(record)
    # 3. back to the host early: a calculator to run, or a freed slot for a waiting request
    flags = record[:, 1]
    waits = jnp.any((flags & CLOSES) > 0)
    ended = control["exit_on_done"] & jnp.any((flags & DONE) > 0)
    return i + 1, active, cache["chunk"]["layers"], records, waits | ended


@functools.partial(jax.jit, donate_argnames="state")
def resume(state, slot, forced, n):
    """A slot that closed a python block emits again: first the n ids of forced (S,),
    the calculator's output (none when it gave nothing), one a step with mask 0."""
    return {**state,
            "queue": state["queue"].at[slot].set(forced, mode="drop"),
            "qpos": state["qpos"].at[slot].set(0, mode="drop"),
            "qlen": state["qlen"].at[slot].set(n, mode="drop"),
            "live": state["live"].at[slot].set(True, mode="drop")}

# ---------------------------------------------------------------- the slot engine: the host loop


class Busy(RuntimeError):
    """The engine's waiting line is full: try again shortly."""


class EngineError(RuntimeError):
    """The engine failed while serving a request; it starts fresh and serves the next
    ones."""


@dataclasses.dataclass(frozen=True)
class Event:
    """What happened to one choice: a token (mask 0 when forced; logprobs: its
    log-probability and the likeliest (id, log-probability) pairs, when asked), or its
    end (finish: "stop" after a stop id, "length" when its budget or the context ran
    out)."""
    choice: int
    token: int | None = None
    mask: int = 1
    logprobs: tuple | None = None
    finish: str | None = None


class Request:
    """One prompt's n choices as the engine makes them: their tokens, masks and finish
    reasons, and with stream=True their Events to iterate over (iterating waits)."""

    def __init__(self, prompt, sampling, n, tool, stream):
        self.prompt = list(prompt)
        self.sampling = sampling
        self.n = n
        self.tool = tool  # tool(choice, token) -> ids to force next (data.calculator_tool's)
        self.tokens = [[] for _ in range(n)]
        self.masks = [[] for _ in range(n)]
        self.finish = [None] * n
        self.started = 0  # choices admitted so far
        self.error = None
        self.cancelled = False
        self.events = queue.Queue() if stream else None
        self.pending = []  # events of the device call being handed out

    @property
    def done(self):
        return self.error is not None or all(self.finish)

    def cancel(self):
        """Stop generating (a client went away, a stop string was hit): its slots are
        free within one device call."""
        self.cancelled = True

    def add(self, event):
        if event.token is not None:
            self.tokens[event.choice].append(event.token)
            self.masks[event.choice].append(event.mask)
        else:
            self.finish[event.choice] = event.finish
        if self.events is not None:
            self.pending.append(event)

    def flush(self):
        """Hand the reader a device call's events at once: one wake-up, not one a token."""
        if self.pending:
            self.events.put(self.pending)
            self.pending = []

    def fail(self, error):
        self.error = error
        if self.events is not None:
            self.flush()
            self.events.put(error)

    def batches(self):
        """The events a device call at a time, lists, as they come (the stream ends when
        every choice has); EngineError if the engine failed while serving the
        request."""
        ended = 0
        while ended < self.n:
            batch = self.events.get()
            if isinstance(batch, EngineError):
                raise batch
            ended += sum(event.finish is not None for event in batch)
            yield batch

    def __iter__(self):
        for batch in self.batches():
            yield from batch


class Engine:
    """Continuous batching over `slots` rows of one KV cache: submit() from any thread,
    step() (or the thread that start() runs) from one. Slots whose cache does not fit the
    device are a one-line ValueError (kvcache.check_memory).
    - kmax: the most tokens one device call decodes;
    - python_ids: the ids of <|python_start|> and <|python_end|>, for the calculator;
    - waiting: how many requests may wait for a slot before submit raises Busy (None:
      any);
    - kv_cache: "int8" for an int8 cache with a scale per token and head (None: the
      compute dtype's, exact);
    - pages: the pages of `page` tokens the layers over the whole context hold, at least
      a context's (None: every slot the whole context). A request holds the pages its
      prompt and max_tokens can reach from its admission to its end; requests wait for
      pages as for slots."""

    def __init__(self, params, cfg, *, slots=16, kmax=16, attn=nc.causal_attention,
                 python_ids=None, waiting=None, kv_cache=None, pages=None):
        self.cfg = cfg
        self.layered = prepare(params, cfg)
        if kv_cache not in (None, "int8"):
            raise ValueError(f"kv_cache is {kv_cache!r}; it must be None (exact) or 'int8'")
        self.kv_cache = kv_cache
        self.slots = slots
        self.kmax = kmax
        self.attn = attn
        self.python = np.array(python_ids or (-1, -1), np.int32)
        self.waiting = waiting
        self.choices = min(slots, MAX_CHOICES)  # a request's choices started at once
        # a chunk runs on the first 1, 4, 16, ... slots and the lowest free slot is
        # taken first, so that a few requests cost a few rows
        powers = {min(slots, 4**i) for i in range(slots.bit_length())}
        self.row_buckets = sorted(powers)
        S = cfg.sequence_len
        self.page = kvcache.page_size(S)
        self.paged = pages is not None
        self.pages = pages or slots * (S // self.page)
        # and it reads the cache only as far as its slots reach, a program a view, unless
        # a chunk of those rows reads the same at every view (on a TPU: in place, or whole)
        layers = state_shapes(cfg, slots, kv_cache, pages, self.page)["cache"]["layers"]
        kinds = kvcache.layouts(cfg, self.paged)
        self.views = {}  # a row count's
        for rows in self.row_buckets:
            by_view = kvcache.reads_by_view(layers, kinds, rows, in_place_of(attn))
            self.views[rows] = kvcache.chunk_views(S) if by_view else [S]
        most = kvcache.chunk_most(cfg, self.page, self.paged)
        if not 1 <= kmax <= most:
            raise ValueError(f"kmax is {kmax}; a chunk's tokens must fit a page and a ring: "
                             f"1 to {most}")
        if self.pages < S // self.page:
            raise ValueError(f"pages is {pages}; the engine needs at least {S // self.page} "
                             f"(one context of {S} tokens in pages of {self.page})")
        # the state and the largest decode call must fit (pages None: they grow with the slots)
        counted = functools.partial(state_bytes, cfg, kv_dtype=kv_cache, pages=pages,
                                    page=self.page)
        kvcache.check_memory(slots, pages, counted, work=self.decode_work)
        self.inbox = collections.deque()
        self.wake = threading.Condition()  # guards the inbox; notified on each submit
        self.stats = collections.Counter()  # device calls (admits, chunks, hops), tokens
        self.warmed = threading.Event()
        self.thread = None  # start()'s: the engine served from it, others submit
        self.running = False  # start() runs the thread until stop()
        self.reset()

    def reset(self):
        """Every slot empty (after a failure too: the donated state may be gone)."""
        self.state = new_state(self.cfg, self.slots, self.kv_cache,
                               self.pages if self.paged else None, self.page)
        self.owner = [None] * self.slots  # (request, choice) of each busy slot
        self.stopping = set()  # slots of cancelled requests, stopped by the next chunk
        self.in_flight = None  # the records of the chunk started last, not handed out
        # the pages: the free ones, each slot's, and the page tables the device reads
        self.pool = kvcache.PagePool(self.pages, self.slots, self.cfg.sequence_len, self.page)

    def submit(self, prompt, sampling, *, n=1, tool=None, stream=False):
        """Queue a prompt's n choices: the Request. One-line ValueErrors for what a
        caller must fix; Busy when `waiting` requests already wait."""
        check_prompt(len(prompt), self.cfg, sampling.top_k)
        counts = (sampling.max_tokens, n, len(sampling.stop_ids))
        if sampling.max_tokens < 1 or n < 1 or len(sampling.stop_ids) > MAX_STOPS:
            raise ValueError(f"max_tokens and n must be 1 or more, the stop ids at most "
                             f"{MAX_STOPS} (got {counts[0]}, {counts[1]}, {counts[2]})")
        request = Request(prompt, sampling, n, tool, stream)
        self.pool.check(min(n, self.choices), len(prompt) + sampling.max_tokens)
        with self.wake:
            if self.waiting is not None and len(self.inbox) >= self.waiting:
                raise Busy(f"{len(self.inbox)} requests are waiting for the model; try "
                           "again shortly")
            self.inbox.append(request)
            self.wake.notify()
        return request

    def drain(self):
        """Step in this thread until every submitted request is done (evaluations, RL)."""
        while self.step():
            pass

    def start(self, warm_up=False):
        """Serve from a thread of its own (a server): from now on only it touches the
        state. With warm_up it first compiles every program (then sets `warmed`);
        requests wait."""
        self.running = True

        def run():
            if warm_up:
                self.warm_up()
                self.warmed.set()
            self.serve_forever()
        self.thread = threading.Thread(target=run, daemon=True, name="engine")
        self.thread.start()

    def stop(self, timeout=2.0):
        """End start()'s thread after its round, the device calls it started done, waiting
        `timeout` seconds at most (a warm-up is not cut short). A process exiting while that
        thread waits for the device aborts ("FATAL: exception not rethrown")."""
        with self.wake:
            self.running = False
            self.wake.notify()
        if self.thread is not None:
            self.thread.join(timeout)

    def serve_forever(self):
        while self.running:
            try:
                busy = self.step()
            except Exception as e:  # fail what it was serving, start afresh, serve on
                self.fail(e)
                continue
            # nothing to do: sleep until a request comes or stop() is called
            with self.wake:
                while not busy and not self.inbox and self.running:
                    self.wake.wait()
                    busy = bool(self.inbox)
        jax.block_until_ready(self.state)  # the chunk still in flight

    def fail(self, error):
        """Every request in a slot fails with `error`; the engine starts afresh."""
        name = type(error).__name__
        message = f"the engine failed ({name}: {error}) and started afresh"
        for request in {owner[0] for owner in self.owner if owner is not None}:
            request.fail(EngineError(message))
        self.reset()

    def step(self):
        """One round: admit waiting requests into free slots, start one chunk, hand out
        the tokens of the chunk before it. A chunk is in flight while the host hands
        out the last one's tokens: the device never waits for the host. What the host
        learns from a chunk (a choice ended, a calculator to run) therefore acts from
        the chunk after the next; the device already knows it (the slot is not live).
        False when there was nothing to do."""
        # 1. cancelled requests: their slots stop in the next chunk and are free after it
        for slot, owner in enumerate(self.owner):
            if owner is not None and owner[0].cancelled:
                self.release(slot)
                self.stopping.add(slot)
        # 2. waiting requests into free slots, their first tokens handed out (an idle
        # engine that other threads submit to waits for a burst's last)
        idle = self.in_flight is None and all(owner is None for owner in self.owner)
        if idle and self.thread is not None:
            self.settle()
        admitted = self.admit_waiting()
        busy = [slot for slot, owner in enumerate(self.owner) if owner is not None]
        last = self.in_flight
        self.in_flight = None
        if busy or self.stopping:
            self.in_flight = self.start_chunk(busy, ahead=last is not None)
        # 3. the tokens of the chunk before: its one copy to the host, step by step, slot
        # by slot (a slot cancelled since has no owner)
        if last is not None:
            self.hand_out(np.asarray(last))
        return admitted or last is not None or self.in_flight is not None

    def settle(self):
        """Wait until the waiting line stops growing: BURST_QUIET seconds without a new
        request, BURST_MOST at most, so that requests sent together start together."""
        end = time.monotonic() + BURST_MOST
        with self.wake:
            seen = len(self.inbox)
            while seen and time.monotonic() < end:
                self.wake.wait(min(BURST_QUIET, end - time.monotonic()))
                if len(self.inbox) == seen:
                    return
                seen = len(self.inbox)

    def start_chunk(self, busy, ahead):
        """Start one chunk over the fewest rows that hold every busy slot, the cache as
        far as the slots may reach in it (ahead: a chunk is in flight): its records, on
        the device."""
        highest = max(busy, default=0)
        rows = min(r for r in self.row_buckets if r > highest)
        view = self.view(busy, rows, self.kmax if ahead else 0)
        cancel = np.zeros(self.slots, bool)
        cancel[list(self.stopping)] = True
        logprobs = any(self.owner[slot][0].sampling.logprobs for slot in busy)
        control = {"steps": np.int32(self.kmax),
                   "exit_on_done": np.bool_(len(self.inbox) > 0),
                   "cancel": cancel,
                   "pages": self.pool.table.copy(),  # the host's own changes after the call
                   "python": self.python,
                   "logprobs": np.bool_(logprobs)}
        self.state, records = self.chunk_call(decode_chunk, self.state, control, rows, view)
        self.stopping.clear()
        self.stats["calls"] += 1
        self.stats["chunks"] += 1
        return records

    def hand_out(self, records):
        """A chunk's records (kmax, rows, W) to their slots' requests, one wake-up a
        request."""
        steps, slots = np.nonzero(records[:, :, 0] >= 0)
        owners = [self.owner[slot] for slot in set(slots.tolist())]
        readers = {owner[0] for owner in owners if owner is not None}
        for i, slot in zip(steps.tolist(), slots.tolist()):
            self.take(slot, records[i, slot])
        for request in readers:
            request.flush()

    def view(self, busy, rows, ahead=0):
        """How far into the cache a chunk of `rows` rows reads: the first of its views that
        holds every busy slot's tokens and `ahead` more, those of a chunk in flight (the
        chunk's new ones are its own)."""
        reach = 0
        for slot in busy:
            request, choice = self.owner[slot]
            reach = max(reach, len(request.prompt) + len(request.tokens[choice]) + ahead)
        return min((v for v in self.views[rows] if v >= reach), default=self.cfg.sequence_len)

    def admit_waiting(self):
        """Start waiting requests, first come first served, while their choices find
        free slots; their prompts prefilled together, a call for each prompt bucket
        (prompt_rows); hand out each choice's first token. Whether any started."""
        S = self.cfg.sequence_len
        free = [slot for slot, owner in enumerate(self.owner)
                if owner is None and slot not in self.stopping]
        taken = collections.defaultdict(list)  # prompt bucket -> [(request, slots, first)]
        while True:
            # 1. the first request in line, if it fits (a cancelled one leaves the line)
            with self.wake:
                if not self.inbox:
                    break
                request = self.inbox[0]
                count = min(request.n - request.started, self.choices)
                need = self.pool.pages_for(len(request.prompt) + request.sampling.max_tokens)
                if not request.cancelled and (len(free) < count
                                              or len(self.pool.free) < count * need):
                    break
                if request.cancelled or request.started + count == request.n:
                    self.inbox.popleft()
            if request.cancelled:
                continue
            # 2. its next choices into the lowest free slots
            slots, free = free[:count], free[count:]
            first = request.started
            request.started += count
            for choice, slot in enumerate(slots, first):
                self.owner[slot] = (request, choice)
                self.pool.take(slot, need)
            self.stats["pages_peak"] = max(self.stats["pages_peak"], self.pool.in_use())
            taken[kvcache.prompt_bucket(S, len(request.prompt))].append((request, slots, first))
        # 3. one call for each bucket's prompts, as many as its largest row count holds
        started = []
        for T, entries in taken.items():
            most = self.prompt_rows(T)[-1]
            for i in range(0, len(entries), most):
                group = entries[i:i + most]
                arrays = self.request_arrays(T, group)
                self.state, records = self.admit_call(admit, self.state, arrays)
                self.stats["calls"] += 1
                self.stats["admits"] += 1
                started.append((group, records))
        # 4. each call's first tokens to the host as it ends, the later calls still running
        # (all started above): a burst's first replies begin before its last prefill
        for group, records in started:
            records = np.asarray(records)
            slots = [slot for _, slots, _ in group for slot in slots]
            for slot, record in zip(slots, records):
                self.take(slot, record)
            for request, _, _ in group:
                request.flush()
        return bool(started)

    def request_arrays(self, T, group):
        """admit's request for a group of (request, its slots, its first choice there),
        prompts of bucket T: numpy values of fixed dtypes (a new value never
        recompiles), the prompts padded to a row count P of prompt_rows(T), the choices
        to as many as P prompts can start."""
        S = self.cfg.sequence_len
        P = min(rows for rows in self.prompt_rows(T) if rows >= len(group))
        prompts = {"prompt": np.zeros((P, T), np.int32),  # each padded at the end
                   "length": np.ones(P, np.int32),
                   "seed": np.zeros(P, np.uint32),
                   "temperature": np.zeros(P, np.float32),
                   "top_k": np.zeros(P, np.int32),
                   "top_p": np.ones(P, np.float32),
                   "budget": np.zeros(P, np.int32),
                   "stops": np.full((P, MAX_STOPS), -1, np.int32)}
        # as many choices as P prompts can start; slot B, out of range, for the rows past
        # the choices: writes nothing
        N = min(self.slots, P * self.choices)
        choices = {"row": np.zeros(N, np.int32),
                   "choice": np.zeros(N, np.int32),
                   "slots": np.full(N, self.slots, np.int32),
                   "pages": np.zeros((N, S // self.page), np.int32)}
        j = 0
        for p, (request, slots, first) in enumerate(group):
            n = len(request.prompt)
            sampling = request.sampling
            prompts["prompt"][p, :n] = request.prompt
            prompts["length"][p] = n
            prompts["seed"][p] = sampling.seed % 2**32
            prompts["temperature"][p] = sampling.temperature
            prompts["top_k"][p] = sampling.top_k
            prompts["top_p"][p] = sampling.top_p
            prompts["budget"][p] = min(sampling.max_tokens, S - n)
            prompts["stops"][p, :len(sampling.stop_ids)] = sampling.stop_ids
            for choice, slot in enumerate(slots, first):
                choices["row"][j] = p
                choices["choice"][j] = choice
                choices["slots"][j] = slot
                choices["pages"][j] = self.pool.table[slot]
                j += 1
        logprobs = any(request.sampling.logprobs for request, _, _ in group)
        return {**prompts, **choices, "n": np.int32(j), "logprobs": np.bool_(logprobs)}

    def release(self, slot):
        """A slot's request is done with it: the slot and its pages are free (its page
        table points at the null page)."""
        self.owner[slot] = None
        self.pool.release(slot)

    def prompt_rows(self, T):
        """The prompt counts one admit call prefills at bucket T, an admit program each:
        1, 4, 16 up to the slots, as many as hold at most two contexts of tokens (one
        prompt always)."""
        rows = [r for r in (1, 4, 16) if r <= self.slots and r * T <= 2 * self.cfg.sequence_len]
        return rows or [1]

    def take(self, slot, record):
        """Hand one record of a slot to its request: the token, the calculator, the end."""
        token = int(record[0])
        flags = int(record[1])
        if token < 0 or self.owner[slot] is None:  # idle, or cancelled meanwhile
            return
        request, choice = self.owner[slot]
        self.stats["tokens"] += 1
        # 1. the token, with its log-probabilities when asked (floats sent as their bits)
        logprobs = None
        if request.sampling.logprobs:
            floats = record[2:].view(np.float32)
            ids = record[3:3 + TOP_LOGPROBS].tolist()
            likeliest = list(zip(ids, floats[1 + TOP_LOGPROBS:].tolist()))
            logprobs = (float(floats[0]), likeliest)
        mask = 0 if flags & FORCED else 1
        request.add(Event(choice, token, mask, logprobs))
        # 2. the tool sees every token; its ids are forced after a closed python block
        forced = []
        if request.tool is not None:
            forced = request.tool(choice, token)
        # 3. the choice's end frees its slot
        if flags & DONE:
            finish = "stop" if token in request.sampling.stop_ids else "length"
            request.add(Event(choice, finish=finish))
            self.release(slot)
        elif flags & CLOSES:
            self.resume(slot, forced)

    def resume(self, slot, forced):
        """The calculator's output (none: sampling resumes) queued for a waiting slot."""
        S = self.cfg.sequence_len
        n = min(len(forced), S)
        ids = np.zeros(S, np.int32)
        ids[:n] = forced[:n]
        self.state = resume(self.state, np.int32(slot), ids, np.int32(n))
        self.stats["calls"] += 1
        self.stats["hops"] += 1

    def idle_control(self, slots):
        """The control of a decode call over `slots` slots that decodes nothing: no step,
        no slot's page."""
        return {"steps": np.int32(0),
                "exit_on_done": np.bool_(False),
                "cancel": np.zeros(slots, bool),
                "pages": np.zeros((slots, self.cfg.sequence_len // self.page), np.int32),
                "python": self.python,
                "logprobs": np.bool_(False)}

    def admit_call(self, program, state, arrays):
        """admit (or its .lower) on `state` with this engine's weights and settings."""
        return program(self.layered, state, arrays, self.python, cfg=self.cfg, attn=self.attn,
                       paged=self.paged)

    def chunk_call(self, program, state, control, rows, view):
        """decode_chunk (or its .lower) on `state` with this engine's weights and
        settings, its first `rows` slots read up to `view`."""
        return program(self.layered, state, control, cfg=self.cfg, attn=self.attn, rows=rows,
                       view=view, kmax=self.kmax, paged=self.paged)

    def decode_work(self, slots):
        """The bytes the largest decode call of an engine of `slots` slots (every slot,
        the whole context) needs beyond its arguments, by the device compiler's count
        (runtime.needed_bytes): where a chunk gathers the paged layers' pages, they are
        most of it."""
        state = state_shapes(self.cfg, slots, self.kv_cache,
                             self.pages if self.paged else None, self.page)
        control = self.idle_control(slots)
        lowered = self.chunk_call(decode_chunk.lower, state, control, slots,
                                  self.cfg.sequence_len)
        arguments = kvcache.tree_bytes((self.layered, state, control))
        return runtime.needed_bytes(lowered, arguments) - arguments

    def warm_up(self):
        """Compile and run once every program a request can need: each prompt bucket's
        admit for each prompt count, each chunk of a row count and a view, resume; each
        called so that it changes nothing a request reads (an admit that starts no
        choice, a chunk's step whose slots' values are put back, a resume of slot B, out
        of range). A host of many cores compiles them in WARM_UP_THREADS threads first."""
        S = self.cfg.sequence_len
        # the programs: admit for each bucket and prompt count, a chunk of each row count
        # and view (one step of live slots: a program's first run costs more than the next,
        # 0.17 s at 16 rows of d6 on a CPU), resume
        admits = []
        for T in sorted({kvcache.prompt_bucket(S, n) for n in range(1, S)}):
            for P in self.prompt_rows(T):
                empty = Request([0] * T, Sampling(max_tokens=1), 1, None, False)
                admits.append(self.request_arrays(T, [(empty, [], 0)] * P))
        chunks = [(rows, view) for rows in self.row_buckets for view in self.views[rows]]
        control = {**self.idle_control(self.slots), "steps": np.int32(1)}
        nothing = np.zeros(S, np.int32)
        # 1. compiled in threads, where the host has cores to spare: jax keeps each program
        # by its lowering, and the runs below find it
        calls = ([functools.partial(self.admit_call, admit.lower, self.state, arrays)
                  for arrays in admits]
                 + [functools.partial(self.chunk_call, decode_chunk.lower, self.state, control,
                                      rows, view) for rows, view in chunks])
        if WARM_UP_THREADS > 1:
            with concurrent.futures.ThreadPoolExecutor(WARM_UP_THREADS) as pool:
                list(pool.map(lambda lower: lower().compile(), calls))
        # 2. each run once, in turn
        for arrays in admits:
            self.state, _ = self.admit_call(admit, self.state, arrays)
        # (a chunk's slots' values are put back after; the token each wrote lies where no
        # request reads: position 0 of an empty slot, the null page, as a finished request's)
        for rows, view in chunks:
            before = jax.tree.map(jnp.copy, per_slot(self.state))
            self.state = {**self.state, "live": jnp.ones(self.slots, bool),
                          "left": jnp.ones(self.slots, jnp.int32)}
            self.state, _ = self.chunk_call(decode_chunk, self.state, control, rows, view)
            layers = self.state["cache"]["layers"]
            self.state = {**before, "cache": {**before["cache"], "layers": layers}}
        self.state = resume(self.state, np.int32(self.slots), nothing, np.int32(0))
        jax.block_until_ready(self.state)
