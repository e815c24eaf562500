"""Train nanochat in JAX: base pretraining, SFT and RL, one jitted step, checkpoints that resume bit for bit.

    python train.py                      # the default pipeline on the embedded corpus: tokenizer -> base -> SFT -> RL
    python train.py --stage base --depth 6 --data 'shards/*.parquet' ...

- `train_step`: forward, backward (a `lax.scan` over micro-batches accumulates gradients) and the MuonAdamW update
  in one `jax.jit`, params and optimizer state donated. nanochat's schedules (lr warmup / warmdown to a final
  fraction, Muon momentum warmup / warmdown, cosine Muon weight decay) are computed inside from the traced step,
  so nothing recompiles. The horizon, batch size and lr scaling follow nanochat's rules (`horizon`).
- `train_loop`: the loop alone, over explicit values; it raises on a non-finite loss and on Ctrl-C (after saving).
  `base_stage` / `sft_stage` / `rl_stage` say what a stage starts from and trains on; `run_stage` wires one up with
  devices, data, evaluation and checkpoints (data.save_checkpoint, with the loader position, so --resume is exact).
- RL is nanochat's chat_rl: on-policy REINFORCE on the tasks' checkers (`rollout`, `rl_batch`): advantage = reward
  minus the mean of its group of samples, no KL, no ratio or clipping, the loss normalized per token (DAPO,
  arXiv 2503.14476). The same train step, the advantages as per-token weights; the sampling key is (seed, step).
- Data parallel with `jax.sharding` (a "data" mesh axis splits the batch, params replicated); multi-host through
  `jax.distributed.initialize`, each process packing its own shard of the documents.
- --debug runs the same step un-jitted with NaN checks, so print() and breakpoint() work inside the model.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import itertools
import json
import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import data
import evaluate
import muon
import nanochat as nc

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


def weighted_loss(params, cfg, inputs, targets, weights=None):
    """The mean cross-entropy over valid targets; with per-token weights (RL's advantages) sum(nll * w) / valid,
    nanochat's chat_rl objective with DAPO-style token-level normalization."""
    if weights is None:
        return nc.loss_fn(params, inputs, targets, cfg)
    nll = nc.loss_fn(params, inputs, targets, cfg, reduction="none")  # -log p of each sampled token
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(targets >= 0), 1)


def train_step(params, opt_state, batch, step, sched, lrs, cfg):
    """Forward, backward over A micro-batches and one MuonAdamW update; batch: (inputs, targets), int (A, B, T) each,
    plus RL's per-token weights (A, B, T)."""
    def micro(grads, b):
        loss, g = jax.value_and_grad(weighted_loss)(params, cfg, *b)
        return jax.tree.map(jnp.add, grads, g), loss

    grads, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), batch)
    grads = jax.tree.map(lambda g: g / batch[0].shape[0], grads)  # nanochat divides each micro-loss by A
    lrm, momentum, weight_decay = schedules(step, sched)
    labels, groups = nc.param_groups(params, lrm, momentum, weight_decay, muon_dtype=cfg.compute_dtype, **lrs)
    params, opt_state = muon.update(grads, opt_state, params, labels, groups)
    finite = jnp.isfinite(losses).all() & jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    return params, opt_state, {"loss": losses.mean(), "lrm": lrm, "finite": finite}


jit_train_step = jax.jit(train_step, static_argnames="cfg", donate_argnames=("params", "opt_state"))

# ------------------------------------------------------------------------------------------------ evaluation


def local(params):
    """This process's own replica of replicated params (what per-process evaluation and sampling run on)."""
    return jax.tree.map(lambda x: x.addressable_data(0), params)


# ------------------------------------------------------------------------------------------------ RL


def rollout(params, cfg, tok, conversation, key, num_samples, max_tokens, temperature=1.0, top_k=50,
            reward=data.check):
    """num_samples replies to a task conversation, sampled by the KV-cache engine with the calculator in the loop:
    (prompt + reply ids, masks: 1 on the sampled tokens, 0 on the prompt and the forced tool output, rewards:
    reward(conversation, decoded reply), 1.0 where the task's checker accepts it)."""
    prompt = data.render_for_completion(tok, conversation)
    replies, masks = evaluate.sample(params, cfg, tok, prompt, num_samples, max_tokens, temperature, top_k, key)
    return ([prompt + r for r in replies], [[0] * len(prompt) + m for m in masks],
            [float(reward(conversation, tok.decode(r))) for r in replies])


def rl_batch(groups, T):
    """(inputs, targets, weights), (P, G, T) each, of P groups of G rollouts (rows, masks, rewards): targets only on
    sampled tokens, each row weighted by its advantage, reward minus its group's mean (no std division)."""
    P, G = len(groups), len(groups[0][0])
    x, y, w = np.zeros((P, G, T), np.int32), np.full((P, G, T), -1, np.int32), np.zeros((P, G, T), np.float32)
    for i, (rows, masks, rewards) in enumerate(groups):
        r = np.asarray(rewards, np.float64)
        if not np.isfinite(r).all():
            raise FloatingPointError(f"rewards {rewards} are not all finite: a task's reward must be a number")
        for j, (row, mask) in enumerate(zip(rows, masks)):
            n = len(row) - 1
            x[i, j, :n], w[i, j] = row[:-1], r[j] - r.mean()
            y[i, j, :n] = np.where(np.asarray(mask[1:]) == 1, row[1:], -1)
    return x, y, w


def rl_tasks(args, tok, cfg):
    """{task: (train(step, count) -> that step's conversations, test() -> test conversations, reward, train size)}.
    Our tasks draw from streams seeded by (seed, step), so a resumed run samples the same prompts (size None); GSM8K
    walks its shuffled train split in order as nanochat's chat_rl, keeping the prompts that leave room to answer."""
    def ours(t):
        seeded = lambda step: data.task_conversations(t, "train", seed=f"{args.seed}/rl{step}")
        return (lambda step, count: list(itertools.islice(seeded(step), count)),
                lambda: data.task_conversations(t, "test"), data.check, None)
    out = {t: ours(t) for t in args.rl_tasks if t != "gsm8k"}
    if "gsm8k" in args.rl_tasks:
        if not args.chat_data:
            raise FileNotFoundError("--rl-tasks gsm8k reads GSM8K from --chat-data DIR (README: Evaluations)")
        fits = lambda c: len(data.render_for_completion(tok, c)) < cfg.sequence_len - 1
        train, test = ([c["messages"] for c in evaluate.load_chat_task(args.chat_data, "GSM8K", split)
                        if fits(c["messages"])] for split in ("train", "test"))
        if not train:
            raise ValueError(f"no GSM8K question fits in the model's context of {cfg.sequence_len} tokens")
        out["gsm8k"] = (lambda step, count: [train[(step * count + i) % len(train)] for i in range(count)],
                        lambda: iter(test), evaluate.gsm8k_correct, len(train))
    return out


def rl_prompts(tasks, step, n):
    """RL step `step`'s n (conversation, reward) pairs, round-robin over the tasks."""
    names = list(tasks)
    drawn = {t: iter(tasks[t][0](step, len(range(j, n, len(names))))) for j, t in enumerate(names)}  # interleaved
    return [(next(drawn[t]), tasks[t][2]) for t in (names[i % len(names)] for i in range(n))]


def evaluate_passk(params, cfg, tok, tasks, n, k, key, max_tokens):
    """nanochat's pass@k (any of the first k samples at temperature 1 correct) on n test conversations per task:
    {task: {"pass@1": ..., "pass@k": ...}}."""
    out = {}
    for t, (_, test, reward, _) in tasks.items():
        hits = [np.cumsum(rollout(params, cfg, tok, c, jax.random.fold_in(key, i), k, max_tokens, reward=reward)[2])
                > 0 for i, c in enumerate(itertools.islice(test(), n))]
        out[t] = {f"pass@{j}": float(np.mean([h[j - 1] for h in hits])) for j in sorted({1, k})}
    return out

# ------------------------------------------------------------------------------------------------ data across processes


def gather_states(states):
    """Every process's loader states, concatenated (a JSON round trip through process_allgather)."""
    if jax.process_count() == 1:
        return states
    blob = np.frombuffer(json.dumps(states).encode(), np.uint8)
    n = int(multihost_utils.process_allgather(np.array([blob.size])).max())
    padded = multihost_utils.process_allgather(np.pad(blob, (0, n - blob.size), constant_values=ord(" ")))
    return [s for row in padded for s in json.loads(bytes(row).decode())]

# ------------------------------------------------------------------------------------------------ the loop


@contextlib.contextmanager
def ctrl_c_flag():
    """Within it, Ctrl-C fills the yielded list instead of raising (a second one raises), for the loop to read where
    params, step and data position agree: a KeyboardInterrupt inside the step would leave donated buffers."""
    pressed = []  # the handler notes the press and puts back the one that raises
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(signal.signal(signal.SIGINT,
                                                                                    signal.default_int_handler)))
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def train_loop(params, opt_state, next_batch, states, step, sched, lrs, cfg, *, before_step=lambda *a: None,
               save=lambda *a: None, save_every=-1, stop=(), log=lambda record: None, debug=False):
    """Train from `step` to sched["num_iterations"]; returns (params, opt_state, the losses of this call).

    next_batch(params, step) -> (batch, data states after it) (RL samples it from the params); before_step(params,
    step, last) runs before each step and at the end; save(params, opt_state, step, states) -> its path, every
    save_every steps and at the end. Raises FloatingPointError on a non-finite loss, and KeyboardInterrupt (after
    saving) once `stop` is non-empty in any process."""
    steps, start, last_saved, losses, smooth = sched["num_iterations"], step, None, [], 0.0
    step_fn, flops, t_run = train_step if debug else jit_train_step, nc.estimate_flops(cfg), time.perf_counter()
    while True:
        last, pressed = step == steps, bool(stop)
        if jax.process_count() > 1:  # all stop if any was pressed: one saving while the others step would hang both
            pressed = bool(multihost_utils.process_allgather(np.array(pressed)).any())
        if pressed:
            saved = save(params, opt_state, step, states)
            raise KeyboardInterrupt(f"interrupted: saved {saved}; continue with --resume")
        before_step(params, step, last)
        if last or (save_every > 0 and step > 0 and step % save_every == 0):
            last_saved = save(params, opt_state, step, states)
        if last:
            return params, opt_state, losses
        batch, next_states = next_batch(params, step)
        t0 = time.perf_counter()
        with jax.disable_jit(debug), jax.debug_nans(debug):
            params, opt_state, m = step_fn(params, opt_state, batch, step, sched, lrs, cfg=cfg)
        loss, dt = float(m["loss"]), time.perf_counter() - t0
        if not bool(m["finite"]):
            saved = (f"the last good checkpoint is {last_saved} (--resume continues from it)" if last_saved else
                     "no checkpoint was saved yet (--save-every N saves one every N steps)")
            raise FloatingPointError(f"step {step}: loss {loss} is not finite; {saved}. Lower the learning rates")
        step, states = step + 1, next_states
        losses.append(loss)
        smooth = 0.9 * smooth + 0.1 * loss
        tps, eta = batch[0].size / dt, (steps - step) * (time.perf_counter() - t_run) / (step - start)
        print(f"step {step:5d}/{steps} | loss {smooth / (1 - 0.9 ** (step - start)):.4f} | lrm {float(m['lrm']):.3f} | "
              f"{dt * 1e3:.0f} ms | {tps:,.0f} tok/s | {tps * flops / 1e9:,.1f} GFLOP/s | eta {eta / 60:.1f} min",
              flush=True)
        log({"step": step, "loss": loss, "lrm": float(m["lrm"]), "dt": dt, "tokens": batch[0].size, "tok_per_s": tps})

# ------------------------------------------------------------------------------------------------ the stages


def horizon(args, cfg, rows_per_step, num_iterations):
    """nanochat's scaling rules: (num_iterations, tokens per step, batch lr scale, scaled Muon weight decay)."""
    n_scaling = lambda c: sum(nc.num_scaling_params(c)[k] for k in ("transformer_matrices", "lm_head"))
    target_tokens = args.target_param_data_ratio * n_scaling(cfg)
    d_ref = args.target_param_data_ratio * n_scaling(nc.config_for_depth(12, cfg.vocab_size))
    b_ref, batch = 2**19, args.total_batch_size
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


def start_from(args, stage, tok):
    """(params, cfg) of the newest checkpoint of `stage`, which must have been trained with this run's tokenizer."""
    path = data.latest_checkpoint(args.out, (stage,))
    if path is None:
        raise FileNotFoundError(f"no {stage} checkpoint under {args.out}/{stage}: run `python train.py --stage "
                                f"{stage}` first")
    params, _, meta = data.load_checkpoint(path, optimizer=False)
    if data.Tokenizer.load(os.path.join(path, meta["tokenizer"])).tokens != tok.tokens:
        raise ValueError(f"{path} was trained with another tokenizer than {args.out}/tokenizer.json; start from a "
                         "checkpoint of this --out, or train its stages again")
    return params, nc.config_from(meta["config"], os.path.join(path, "meta.json"))


def new_params(cfg, key):
    """nc.init_params compiled at LLVM's -O1, which halves its compile on a CPU, to the same bits (it runs once)."""
    return nc.init_params.lower(cfg, key).compile({"xla_backend_optimization_level": 1})(key)


def base_stage(args, tok, key):
    """Pretraining from fresh weights on the corpus: the model from the command line."""
    cfg = nc.config_for_depth(args.depth, tok.n_vocab, args.aspect_ratio, args.head_dim, sequence_len=args.max_seq_len,
                              window_pattern=args.window_pattern, compute_dtype=args.dtype if args.dtype != "auto"
                              else "float32" if jax.default_backend() == "cpu" else "bfloat16")
    return dict(cfg=cfg, init=lambda: new_params(cfg, key), packer=data.pretrain_batches,
                docs=data.corpus(args.data, "train", seed=args.seed), iterations=args.num_iterations)


def sft_stage(args, tok, key):
    """SFT from the newest base checkpoint on the synthetic chat tasks (+ --sft-data) with a corpus document every
    --sft-text-every conversations, and nanochat's chat_sft schedule: 0.8x the lrs, no warmup, a linear warmdown
    over the last half to 0, no weight decay."""
    params, cfg = start_from(args, "base", tok)
    extra = [c for path in args.sft_data for c in data.load_conversations(path)]
    return dict(cfg=cfg, init=lambda: params, packer=data.sft_batches,
                docs=data.sft_mixture(args.seed, extra, data.corpus(args.data, "train", seed=args.seed),
                                      args.sft_text_every), iterations=args.sft_iterations, lr_frac=args.init_lr_frac,
                sched=dict(warmup_steps=0, warmdown_ratio=0.5, final_lr_frac=0.0, momentum=0.95, momentum_end=0.95,
                           momentum_warmup=300, weight_decay=0.0))


def rl_stage(args, tok, key):
    """RL from the newest SFT checkpoint, nanochat's chat_rl: each step samples --rl-samples replies to each of
    --rl-prompts task questions and takes one REINFORCE step (no KL, no ratio or clipping) on them; lrs --rl-lr-frac
    of the base lrs, decaying linearly to 0, no weight decay."""
    if jax.process_count() > 1:
        raise ValueError("the RL stage runs in one process (any number of its devices); run it without --coordinator")
    params, cfg = start_from(args, "sft", tok)
    tasks, G = rl_tasks(args, tok, cfg), args.rl_samples

    def next_batch(params, step, split):
        step_key = jax.random.fold_in(key, step)  # prompts and samples follow from (seed, step): resume is exact
        groups = [rollout(local(params), cfg, tok, c, jax.random.fold_in(step_key, i), G, args.rl_max_tokens,
                          reward=reward) for i, (c, reward) in enumerate(rl_prompts(tasks, step, args.rl_prompts))]
        T = min(cfg.sequence_len, nc._bucket(max(len(r) for g in groups for r in g[0])))  # few shapes: few compiles
        print(f"step {step + 1:5d} | reward {np.mean([g[2] for g in groups]):.3f}", flush=True)
        return jax.device_put(rl_batch(groups, T), split), []
    epoch = min((size for *_, size in tasks.values() if size), default=0) // args.rl_prompts  # nanochat: one
    if args.rl_iterations <= 0 and not epoch:
        raise ValueError("--rl-iterations -1 (one epoch) needs a dataset task: --rl-tasks gsm8k")
    return dict(cfg=cfg, init=lambda: params, next_batch=next_batch, tasks=tasks,
                iterations=args.rl_iterations if args.rl_iterations > 0 else epoch,
                lr_frac=args.rl_lr_frac, shape=f"{args.rl_prompts} prompts x {G} samples",
                sched=dict(warmup_steps=0, warmdown_ratio=1.0, final_lr_frac=0.0, momentum=0.95, momentum_end=0.95,
                           momentum_warmup=1, weight_decay=0.0))


STAGES = {"base": base_stage, "sft": sft_stage, "rl": rl_stage}


def run_stage(args, stage, tok):
    """Run a stage to its horizon (or on from its newest checkpoint): (params, cfg, this run's losses, info)."""
    s, out_dir = STAGES[stage](args, tok, jax.random.key(args.seed)), os.path.join(args.out, stage)
    cfg = dataclasses.replace(s["cfg"], attention=args.attention)  # a route forced for this machine, not saved
    T, rows = cfg.sequence_len, args.device_batch_size * jax.device_count()
    steps, batch, lr_scale, wd = horizon(args, cfg, rows, s["iterations"])
    if batch % (rows * T):
        raise ValueError(f"--total-batch-size {batch} must be a multiple of {rows * T} (device batch x devices x T)")
    sched, lrs = base_schedule(args, steps, lr_scale, wd)
    sched, lrs = {**sched, **s.get("sched", {})}, {k: v * s.get("lr_frac", 1.0) for k, v in lrs.items()}
    step, states = 0, None
    if args.resume and (found := data.load_newest(out_dir)):
        resume, params, opt_state, meta = found
        saved = dataclasses.replace(nc.config_from(meta["config"], resume), attention=cfg.attention)
        if saved != cfg:  # another --depth, --max-seq-len, ...: the weights would not fit the model
            raise ValueError(f"{resume} holds {saved}, but these flags make {cfg}: resume with the flags it was "
                             "trained with, or train into another --out")
        step, sched, lrs, states = meta["step"], meta["schedule"], meta["lrs"], meta["data_states"]
        print(f"resuming {resume} at step {step}")
    else:
        params = s["init"]()
        opt_state = muon.init(params, *nc.param_groups(params))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params, opt_state = jax.device_put((params, opt_state), NamedSharding(mesh, P()))  # replicated
    split = NamedSharding(mesh, P(None, "data"))
    if "next_batch" in s:  # RL: sampled from the params
        next_batch = functools.partial(s["next_batch"], split=split)
    else:
        batches, states = sharded_batches(args, tok, s, batch // (rows * T), T, split, states)
        next_batch = lambda *_: next(batches)
    shape = s.get("shape", f"{batch:,} tokens ({batch // (rows * T)} x {rows} x {T})")
    route = nc.attention_route(cfg.attention, jax.default_backend(), jnp.dtype(cfg.compute_dtype), T, cfg.head_dim)
    print(f"{stage}: {cfg}\n{nc.num_scaling_params(cfg)['total']:,} params, {sched['num_iterations']} steps of "
          f"{shape}, {jax.device_count()} devices, attention {route}, lr scale {lr_scale:.3f}, Muon wd "
          f"{sched['weight_decay']:.3g}")
    os.makedirs(out_dir, exist_ok=True)
    meta = {"stage": stage, "config": dataclasses.asdict(dataclasses.replace(cfg, attention="auto")),
            "tokenizer": "tokenizer.json", "schedule": sched,
            "lrs": lrs, "args": vars(args)}
    evals = {"val_bpb": None, "tokens": 0, "train_time": 0.0}

    def save(params, opt_state, step, states):
        info = {**meta, "step": step, "data_states": gather_states(states), "val_bpb": evals["val_bpb"]}
        if jax.process_index() == 0:  # tokenizer.json inside the atomic write: chat.py needs it beside the weights
            return data.save_checkpoint(out_dir, step, params, opt_state, info, args.keep, {"tokenizer.json": tok.save})
        return os.path.join(out_dir, f"step_{step:06d}")  # process 0's path: every process's message names it

    t = time.perf_counter()
    with open(os.path.join(out_dir, "metrics.jsonl") if jax.process_index() == 0 else os.devnull, "a") as f, \
            ctrl_c_flag() as stop, jax.set_mesh(mesh):  # the mesh: for splash attention's shard_map
        def log(record):
            f.write(json.dumps(record) + "\n")
            if "dt" in record and record["step"] > step + 1:  # the report's MFU; the first step also compiled
                evals["tokens"] += record["tokens"]
                evals["train_time"] += record["dt"]
        params, _, losses = train_loop(params, opt_state, next_batch, states, step, sched, lrs, cfg, stop=stop,
                                       before_step=evaluator(args, stage, tok, cfg, evals, log, s.get("tasks")),
                                       save=save, save_every=args.save_every, log=log, debug=args.debug)
    return params, cfg, losses, {**evals, "steps": sched["num_iterations"], "time": time.perf_counter() - t}


def sharded_batches(args, tok, s, A, T, split, states=None):
    """(global batches, (A, rows, T) inputs and targets split over the devices, this process's loader states) for
    stage set-up s: the documents are cut into --data-shards shards (default: one per process), each packed into
    its share of the rows; a checkpoint's states hold every shard's loader position, in shard order."""
    n_shards, rows = args.data_shards or jax.process_count(), args.device_batch_size * jax.device_count()
    if n_shards % jax.process_count() or rows % n_shards:
        raise ValueError(f"--data-shards {n_shards} must be a multiple of the {jax.process_count()} processes and "
                         f"divide the {rows} rows of a micro-batch")
    per_process = n_shards // jax.process_count()
    shards = range(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)
    states = [None] * per_process if states is None else states[shards.start:shards.stop]
    its = [s["packer"](tok, data.every_nth(s["docs"], r, n_shards), A * rows // n_shards, T, state)
           for r, state in zip(shards, states)]

    def batches():
        while True:
            parts = [next(it) for it in its]
            x, y = (np.concatenate([p[i].reshape(A, rows // n_shards, T) for p in parts], axis=1) for i in (0, 1))
            yield tuple(jax.make_array_from_process_local_data(split, a) for a in (x, y)), [p[2] for p in parts]
    return batches(), states


def evaluator(args, stage, tok, cfg, results, log, tasks=None):
    """The loop's before_step: val bits per byte every --eval-every steps, samples every --sample-every steps, RL's
    pass@k on its tasks before, after and every --rl-eval-every steps."""
    val_docs, token_bytes = data.corpus(args.data, "val"), jnp.asarray(tok.token_bytes())
    text = "The " if stage == "base" else "Who are you?"
    chat = [{"role": "user", "content": text}, {"role": "assistant", "content": "?"}]
    prompt = [tok.bos] + tok.encode(text) if stage == "base" else data.render_for_completion(tok, chat)

    def before_step(params, step, last):
        every = args.rl_eval_every > 0 and step % args.rl_eval_every == 0
        if stage == "rl" and args.rl_eval > 0 and (step == 0 or last or every):  # nanochat's pass@k
            results["pass@k" if last else "pass@k before" if step == 0 else f"pass@k {step}"] = r = evaluate_passk(
                local(params), cfg, tok, tasks, args.rl_eval, min(args.rl_samples, 8), jax.random.key(1),
                args.rl_max_tokens)  # nanochat samples 8 (its device batch) for pass@k
            print(f"step {step:5d} | {json.dumps(r)}")
            log({"step": step, "pass@k": r})
        if args.eval_every > 0 and (step % args.eval_every == 0 or last):
            val = data.pretrain_batches(tok, data.every_nth(val_docs, jax.process_index(), jax.process_count()),
                                        args.device_batch_size, cfg.sequence_len)
            results["val_bpb"] = evaluate.evaluate_bpb(local(params), cfg, val, token_bytes, args.eval_steps)
            print(f"step {step:5d} | val bpb {results['val_bpb']:.4f}")
            log({"step": step, "val_bpb": results["val_bpb"]})
            if last and stage != "base":  # docstring recall: held-out first sentences, without the docstring
                recall = data.sft_batches(tok, lambda _: data.recall_conversations("test"), args.device_batch_size,
                                          cfg.sequence_len)
                results["recall_bpb"] = evaluate.evaluate_bpb(local(params), cfg, recall, token_bytes,
                                                              args.eval_steps)
        if args.sample_every > 0 and step > 0 and (step % args.sample_every == 0 or last):
            sample = evaluate.completions(local(params), cfg, tok, prompt, 1, 24)[0]
            print(f"  sample: {text!r} -> {tok.decode(sample)!r}")
    return before_step

# ------------------------------------------------------------------------------------------------ command line


def get_tokenizer(args):
    """The run's tokenizer: --out/tokenizer.json, trained on the corpus's train split if it is not there yet."""
    path = os.path.join(args.out, "tokenizer.json")
    if os.path.isfile(path) and args.stage != "tokenizer":
        return data.Tokenizer.load(path)
    t = time.perf_counter()  # nanochat's tok_train: documents cropped to 10,000 characters
    tok = data.train_tokenizer(data.corpus(args.data, "train")(0), args.vocab_size,
                               max_chars=args.tokenizer_max_chars, doc_chars=10_000)
    os.makedirs(args.out, exist_ok=True)
    if jax.process_index() == 0:
        tok.save(path)
    print(f"tokenizer: vocab {tok.n_vocab} trained in {time.perf_counter() - t:.1f} s -> {path}")
    return tok


QUESTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "heldout_questions.jsonl")


RL_DEFAULTS = {"rl_iterations": (40, -1), "rl_prompts": (8, 16), "rl_samples": (8, 16), "rl_max_tokens": (64, 256),
               "rl_lr_frac": (0.02, 0.05), "rl_eval": (16, 400), "rl_eval_every": (0, 60)}  # ours | nanochat's


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag: one line, not the whole usage
        self.exit(2, f"error: {message} (python train.py --help lists every flag)\n")


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=HelpFormatter)
    a = p.add_argument
    a("--stage", default="all", choices=["all", "tokenizer", *STAGES], help="what to run (all: every stage)")
    a("--data", nargs="*", default=[], help=".txt/.jsonl/.parquet files, dirs or globs; none: the embedded corpus")
    a("--sft-data", nargs="*", default=[], help="extra SFT conversations, CustomJSON .jsonl files")
    a("--sft-text-every", type=int, default=8, help="a corpus document in SFT after every N conversations (0: none)")
    a("--questions", default=QUESTIONS, help="hand-written questions graded after SFT and RL ('': none)")
    a("--out", default="checkpoints", help="root directory of the tokenizer and checkpoints")
    a("--vocab-size", type=int, default=384, help="tokenizer vocab size, nanochat's 9 special tokens included")
    a("--tokenizer-max-chars", type=float, default=2e9, help="characters of the corpus the tokenizer trains on")
    g = p.add_argument_group("model (nanochat's depth dial; the defaults chosen by measurement, README)")
    g.add_argument("--depth", type=int, default=3, help="transformer layers; width and heads follow from it")
    g.add_argument("--aspect-ratio", type=int, default=32, help="width = depth x aspect ratio, in whole heads")
    g.add_argument("--head-dim", type=int, default=32, help="attention head size")
    g.add_argument("--max-seq-len", type=int, default=256, help="context length T of training and chat")
    g.add_argument("--window-pattern", default="L", help="e.g. SSSL: S = quarter context, L = full")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (auto: float32 on a CPU, bfloat16 on a GPU or TPU)")
    g.add_argument("--attention", default="auto", choices=nc.ATTENTION, help="attention route (auto: by backend, "
                   "shape; the startup line names it)")
    g = p.add_argument_group("horizon and batch")
    g.add_argument("--num-iterations", type=int, default=600, help="base steps (-1: from flops or ratio)")
    g.add_argument("--sft-iterations", type=int, default=1500, help="SFT steps")
    g.add_argument("--target-flops", type=float, default=-1.0, help="base training FLOPs (-1: use the ratio)")
    g.add_argument("--target-param-data-ratio", type=float, default=12.0, help="tokens per scaling parameter")
    g.add_argument("--device-batch-size", type=int, default=16, help="rows per device per micro-batch")
    g.add_argument("--total-batch-size", type=int, default=4096, help="tokens per step (-1: nanochat's auto rule)")
    g = p.add_argument_group("optimization (nanochat's defaults)")
    g.add_argument("--embedding-lr", type=float, default=0.3, help="AdamW lr of wte and the value embeddings")
    g.add_argument("--unembedding-lr", type=float, default=0.008, help="AdamW lr of lm_head")
    g.add_argument("--matrix-lr", type=float, default=0.02, help="Muon lr of the transformer's matrices")
    g.add_argument("--scalar-lr", type=float, default=0.5, help="AdamW lr of the per-layer residual scalars")
    g.add_argument("--batch-lr-scale", type=float, default=1.0, help="lr scale (-1: nanochat's sqrt(batch / 2^19))")
    g.add_argument("--weight-decay", type=float, default=0.28, help="Muon weight decay before nanochat's scaling")
    g.add_argument("--warmup-steps", type=int, default=40, help="base lr warmup steps (SFT: none)")
    g.add_argument("--warmdown-ratio", type=float, default=0.65, help="fraction of base steps of lr decay (SFT: 0.5)")
    g.add_argument("--final-lr-frac", type=float, default=0.05, help="base lr at the end, as a fraction (SFT: 0)")
    g.add_argument("--init-lr-frac", type=float, default=0.8, help="SFT lrs as a fraction of the base lrs")
    g = p.add_argument_group("RL (nanochat's chat_rl: REINFORCE with group-mean advantages)")
    rl = lambda flag, kind, what: g.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=what + (
        " (default {}; gsm8k: nanochat's {})".format(*RL_DEFAULTS[flag[2:].replace("-", "_")])))
    rl("--rl-iterations", int, "RL steps (-1: one epoch of the dataset)")
    rl("--rl-prompts", int, "task questions per step")
    rl("--rl-samples", int, "sampled replies per question (and k of pass@k)")
    rl("--rl-max-tokens", int, "most tokens sampled per reply")
    rl("--rl-lr-frac", float, "RL lrs / base lrs (README)")
    rl("--rl-eval", int, "test questions per task for pass@k before and after")
    rl("--rl-eval-every", int, "pass@k also every N steps (0: never)")
    g.add_argument("--rl-tasks", nargs="+", default=["spelling", "counting"], choices=[*data.TASKS, "gsm8k"],
                   help="reward tasks (gsm8k: GSM8K's train split from --chat-data)")
    g = p.add_argument_group("evaluation, checkpoints, debugging")
    g.add_argument("--eval-every", type=int, default=100, help="val bpb every N steps (0: never)")
    g.add_argument("--eval-steps", type=int, default=8, help="val batches per evaluation")
    g.add_argument("--eval-tasks", type=int, default=50, help="test conversations per chat task after SFT and RL")
    g.add_argument("--eval-bundle", default=None, help="nanochat's eval_bundle dir: CORE after base (README)")
    g.add_argument("--chat-data", default=None, help="dir of ARC, MMLU, GSM8K, HumanEval: ChatCORE after SFT, RL")
    g.add_argument("--eval-max", type=int, default=-1, help="at most N examples per CORE and ChatCORE task (-1: all)")
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
    g.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() on TPU pods, SLURM")
    args = p.parse_args(argv)
    for k, v in RL_DEFAULTS.items():  # the RL flags not given: ours, or nanochat's chat_rl on GSM8K
        setattr(args, k, getattr(args, k, v["gsm8k" in args.rl_tasks]))
    return args


HUGE_PAGES = "glibc.malloc.hugetlb=1"  # glibc >= 2.35: malloc madvises its memory onto transparent huge pages


def huge_pages_offered():
    """glibc 2.35+ (which reads the hugetlb tunable) on a kernel that offers transparent huge pages."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        glibc = tuple(map(int, os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")))  # "glibc 2.36"
        return glibc >= (2, 35) and "[never]" not in f.read()  # "always [madvise] never": always or on madvise
    return False


def setup_process(compile_cache, restart=False):
    """The persistent XLA compilation cache ('' for none), and glibc malloc set for XLA's CPU buffers: a step's
    temporaries are one block (0.6-1.7 GB here) that malloc maps afresh every step, for the kernel to fault back in.
    On transparent huge pages (glibc's hugetlb tunable) that is 2 MiB a fault, not 4 KiB; tunables are read when a
    process starts, so with restart (a script's main) it starts over once with them set. Without huge pages, malloc
    keeps one heap that never shrinks (as fast, 2-3x the memory). Each compile's freed memory is given back."""
    if compile_cache:
        jax.config.update("jax_compilation_cache_dir", compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (macOS, musl): nothing to tune
        return
    huge, tunables = huge_pages_offered(), os.environ.get("GLIBC_TUNABLES", "")
    if huge and restart and HUGE_PAGES not in tunables:
        os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, (tunables, HUGE_PAGES)))
        sys.stdout.flush(), sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    if not (huge and HUGE_PAGES in tunables):
        for option, value in ((-4, 0), (-1, -1), (-8, 1)):  # never mmap, never trim, one arena (no thread's heaps)
            libc.mallopt(option, value)
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: event == "/jax/core/compile/backend_compile_duration" and libc.malloc_trim(0))


def init_distributed(args):
    """Join the other processes of a multi-host run (--coordinator ... or --distributed); alone, do nothing."""
    if args.coordinator or args.distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts; GPUs and TPUs ignore it
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def main(argv=None):
    args = parse_args(argv)
    setup_process(args.compile_cache, restart=argv is None)
    init_distributed(args)
    t, tok, results = time.perf_counter(), get_tokenizer(args), {}
    questions = data.load_questions(args.questions) if args.questions and args.eval_tasks > 0 else ()
    bundle = evaluate.load_bundle(args.eval_bundle, args.eval_max) if args.eval_bundle else None  # read up front:
    chat_tasks = evaluate.load_chat_tasks(args.chat_data, args.eval_max) if args.chat_data else {}  # bad input fails
    rows = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))  # evaluation batches: the train mesh
    for stage in {"all": tuple(STAGES), "tokenizer": ()}.get(args.stage, (args.stage,)):
        params, cfg, losses, info = run_stage(args, stage, tok)
        r = results[stage] = dict(final_loss=losses[-1] if losses else None, minutes=info["time"] / 60,
                                  **{k: v for k, v in info.items() if k != "time"})
        if stage == "base" and bundle:
            r["core"] = dict(evaluate.evaluate_core(params, cfg, tok, bundle, rows), data=args.eval_bundle)
        if stage != "base" and args.eval_tasks > 0:
            r["tasks"], r["questions"] = evaluate.evaluate_tasks(local(params), cfg, tok, args.eval_tasks, questions)
        if stage != "base" and chat_tasks:
            r["chatcore"] = dict(evaluate.evaluate_chat(params, cfg, tok, chat_tasks, rows), data=args.chat_data)
        if jax.process_index() == 0:
            samples = evaluate.report_samples(local(params), cfg, tok, stage)
            evaluate.save_section(args.out, stage, dict(r, config=dataclasses.asdict(cfg), argv=argv or sys.argv[1:],
                                                        samples=samples))
            print(f"report card: {evaluate.write_report(args.out)}")
    results["total_minutes"] = (time.perf_counter() - t) / 60
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:  # bad input (a path, a size): one line, no traceback
        sys.exit(f"error: {e}")
    except (KeyboardInterrupt, FloatingPointError) as e:  # Ctrl-C, or training diverged: say where to go on from
        sys.exit(str(e) or "interrupted")
