"""Train nanochat in JAX: base pretraining and SFT, one jitted step, checkpoints that resume bit for bit.

    python train.py                      # the default pipeline on the embedded corpus: tokenizer -> base -> SFT -> eval
    python train.py --stage base --depth 6 --data 'shards/*.parquet' ...
    python train.py --help

- One `jax.jit` step does forward, backward (a `lax.scan` over micro-batches for gradient accumulation) and the
  MuonAdamW update, params and optimizer state donated. nanochat's schedules (LR warmup / warmdown to a final
  fraction, Muon momentum warmup / warmdown, cosine Muon weight decay) are computed inside from the traced step
  and traced schedule constants, so nothing recompiles after the first step.
- Horizon from --num-iterations, or nanochat's --target-flops / --target-param-data-ratio (12 by default; N =
  transformer matrices + lm_head).
- Checkpoints: msgpack params and optimizer state plus a JSON meta (config, step, data-loader position, PRNG key,
  tokenizer), written to a temp dir and renamed, the last few kept. The data position makes --resume exact.
- Data parallel over every device with `jax.sharding` (a "data" mesh axis, batch split, params replicated);
  multi-host through `jax.distributed.initialize`, each process reading its own slice of the documents.
- --debug runs the same step un-jitted with NaN checks, so print() and breakpoint() work inside the model.
"""

import argparse
import ctypes
import dataclasses
import functools
import itertools
import json
import math
import os
import re
import shutil
import signal
import sys
import time

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import data
import muon
import nanochat as nc

# ------------------------------------------------------------------------------------------------ checkpoints


def _to_host(x):
    """A numpy copy of an array; replicated multi-host arrays are read from this process's own replica."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def _pack(obj):
    if isinstance(obj, (np.ndarray, jax.Array, np.generic)):
        a = np.asarray(_to_host(obj), order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        return msgpack.ExtType(1, msgpack.packb([a.dtype.name, list(a.shape), a.tobytes()]))
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}")


def _unpack(code, payload):
    dtype, shape, raw = msgpack.unpackb(payload)
    return np.frombuffer(raw, np.dtype(dtype)).reshape(tuple(shape))


def save_tree(path, tree):
    """Write a nested dict of arrays as msgpack, atomically (temp file, fsync, rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(tree, default=_pack))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_tree(path):
    """Read a tree written by save_tree (arrays come back as read-only numpy views)."""
    with open(path, "rb") as f:
        return msgpack.unpackb(f.read(), ext_hook=_unpack, strict_map_key=False)


def checkpoint_dirs(root):
    """Step directories under root (e.g. checkpoints/base), oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, d) for d in os.listdir(root) if re.fullmatch(r"step_\d{6}", d))


def save_checkpoint(root, step, params, opt_state, meta, keep=3, files=None):
    """Write root/step_NNNNNN/{params,opt}.msgpack + meta.json (+ `files`: name -> writer(path)) via a temp dir, so
    a step directory is complete or absent; keep the newest `keep`."""
    final = os.path.join(root, f"step_{step:06d}")
    tmp = f"{final}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        save_tree(os.path.join(tmp, "params.msgpack"), params)
        if opt_state is not None:
            save_tree(os.path.join(tmp, "opt.msgpack"), opt_state)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        for name, write in (files or {}).items():
            write(os.path.join(tmp, name))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(final):  # re-saving a step: move the old one aside only now that the new one is complete
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoint_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path, optimizer=True):
    """(params, opt_state or None, meta) of a step directory written by save_checkpoint."""
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no meta.json); train one with train.py")
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    opt_path = os.path.join(path, "opt.msgpack")
    opt_state = load_tree(opt_path) if optimizer and os.path.isfile(opt_path) else None  # 2x the params' size
    return load_tree(os.path.join(path, "params.msgpack")), opt_state, meta


def latest_checkpoint(root="checkpoints", stages=("sft", "base")):
    """The newest step directory of the first stage that has one (SFT before base), or None."""
    for stage in stages:
        if dirs := checkpoint_dirs(os.path.join(root, stage)):
            return dirs[-1]
    return None

# ------------------------------------------------------------------------------------------------ the step


def schedules(step, s):
    """(lr multiplier, Muon momentum, Muon weight decay) at a traced step, from the schedule constants s."""
    n, warmup = s["num_iterations"], s["warmup_steps"]
    warmdown = jnp.round(s["warmdown_ratio"] * n)
    p = (n - step) / jnp.maximum(warmdown, 1)
    lrm = jnp.where(step < warmup, (step + 1) / jnp.maximum(warmup, 1),
                    jnp.where(step <= n - warmdown, 1.0, p + (1 - p) * s["final_lr_frac"]))
    f = step / s["momentum_warmup"]
    q = 1 - p  # progress through the warmdown
    momentum = jnp.where(step < s["momentum_warmup"], (1 - f) * s["momentum_start"] + f * s["momentum"],
                         jnp.where(step >= n - warmdown, (1 - q) * s["momentum"] + q * s["momentum_end"],
                                   s["momentum"]))
    weight_decay = s["weight_decay"] * 0.5 * (1 + jnp.cos(jnp.pi * step / n))
    return lrm, momentum, weight_decay


def train_step(params, opt_state, inputs, targets, step, sched, lrs, cfg):
    """Forward, backward over A micro-batches (inputs, targets: (A, B, T)) and one MuonAdamW update."""
    def micro(grads, batch):
        loss, g = jax.value_and_grad(nc.loss_fn)(params, *batch, cfg)
        return jax.tree.map(jnp.add, grads, g), loss

    grads, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), (inputs, targets))
    grads = jax.tree.map(lambda g: g / inputs.shape[0], grads)  # nanochat divides each micro-loss by A
    lrm, momentum, weight_decay = schedules(step, sched)
    labels, groups = nc.param_groups(params, lrm, momentum, weight_decay, muon_dtype=cfg.compute_dtype, **lrs)
    params, opt_state = muon.update(grads, opt_state, params, labels, groups)
    finite = jnp.isfinite(losses).all() & jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    return params, opt_state, {"loss": losses.mean(), "lrm": lrm, "finite": finite}


jit_train_step = jax.jit(train_step, static_argnames="cfg", donate_argnames=("params", "opt_state"))


@functools.partial(jax.jit, static_argnames="cfg")
def _bpb_sums(params, inputs, targets, token_bytes, cfg):
    nats = nc.loss_fn(params, inputs, targets, cfg, reduction="none")
    nbytes = jnp.where(targets >= 0, token_bytes[jnp.maximum(targets, 0)], 0)
    return jnp.sum(nats * (nbytes > 0)), jnp.sum(nbytes)


def local(params):
    """This process's own replica of replicated params (what per-process evaluation and sampling run on)."""
    return jax.tree.map(lambda x: x.addressable_data(0), params)


def evaluate_bpb(params, cfg, batches, token_bytes, steps):
    """nanochat's bits per byte: summed nats over summed bytes of the targets; specials count 0 bytes."""
    sums = np.zeros(2)
    for inputs, targets, _ in itertools.islice(batches, steps):
        sums += [float(x) for x in _bpb_sums(local(params), inputs, targets, token_bytes, cfg)]
    if jax.process_count() > 1:  # every process evaluated its own slice of the val documents
        sums = multihost_utils.process_allgather(sums).sum(0)
    return sums[0] / (math.log(2) * max(sums[1], 1))

# ------------------------------------------------------------------------------------------------ data


def loader(make, shards, states, A, rows, T):
    """Global batches (A, R, T) built from this process's data shards, each packing `rows` rows per micro-batch."""
    its = [make(shard, A * rows, state) for shard, state in zip(shards, states)]
    while True:
        parts = [next(it) for it in its]
        inputs = np.concatenate([x.reshape(A, rows, T) for x, _, _ in parts], axis=1)
        targets = np.concatenate([y.reshape(A, rows, T) for _, y, _ in parts], axis=1)
        yield inputs, targets, [s for _, _, s in parts]


def sft_mixture(seed, tasks=data.TASKS, extra=()):
    """epoch -> the synthetic chat tasks interleaved round-robin, plus any user conversations."""
    def conversations(epoch):
        yield from extra
        streams = [data.task_conversations(t, "train", seed=seed + 1000 * epoch) for t in tasks]
        for group in zip(*streams):
            yield from group
    return conversations


def every_nth(items, r, n):
    """epoch -> every n-th item from the r-th on: one data shard of n."""
    return lambda epoch: itertools.islice(items(epoch), r, None, n)


def gather_states(states):
    """Every process's loader states, concatenated (a JSON round trip through process_allgather)."""
    if jax.process_count() == 1:
        return states
    blob = np.frombuffer(json.dumps(states).encode(), np.uint8)
    n = int(multihost_utils.process_allgather(np.array([blob.size])).max())
    padded = multihost_utils.process_allgather(np.pad(blob, (0, n - blob.size), constant_values=ord(" ")))
    return [s for row in padded for s in json.loads(bytes(row).decode())]

# ------------------------------------------------------------------------------------------------ evaluation


def generate_ids(params, cfg, tok, prompt, max_tokens):
    """Greedy continuation ids of one prompt through the KV-cache engine, with the calculator tool."""
    out, stop = [], (tok.special["<|assistant_end|>"], tok.bos)
    for (t,), _ in nc.generate(params, cfg, prompt, max_tokens=max_tokens, key=jax.random.key(0), temperature=0.0,
                               stop_ids=stop, tool=data.calculator_tool(tok)):
        if t in stop:
            break
        out.append(t)
    return out


def evaluate_tasks(params, cfg, tok, n=50, seed=0, max_tokens=160):
    """Exact-match accuracy per synthetic task on n conversations of its held-out split."""
    acc = {}
    for task in data.TASKS:
        convs = list(itertools.islice(data.task_conversations(task, "test", seed=seed), n))
        hits = [data.check(c, tok.decode(generate_ids(params, cfg, tok, data.render_for_completion(tok, c),
                                                      max_tokens))) for c in convs]
        acc[task] = sum(hits) / len(hits)
    return acc


@functools.cache
def sgemm_peak():
    """FLOP/s of a 1024^2 fp32 matmul on the default device: the peak that MFU is measured against."""
    a = jnp.ones((1024, 1024), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    t = time.perf_counter()
    for _ in range(10):
        f(a).block_until_ready()
    return 10 * 2 * 1024**3 / (time.perf_counter() - t)

# ------------------------------------------------------------------------------------------------ a training run


def horizon(args, cfg, rows_per_step, num_iterations):
    """nanochat's scaling rules: (num_iterations, tokens per step, batch lr scale, scaled Muon weight decay)."""
    n_scaling = lambda c: sum(nc.num_scaling_params(c)[k] for k in ("transformer_matrices", "lm_head"))
    target_tokens = args.target_param_data_ratio * n_scaling(cfg)
    d_ref = args.target_param_data_ratio * n_scaling(nc.config_for_depth(12, cfg.vocab_size))
    b_ref = 2**19
    batch = args.total_batch_size
    if batch <= 0:  # Power Lines (arXiv 2505.13738): B_opt grows as D^0.383
        batch = max(2 ** round(math.log2(b_ref * (target_tokens / d_ref) ** 0.383)), rows_per_step * cfg.sequence_len)
    if num_iterations > 0:
        steps = num_iterations
    elif args.target_flops > 0:
        steps = round(args.target_flops / (nc.estimate_flops(cfg) * batch))
    else:
        steps = int(target_tokens) // batch
    lr_scale = (batch / b_ref) ** 0.5 if args.batch_lr_scale < 0 else args.batch_lr_scale
    return steps, batch, lr_scale, args.weight_decay * (batch / b_ref) ** 0.5 * d_ref / target_tokens


def base_schedule(args, steps, lr_scale, wd):
    """The pretraining step's schedule settings and learning rates (the train step's `sched` and `lrs`)."""
    sched = dict(num_iterations=steps, warmup_steps=args.warmup_steps, warmdown_ratio=args.warmdown_ratio,
                 final_lr_frac=args.final_lr_frac, momentum_start=0.85, momentum=0.97, momentum_end=0.90,
                 momentum_warmup=400, weight_decay=wd)
    lrs = dict(unembedding_lr=args.unembedding_lr * lr_scale, embedding_lr=args.embedding_lr * lr_scale,
               matrix_lr=args.matrix_lr * lr_scale, scalar_lr=args.scalar_lr * lr_scale)
    return sched, lrs


def train_stage(args, stage, tok, root):
    """Run one stage ("base" or "sft") to its horizon; returns (params, cfg, this run's losses, info)."""
    out_dir = os.path.join(root, stage)
    resume = latest_checkpoint(root, (stage,)) if args.resume else None
    if stage == "sft":
        base = latest_checkpoint(root, ("base",))
        if base is None:
            sys.exit(f"no base checkpoint under {root}/base: run `python train.py --stage base` first")
        base_params, _, base_meta = load_checkpoint(base, optimizer=False)
        cfg = nc.Config(**base_meta["config"])
    else:
        cfg = nc.config_for_depth(args.depth, tok.n_vocab, args.aspect_ratio, args.head_dim,
                                  sequence_len=args.max_seq_len, window_pattern=args.window_pattern,
                                  compute_dtype=args.dtype)
    T = cfg.sequence_len
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "data"))
    n_shards = args.data_shards or jax.process_count()
    if n_shards % jax.process_count() or (args.device_batch_size * jax.device_count()) % n_shards:
        sys.exit(f"--data-shards {n_shards} must be a multiple of the {jax.process_count()} processes and divide "
                 f"the {args.device_batch_size * jax.device_count()} rows of a micro-batch")
    rows = args.device_batch_size * jax.device_count()  # global rows per micro-batch
    num_iterations = args.sft_iterations if stage == "sft" else args.num_iterations
    steps, batch, lr_scale, wd = horizon(args, cfg, rows, num_iterations)
    if batch % (rows * T):
        sys.exit(f"--total-batch-size {batch} must be a multiple of device_batch_size x devices x T = {rows * T}")
    A = batch // (rows * T)
    sched, lrs = base_schedule(args, steps, lr_scale, wd)
    if stage == "sft":  # nanochat's chat_sft: 0.8x lrs, no warmup, linear warmdown over the last half to 0, no wd
        sched.update(warmup_steps=0, warmdown_ratio=0.5, final_lr_frac=0.0, momentum=0.95, momentum_end=0.95,
                     momentum_warmup=300, weight_decay=0.0)
        lrs = {k: v * args.init_lr_frac for k, v in lrs.items()}

    key = jax.random.key(args.seed)
    per_process = n_shards // jax.process_count()
    shards = [jax.process_index() * per_process + i for i in range(per_process)]
    states, step = [None] * per_process, 0
    if resume:
        params, opt_state, meta = load_checkpoint(resume)
        step, sched, lrs = meta["step"], meta["schedule"], meta["lrs"]  # the run's own horizon and lrs
        steps = sched["num_iterations"]
        states = meta["data_states"][shards[0]:shards[0] + per_process]
        key = jax.random.wrap_key_data(np.array(meta["key"], np.uint32))
        print(f"resuming {resume} at step {step}")
    else:
        params = base_params if stage == "sft" else nc.init_params(cfg, key)
        opt_state = muon.init(params, *nc.param_groups(params))
    params, opt_state = jax.device_put((params, opt_state), replicated)

    if stage == "sft":
        extra = [c for path in args.sft_data for c in data.load_conversations(path)]
        docs = sft_mixture(args.seed, extra=extra)
        make = lambda r, n, state: data.sft_batches(tok, every_nth(docs, r, n_shards), n, T, state)
    else:
        docs = data.corpus(args.data, "train", seed=args.seed)
        make = lambda r, n, state: data.pretrain_batches(tok, every_nth(docs, r, n_shards), n, T, state)
    batches = loader(make, shards, states, A, rows // n_shards, T)
    val_docs = data.corpus(args.data, "val")
    val = lambda: data.pretrain_batches(tok, every_nth(val_docs, jax.process_index(), jax.process_count()),
                                        args.device_batch_size, T)
    token_bytes = jnp.asarray(tok.token_bytes())

    flops, peak = nc.estimate_flops(cfg), sgemm_peak()
    total = nc.num_scaling_params(cfg)["total"]
    print(f"{stage}: {cfg}\n{total:,} params, {steps} steps of {batch:,} tokens ({A} x {rows} x {T}), "
          f"{jax.device_count()} devices, lr scale {lr_scale:.3f}, Muon wd {sched['weight_decay']:.3g}")
    step_fn = train_step if args.debug else jit_train_step
    os.makedirs(out_dir, exist_ok=True)
    log = open(os.path.join(out_dir, "metrics.jsonl") if jax.process_index() == 0 else os.devnull, "a")
    losses, smooth, last_saved, val_bpb, t_run, start_step = [], 0.0, resume, None, time.perf_counter(), step

    def save(step, states):
        nonlocal last_saved
        meta = {"stage": stage, "step": step, "config": dataclasses.asdict(cfg), "tokenizer": "tokenizer.json",
                "data_states": gather_states(states), "key": np.asarray(jax.random.key_data(key)).tolist(),
                "schedule": sched, "lrs": lrs, "val_bpb": val_bpb, "args": vars(args)}
        if jax.process_index() == 0:
            files = {"tokenizer.json": tok.save}  # inside the atomic write: chat.py needs it beside the weights
            last_saved = save_checkpoint(out_dir, step, params, opt_state, meta, args.keep, files)

    # Ctrl-C only sets a flag, read where params, step and data position agree (a KeyboardInterrupt inside the step
    # would save updated params under the old step, or donated buffers); a second Ctrl-C aborts at once
    stop = []

    def on_sigint(*_):
        stop.append(True)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    sigint = signal.signal(signal.SIGINT, on_sigint)
    try:
        while True:
            last = step == steps
            if stop:
                save(step, states)
                sys.exit(f"interrupted: saved {last_saved}; continue with --resume")
            if args.eval_every > 0 and (step % args.eval_every == 0 or last):
                val_bpb = evaluate_bpb(params, cfg, val(), token_bytes, args.eval_steps)
                print(f"step {step:5d} | val bpb {val_bpb:.4f}")
                log.write(json.dumps({"step": step, "val_bpb": val_bpb}) + "\n")
            if args.sample_every > 0 and step > 0 and (step % args.sample_every == 0 or last):
                for prompt in (["The "] if stage == "base" else []) + (["Who are you?"] if stage == "sft" else []):
                    ids = ([tok.bos] + tok.encode(prompt) if stage == "base" else
                           data.render_for_completion(tok, [{"role": "user", "content": prompt},
                                                            {"role": "assistant", "content": "?"}]))
                    print(f"  sample: {prompt!r} -> {tok.decode(generate_ids(local(params), cfg, tok, ids, 24))!r}")
            if last or (args.save_every > 0 and step > 0 and step % args.save_every == 0):
                save(step, states)
            if last:
                break
            inputs, targets, next_states = next(batches)
            t0 = time.perf_counter()
            inputs, targets = (jax.make_array_from_process_local_data(split, a) for a in (inputs, targets))
            with jax.disable_jit(args.debug), jax.debug_nans(args.debug):
                params, opt_state, m = step_fn(params, opt_state, inputs, targets, step, sched, lrs, cfg=cfg)
            loss = float(m["loss"])
            dt = time.perf_counter() - t0
            if not bool(m["finite"]):
                saved = (f"the last good checkpoint is {last_saved} (--resume continues from it)" if last_saved else
                         "no checkpoint was saved yet (--save-every N saves one every N steps)")
                sys.exit(f"step {step}: loss {loss} is not finite; {saved}. Lower the learning rates")
            step, states = step + 1, next_states
            losses.append(loss)
            smooth = 0.9 * smooth + 0.1 * loss
            debiased = smooth / (1 - 0.9 ** (step - start_step))
            tps = batch / dt
            eta = (steps - step) * (time.perf_counter() - t_run) / (step - start_step)
            print(f"step {step:5d}/{steps} | loss {debiased:.4f} | lrm {float(m['lrm']):.3f} | {dt * 1e3:.0f} ms | "
                  f"{tps:,.0f} tok/s | MFU {100 * tps * flops / peak:.1f}% | eta {eta / 60:.1f} min", flush=True)
            log.write(json.dumps({"step": step, "loss": loss, "lrm": float(m["lrm"]), "dt": dt, "tok_per_s": tps})
                      + "\n")
    finally:
        signal.signal(signal.SIGINT, sigint)
        log.close()
    return params, cfg, losses, {"val_bpb": val_bpb, "steps": steps, "time": time.perf_counter() - t_run}

# ------------------------------------------------------------------------------------------------ main


def get_tokenizer(args, root):
    """The run's tokenizer: root/tokenizer.json, trained on the corpus's train split if it is not there yet."""
    path = os.path.join(root, "tokenizer.json")
    if os.path.isfile(path) and args.stage != "tokenizer":
        return data.Tokenizer.load(path)
    def capped(docs, total=0):  # nanochat's tok_train: docs cropped to 10,000 chars, 2e9 chars at most
        for doc in docs:
            if total >= args.tokenizer_max_chars:
                return
            total += len(doc[:10_000])
            yield doc[:10_000]

    t = time.perf_counter()
    tok = data.train_tokenizer(capped(data.corpus(args.data, "train")(0)), args.vocab_size)
    os.makedirs(root, exist_ok=True)
    if jax.process_index() == 0:
        tok.save(path)
    print(f"tokenizer: vocab {tok.n_vocab} trained in {time.perf_counter() - t:.1f} s -> {path}")
    return tok


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    a = p.add_argument
    a("--stage", default="all", choices=["all", "tokenizer", "base", "sft"], help="what to run (all: every stage)")
    a("--data", nargs="*", default=[], help=".txt/.jsonl/.parquet files, dirs or globs; none: the embedded corpus")
    a("--sft-data", nargs="*", default=[], help="extra SFT conversations, CustomJSON .jsonl files")
    a("--out", default="checkpoints", help="root directory of the tokenizer and checkpoints")
    a("--vocab-size", type=int, default=384, help="tokenizer vocab size, nanochat's 9 special tokens included")
    a("--tokenizer-max-chars", type=float, default=2e9, help="characters of the corpus the tokenizer trains on")
    g = p.add_argument_group("model (nanochat's depth dial; the defaults are the 'nano' preset)")
    g.add_argument("--depth", type=int, default=4, help="transformer layers; width and heads follow from it")
    g.add_argument("--aspect-ratio", type=int, default=32, help="width = depth x aspect ratio, in whole heads")
    g.add_argument("--head-dim", type=int, default=32, help="attention head size")
    g.add_argument("--max-seq-len", type=int, default=256, help="context length T of training and chat")
    g.add_argument("--window-pattern", default="L", help="e.g. SSSL: S = quarter context, L = full")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    g = p.add_argument_group("horizon and batch")
    g.add_argument("--num-iterations", type=int, default=300, help="base steps (-1: from flops or ratio)")
    g.add_argument("--sft-iterations", type=int, default=120, help="SFT steps")
    g.add_argument("--target-flops", type=float, default=-1.0, help="base training FLOPs (-1: use the ratio)")
    g.add_argument("--target-param-data-ratio", type=float, default=12.0, help="tokens per scaling parameter")
    g.add_argument("--device-batch-size", type=int, default=16, help="rows per device per micro-batch")
    g.add_argument("--total-batch-size", type=int, default=4096, help="tokens per step (-1: nanochat's auto rule)")
    g = p.add_argument_group("optimization (nanochat's defaults)")
    g.add_argument("--embedding-lr", type=float, default=0.3, help="AdamW lr of wte and the value embeddings")
    g.add_argument("--unembedding-lr", type=float, default=0.008, help="AdamW lr of lm_head")
    g.add_argument("--matrix-lr", type=float, default=0.02, help="Muon lr of the transformer's matrices")
    g.add_argument("--scalar-lr", type=float, default=0.5, help="AdamW lr of the per-layer residual scalars")
    g.add_argument("--batch-lr-scale", type=float, default=1.0, help="multiplies every lr but the smear's; -1: "
                   "nanochat's sqrt(total batch / 2^19), for its recipes (1 trains the small default model faster)")
    g.add_argument("--weight-decay", type=float, default=0.28, help="Muon weight decay before nanochat's scaling")
    g.add_argument("--warmup-steps", type=int, default=40, help="base lr warmup steps (SFT: none)")
    g.add_argument("--warmdown-ratio", type=float, default=0.65, help="fraction of base steps of lr decay (SFT: 0.5)")
    g.add_argument("--final-lr-frac", type=float, default=0.05, help="base lr at the end, as a fraction (SFT: 0)")
    g.add_argument("--init-lr-frac", type=float, default=0.8, help="SFT lrs as a fraction of the base lrs")
    g = p.add_argument_group("evaluation, checkpoints, debugging")
    g.add_argument("--eval-every", type=int, default=100, help="val bpb every N steps (0: never)")
    g.add_argument("--eval-steps", type=int, default=8, help="val batches per evaluation")
    g.add_argument("--eval-tasks", type=int, default=50, help="held-out conversations per chat task after SFT")
    g.add_argument("--sample-every", type=int, default=100, help="print samples every N steps (0: never)")
    g.add_argument("--save-every", type=int, default=-1, help="checkpoint every N steps (-1: only the last)")
    g.add_argument("--keep", type=int, default=3, help="checkpoints kept per stage")
    g.add_argument("--resume", action="store_true", help="continue from the stage's newest checkpoint, exactly")
    g.add_argument("--seed", type=int, default=0, help="init, data order and SFT mixture seed")
    g.add_argument("--debug", action="store_true", help="run the step un-jitted with NaN checks (print works)")
    g.add_argument("--compile-cache", default=os.path.expanduser("~/.cache/nanochat_jax/xla"),
                   help="persistent XLA compilation cache ('' to disable)")
    g = p.add_argument_group("scale out")
    g.add_argument("--data-shards", type=int, default=0, help="document shards (0: one per process)")
    g.add_argument("--coordinator", default=None, help="host:port of process 0, for multi-host jax.distributed")
    g.add_argument("--num-processes", type=int, default=None, help="processes of a --coordinator run")
    g.add_argument("--process-id", type=int, default=None, help="this process's rank, 0 to --num-processes - 1")
    g.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() from the environment "
                   "(TPU pods, SLURM)")
    return p.parse_args(argv)


def setup_process(compile_cache):
    """Process-wide speed settings: the persistent XLA compilation cache ('' for none), and glibc malloc keeping freed
    memory. XLA on the CPU takes its buffers from malloc, and glibc maps every block of 32 MiB or more afresh and
    unmaps it on free, so each step page-faulted its large activations back in: 8,192 faults and 25 ms of system time
    per 32 MiB elementwise op (7 ms of work); a nano-char step took 190K faults and 2x its time. One heap that
    never shrinks reuses the memory (zero faults per step), for a higher peak RSS."""
    if compile_cache:
        jax.config.update("jax_compilation_cache_dir", compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune
        return
    libc.mallopt(-4, 0)  # M_MMAP_MAX: never mmap
    libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD: never give freed heap back
    libc.mallopt(-8, 1)  # M_ARENA_MAX: XLA's threads' own arenas would map and unmap their heaps


def init_distributed(args):
    """Join the other processes of a multi-host run (--coordinator ... or --distributed); alone, do nothing."""
    if args.coordinator or args.distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts; GPUs and TPUs ignore it
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def main(argv=None):
    args = parse_args(argv)
    setup_process(args.compile_cache)
    init_distributed(args)
    t = time.perf_counter()
    tok = get_tokenizer(args, args.out)
    results = {}
    for stage in {"all": ("base", "sft"), "tokenizer": (), "base": ("base",), "sft": ("sft",)}[args.stage]:
        params, cfg, losses, info = train_stage(args, stage, tok, args.out)
        results[stage] = {"val_bpb": info["val_bpb"], "final_loss": losses[-1] if losses else None,
                          "minutes": info["time"] / 60}
        if stage == "sft" and args.eval_tasks > 0:
            results["tasks"] = evaluate_tasks(local(params), cfg, tok, n=args.eval_tasks)
    results["total_minutes"] = (time.perf_counter() - t) / 60
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:  # bad input (a path, a size): one line, no traceback
        sys.exit(f"error: {e}")
