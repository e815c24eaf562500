"""Train nanochat in JAX: pretraining, SFT and RL in one jitted step; checkpoints resume exactly.

    python train.py                  # the default pipeline: tokenizer -> base -> SFT -> RL
    python train.py --stage base --depth 6 --data 'shards/*.parquet' ...

- `train_step`: forward, backward (a `lax.scan` over micro-batches sums the gradients) and the
  MuonAdamW update in one `jax.jit`, params and optimizer state donated. nanochat's schedules
  (lr warmup and warmdown to a final fraction, Muon momentum warmup and warmdown, cosine Muon
  weight decay) are computed inside from the traced step, so nothing recompiles. The horizon, the
  batch size and the lr scaling follow nanochat's rules (`horizon`).
- `train_loop`: the loop alone, over explicit values; it raises on a non-finite loss and, after
  saving, on Ctrl-C. `base_stage`, `sft_stage` and `rl_stage` say what a stage starts from and
  trains on; `run_stage` runs one with devices, data, evaluation and checkpoints (with the loader's
  position, so that --resume is exact).
- RL (rl.py) is the same train step, with per-token weights: the rollouts' advantages.
- Data parallel with `jax.sharding`: a "data" mesh axis splits the batch; --shard splits the
  optimizer state (the default on several devices) or it and the params (FSDP) over it too
  (sharding.py); --remat recomputes each block in the backward pass. Several hosts join through
  `jax.distributed.initialize`, each process packing its own shard of the documents.
- --debug runs the same step un-jitted with NaN checks, so print() and breakpoint() work inside.
"""

import argparse
import contextlib
import dataclasses
import functools
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
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpoint
import data
import evaluate
import kernels
import muon
import nanochat as nc
import report
import rl
import sharding
import tasks

# -------------------------------------------------------------------------------------- the step


def schedules(step, s):
    """(lr multiplier, Muon momentum, Muon weight decay) at a traced step, from the schedule s."""
    n, warmup = s["num_iterations"], s["warmup_steps"]
    warmdown = jnp.round(s["warmdown_ratio"] * n)
    p = (n - step) / jnp.maximum(warmdown, 1)
    decay = p + (1 - p) * s["final_lr_frac"]
    lrm = jnp.where(step < warmup, (step + 1) / jnp.maximum(warmup, 1),
                    jnp.where(step <= n - warmdown, 1.0, decay))
    f = step / s["momentum_warmup"]
    q = 1 - p  # progress through the warmdown
    warming = (1 - f) * s["momentum_start"] + f * s["momentum"]
    cooling = (1 - q) * s["momentum"] + q * s["momentum_end"]
    momentum = jnp.where(step < s["momentum_warmup"], warming,
                         jnp.where(step >= n - warmdown, cooling, s["momentum"]))
    weight_decay = s["weight_decay"] * 0.5 * (1 + jnp.cos(jnp.pi * step / n))
    return lrm, momentum, weight_decay


def weighted_loss(params, cfg, inputs, targets, weights=None, attn=nc.causal_attention,
                  remat=False):
    """The mean cross-entropy over valid targets; with per-token weights (RL's advantages)
    sum(nll * w) / valid, nanochat's chat_rl objective with DAPO's token-level normalization."""
    if weights is None:
        return nc.loss_fn(params, inputs, targets, cfg, attn=attn, remat=remat)
    nll = nc.loss_fn(params, inputs, targets, cfg, "none", attn, remat)  # -log p of each token
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(targets >= 0), 1)


def train_step(params, opt_state, batch, step, sched, lrs, cfg, attn=nc.causal_attention,
               remat=False, mesh=None, shard="none"):
    """Forward, backward over A micro-batches and one MuonAdamW update. batch: (inputs, targets),
    int (A, B, T) each, and RL's per-token weights (A, B, T); sched: `schedules`' constants; lrs:
    the base learning rates (`learning_rates`); attn: the model's attention (kernels.py); remat:
    recompute each block in the backward pass; mesh, shard: the state's layout (sharding.py)."""
    lrm, momentum, weight_decay = schedules(step, sched)
    labels, groups = nc.param_groups(params, lrm, momentum, weight_decay,
                                     muon_dtype=cfg.compute_dtype, **lrs)
    p_kind, o_kind = sharding.kinds(shard)

    def micro(grads, b):
        loss, g = jax.value_and_grad(weighted_loss)(params, cfg, *b, attn=attn, remat=remat)
        return sharding.constrain(jax.tree.map(jnp.add, grads, g), mesh, p_kind), loss

    grads, losses = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, params), batch)
    grads = jax.tree.map(lambda g: g / batch[0].shape[0], grads)  # nanochat divides each by A
    # (with a mesh) the gradients reduce-scattered, the params sliced to the state's layout, and
    # Muon's stacks split into whole matrices per device
    grads, params = (sharding.constrain(t, mesh, o_kind) for t in (grads, params))
    split = (1, None)
    if mesh is not None:
        split = (mesh.size, lambda stack: sharding.constrain(stack, mesh, "stack"))
    params, opt_state = muon.update(grads, opt_state, params, labels, groups, *split)
    params = sharding.constrain(params, mesh, p_kind)  # as they came in: no recompile
    opt_state = sharding.constrain(opt_state, mesh, o_kind)
    finite = jnp.isfinite(losses).all()
    finite &= jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    return params, opt_state, {"loss": losses.mean(), "lrm": lrm, "finite": finite}


jit_train_step = jax.jit(train_step, static_argnames=("cfg", "attn", "remat", "mesh", "shard"),
                         donate_argnames=("params", "opt_state"))


def horizon(cfg, rows_per_step, num_iterations=-1, total_batch_size=-1, target_flops=-1.0,
            target_param_data_ratio=12.0, batch_lr_scale=1.0, weight_decay=0.28):
    """nanochat's scaling rules: (steps, tokens per step, batch lr scale, scaled Muon weight decay).
    Steps: num_iterations if positive, else from target_flops, else target_param_data_ratio tokens
    per scaling parameter; total_batch_size -1 is nanochat's Power Lines rule (arXiv 2505.13738:
    B_opt grows as D^0.383), batch_lr_scale -1 its sqrt(batch / 2^19)."""
    def n_scaling(c):
        counts = nc.num_scaling_params(c)
        return counts["transformer_matrices"] + counts["lm_head"]
    target_tokens = target_param_data_ratio * n_scaling(cfg)
    d_ref = target_param_data_ratio * n_scaling(nc.config_for_depth(12, cfg.vocab_size))
    b_ref, batch = 2**19, total_batch_size
    if batch <= 0:
        batch = 2 ** round(math.log2(b_ref * (target_tokens / d_ref) ** 0.383))
        batch = max(batch, rows_per_step * cfg.sequence_len)
    if num_iterations > 0:
        steps = num_iterations
    elif target_flops > 0:
        steps = round(target_flops / (nc.estimate_flops(cfg) * batch))
    else:
        steps = int(target_tokens) // batch
    lr_scale = (batch / b_ref) ** 0.5 if batch_lr_scale < 0 else batch_lr_scale
    return steps, batch, lr_scale, weight_decay * (batch / b_ref) ** 0.5 * d_ref / target_tokens


def base_schedule(steps, weight_decay=0.0, warmup_steps=40, warmdown_ratio=0.65,
                  final_lr_frac=0.05):
    """The pretraining schedule's constants (train_step's `sched`), nanochat's momentum ramps."""
    return dict(num_iterations=steps, warmup_steps=warmup_steps, warmdown_ratio=warmdown_ratio,
                final_lr_frac=final_lr_frac, momentum_start=0.85, momentum=0.97,
                momentum_end=0.90, momentum_warmup=400, weight_decay=weight_decay)


def learning_rates(scale=1.0, embedding_lr=0.3, unembedding_lr=0.008, matrix_lr=0.02,
                   scalar_lr=0.5):
    """The base learning rates (train_step's `lrs`), each times scale."""
    return dict(unembedding_lr=unembedding_lr * scale, embedding_lr=embedding_lr * scale,
                matrix_lr=matrix_lr * scale, scalar_lr=scalar_lr * scale)

# -------------------------------------------------------------------------------------- the loop


@contextlib.contextmanager
def ctrl_c_flag():
    """Within it, Ctrl-C fills the yielded list instead of raising (a second one raises), for the
    loop to read where params, step and data position agree: a KeyboardInterrupt inside the step
    would leave donated buffers behind."""
    pressed = []

    def handler(*_):  # note the press, and put back the handler that raises
        pressed.append(signal.signal(signal.SIGINT, signal.default_int_handler))
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def train_loop(params, opt_state, next_batch, states, step, sched, lrs, cfg, *,
               attn=nc.causal_attention, before_step=lambda *a: None, save=lambda *a: None,
               save_every=-1, stop=(), log=lambda record: None, debug=False, layout=None,
               mesh=None):
    """Train from `step` to sched["num_iterations"]: (params, opt_state, this call's losses).

    next_batch(params, step) -> (batch, data states after it) (RL samples it from the params);
    before_step(params, step, last) runs before each step and at the end; save(params, opt_state,
    step, states) -> its path, every save_every steps and at the end. Raises FloatingPointError on
    a non-finite loss, and KeyboardInterrupt (after saving) once `stop` is non-empty anywhere.
    layout: train_step's remat, mesh and shard; mesh: the context mesh of each step (splash's
    shard_map reads it), not of before_step and next_batch, which may run on one device."""
    steps, start, last_saved, losses, smooth = sched["num_iterations"], step, None, [], 0.0
    step_fn, flops = train_step if debug else jit_train_step, nc.estimate_flops(cfg)
    t_run = time.perf_counter()
    while True:
        last, pressed = step == steps, bool(stop)
        if jax.process_count() > 1:  # all stop if one was pressed: one saving alone would hang
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
        context = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
        with jax.disable_jit(debug), jax.debug_nans(debug), context:
            params, opt_state, m = step_fn(params, opt_state, batch, step, sched, lrs, cfg=cfg,
                                           attn=attn, **(layout or {}))
        loss, dt = float(m["loss"]), time.perf_counter() - t0
        if not bool(m["finite"]):
            saved = (f"the last good checkpoint is {last_saved} (--resume continues from it)"
                     if last_saved else "no checkpoint was saved yet (--save-every N saves one "
                     "every N steps)")
            raise FloatingPointError(f"step {step}: loss {loss} is not finite; {saved}. Lower the "
                                     "learning rates")
        step, states = step + 1, next_states
        losses.append(loss)
        smooth = 0.9 * smooth + 0.1 * loss
        tps = batch[0].size / dt
        eta = (steps - step) * (time.perf_counter() - t_run) / (step - start)
        print(f"step {step:5d}/{steps} | loss {smooth / (1 - 0.9 ** (step - start)):.4f} | lrm "
              f"{float(m['lrm']):.3f} | {dt * 1e3:.0f} ms | {tps:,.0f} tok/s | "
              f"{tps * flops / 1e9:,.1f} GFLOP/s | eta {eta / 60:.1f} min", flush=True)
        log({"step": step, "loss": loss, "lrm": float(m["lrm"]), "dt": dt,
             "tokens": batch[0].size, "tok_per_s": tps})

# ------------------------------------------------------------------------------------ the stages


def model_config(vocab_size, depth=3, aspect_ratio=32, head_dim=32, max_seq_len=256,
                 window_pattern="L", dtype="auto"):
    """The model of a depth (nanochat's dial); dtype auto: float32 on a CPU, else bfloat16."""
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return nc.config_for_depth(depth, vocab_size, aspect_ratio, head_dim, sequence_len=max_seq_len,
                               window_pattern=window_pattern, compute_dtype=dtype)


def base_stage(cfg, documents, key, iterations=-1):
    """Pretraining from fresh weights on documents (epoch -> texts, data.corpus)."""
    return dict(cfg=cfg, init=lambda: kernels.init_params(cfg, key), packer=data.pretrain_batches,
                docs=documents, iterations=iterations)


def sft_stage(out, tok, documents, seed=0, conversations=(), text_every=8, iterations=1500,
              lr_frac=0.8):
    """SFT from the newest base checkpoint on the synthetic chat tasks (and user conversations)
    with a pretraining document every `text_every` conversations, and nanochat's chat_sft
    schedule: lr_frac of the lrs, no warmup, a linear warmdown over the last half to 0, no weight
    decay."""
    params, cfg = checkpoint.load_stage(out, "base", tok)
    mixture = tasks.sft_mixture(seed, list(conversations), documents, text_every)
    sched = dict(warmup_steps=0, warmdown_ratio=0.5, final_lr_frac=0.0, momentum=0.95,
                 momentum_end=0.95, momentum_warmup=300, weight_decay=0.0)
    return dict(cfg=cfg, init=lambda: params, packer=data.sft_batches, docs=mixture,
                iterations=iterations, lr_frac=lr_frac, sched=sched)


def plan(cfg, rows, iterations, lr_frac=1.0, overrides=None, *, total_batch_size=-1,
         target_flops=-1.0, target_param_data_ratio=12.0, batch_lr_scale=1.0, weight_decay=0.28,
         warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05, embedding_lr=0.3,
         unembedding_lr=0.008, matrix_lr=0.02, scalar_lr=0.5):
    """A stage's (sched, lrs, tokens per step, batch lr scale) from nanochat's rules (`horizon`),
    the pretraining schedule with the stage's `overrides`, and the base lrs times lr_frac."""
    steps, batch, lr_scale, wd = horizon(cfg, rows, iterations, total_batch_size, target_flops,
                                         target_param_data_ratio, batch_lr_scale, weight_decay)
    sched = {**base_schedule(steps, wd, warmup_steps, warmdown_ratio, final_lr_frac),
             **(overrides or {})}
    lrs = learning_rates(lr_scale, embedding_lr, unembedding_lr, matrix_lr, scalar_lr)
    return sched, {k: v * lr_frac for k, v in lrs.items()}, batch, lr_scale


def resume_or_init(stage, cfg, out_dir, resume, sched, lrs):
    """(step, params, opt_state, sched, lrs, loader states): the stage's newest checkpoint with
    resume (its schedule and position), else its initial params and fresh optimizer state."""
    if resume and (found := checkpoint.load_newest(out_dir)):
        path, params, opt_state, meta = found
        saved = checkpoint.config_from(meta["config"], path)
        if saved != cfg:  # another --depth, --max-seq-len, ...: the weights would not fit
            raise ValueError(f"{path} holds {saved}, but these flags make {cfg}: resume with the "
                             "flags it was trained with, or train into another --out")
        print(f"resuming {path} at step {meta['step']}")
        return meta["step"], params, opt_state, meta["schedule"], meta["lrs"], meta["data_states"]
    params = stage["init"]()
    return 0, params, muon.init(params, *nc.param_groups(params)), sched, lrs, None


def describe(name, cfg, sched, shape, attention, lr_scale, layout=""):
    """The startup line: the model, its size, the steps, the devices, the kernel, the layout."""
    route = kernels.route(attention, jax.default_backend(), jnp.dtype(cfg.compute_dtype),
                          cfg.sequence_len, cfg.head_dim)
    print(f"{name}: {cfg}\n{nc.num_scaling_params(cfg)['total']:,} params, "
          f"{sched['num_iterations']} steps of {shape}, {jax.device_count()} devices, attention "
          f"{route}, lr scale {lr_scale:.3f}, Muon wd {sched['weight_decay']:.3g}\n{layout}")


def stage_batches(tok, stage, A, rows, T, mesh, data_shards=0, states=None):
    """(next_batch(params, step), loader states): RL's sampled from the params, else packed."""
    split = NamedSharding(mesh, P(None, "data"))  # rows over the devices
    if "next_batch" in stage:
        return functools.partial(stage["next_batch"], split=split), states
    batches, states = sharding.sharded_batches(stage["packer"], tok, stage["docs"], A, rows, T,
                                              split, data_shards, states)
    return (lambda params, step: next(batches)), states


def run_stage(name, stage, tok, out, device_batch_size=16, optim=None, evals=None, resume=False,
              keep=3, save_every=-1, debug=False, data_shards=0, attention="auto", record=None,
              shard=None, remat=False):
    """Run a stage (base_stage, sft_stage, rl_stage) to its horizon, or on from its newest
    checkpoint under out/name: (params, cfg, this run's losses, info). optim: `plan`'s keyword
    values; evals: evaluate.during_training's; attention: a route of kernels.ROUTES; record: more
    to save in each checkpoint's meta (train.py: its flags); shard, remat: --shard, --remat."""
    cfg, out_dir = stage["cfg"], os.path.join(out, name)
    T, rows = cfg.sequence_len, device_batch_size * jax.device_count()
    sched, lrs, batch, lr_scale = plan(cfg, rows, stage["iterations"], stage.get("lr_frac", 1.0),
                                       stage.get("sched"), **(optim or {}))
    if rows < 1 or batch % (rows * T):  # (at least a row on each device of the mesh)
        raise ValueError(f"--total-batch-size {batch} must be a multiple of {rows * T} (device "
                         f"batch {device_batch_size}, at least 1, x devices x T)")
    step, params, opt_state, sched, lrs, states = resume_or_init(stage, cfg, out_dir, resume,
                                                                 sched, lrs)
    mesh = sharding.data_mesh()
    params, opt_state, shard = sharding.place(params, opt_state, mesh, shard)
    layout = dict(remat=remat, mesh=mesh if shard != "none" else None, shard=shard)
    next_batch, states = stage_batches(tok, stage, batch // (rows * T), rows, T, mesh,
                                       data_shards, states)
    shape = stage.get("shape", f"{batch:,} tokens ({batch // (rows * T)} x {rows} x {T})")
    describe(name, cfg, sched, shape, attention, lr_scale,
             sharding.describe(params, opt_state, jax.device_count(), shard))
    os.makedirs(out_dir, exist_ok=True)
    meta = {"stage": name, "config": dataclasses.asdict(cfg), "tokenizer": "tokenizer.json",
            "schedule": sched, "lrs": lrs, "args": record or {}}
    results = {"val_bpb": None, "tokens": 0, "train_time": 0.0}

    def save(params, opt_state, step, states):
        info = {**meta, "step": step, "data_states": checkpoint.gather_states(states),
                "val_bpb": results["val_bpb"]}
        params, opt_state = checkpoint.gather_tree((params, opt_state))  # every process joins
        if jax.process_index() == 0:  # the tokenizer inside the atomic write: chat.py needs it
            return checkpoint.save_checkpoint(out_dir, step, params, opt_state, info, keep,
                                              {"tokenizer.json": tok.save})
        return os.path.join(out_dir, f"step_{step:06d}")  # process 0's: every message names it

    t = time.perf_counter()
    metrics = os.path.join(out_dir, "metrics.jsonl") if jax.process_index() == 0 else os.devnull
    with open(metrics, "a") as f, ctrl_c_flag() as stop:
        def log(entry):
            f.write(json.dumps(entry) + "\n")
            if "dt" in entry and entry["step"] > step + 1:  # for MFU; the first step compiled
                results["tokens"] += entry["tokens"]
                results["train_time"] += entry["dt"]
        before = evaluate.during_training(name, tok, cfg, results, log, device_batch_size,
                                          stage_eval=stage.get("evaluate"), **(evals or {}))
        params, _, losses = train_loop(params, opt_state, next_batch, states, step, sched, lrs,
                                       cfg, attn=kernels.attention(attention), before_step=before,
                                       save=save, save_every=save_every, stop=stop, log=log,
                                       debug=debug, layout=layout, mesh=mesh)
    info = {**results, "steps": sched["num_iterations"], "time": time.perf_counter() - t}
    return params, cfg, losses, info

# ---------------------------------------------------------------------------------- command line

STAGES = ("base", "sft", "rl")
QUESTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata",
                         "heldout_questions.jsonl")
CACHE = os.path.expanduser("~/.cache/nanochat_jax/xla")
OPTIM = ("total_batch_size", "target_flops", "target_param_data_ratio", "batch_lr_scale",
         "weight_decay", "warmup_steps", "warmdown_ratio", "final_lr_frac", "embedding_lr",
         "unembedding_lr", "matrix_lr", "scalar_lr")  # the flags that are plan()'s keywords


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag: one line, not the whole usage
        self.exit(2, f"error: {message} (python train.py --help lists every flag)\n")


def add_run_flags(p):
    a = p.add_argument
    a("--stage", default="all", choices=["all", "tokenizer", *STAGES], help="what to run")
    a("--data", nargs="*", default=[], help=".txt/.jsonl/.parquet files, dirs, globs (none: ours)")
    a("--sft-data", nargs="*", default=[], help="more SFT conversations, CustomJSON .jsonl files")
    a("--sft-text-every", type=int, default=8, help="SFT: a document every N conversations")
    a("--questions", default=QUESTIONS, help="hand-written questions graded after SFT and RL")
    a("--out", default="checkpoints", help="root directory of the tokenizer and checkpoints")
    a("--vocab-size", type=int, default=384, help="tokenizer vocab size, its 9 specials included")
    a("--tokenizer-max-chars", type=float, default=2e9, help="characters the tokenizer reads")


def add_model_flags(p):
    a = p.add_argument_group("model (nanochat's depth dial)").add_argument
    a("--depth", type=int, default=3, help="transformer layers; width and heads follow from it")
    a("--aspect-ratio", type=int, default=32, help="width = depth x aspect ratio, in whole heads")
    a("--head-dim", type=int, default=32, help="attention head size")
    a("--max-seq-len", type=int, default=256, help="context length T of training and chat")
    a("--window-pattern", default="L", help="e.g. SSSL: S = a quarter of the context, L = all")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
      help="compute dtype (auto: float32 on a CPU, bfloat16 on a GPU or TPU)")
    a("--attention", default="auto", choices=kernels.ROUTES, help="attention kernel (kernels.py)")
    a("--remat", action="store_true", help="recompute each block in the backward: less memory")


def add_optim_flags(p):
    a = p.add_argument_group("horizon and batch").add_argument
    a("--num-iterations", type=int, default=600, help="base steps (-1: from flops or ratio)")
    a("--sft-iterations", type=int, default=1500, help="SFT steps")
    a("--target-flops", type=float, default=-1.0, help="base training FLOPs (-1: the ratio)")
    a("--target-param-data-ratio", type=float, default=12.0, help="tokens per scaling parameter")
    a("--device-batch-size", type=int, default=16, help="rows per device per micro-batch")
    a("--total-batch-size", type=int, default=4096, help="tokens per step (-1: nanochat's rule)")
    a = p.add_argument_group("optimization (nanochat's defaults)").add_argument
    a("--embedding-lr", type=float, default=0.3, help="AdamW lr of wte and the value embeddings")
    a("--unembedding-lr", type=float, default=0.008, help="AdamW lr of lm_head")
    a("--matrix-lr", type=float, default=0.02, help="Muon lr of the transformer's matrices")
    a("--scalar-lr", type=float, default=0.5, help="AdamW lr of the per-layer residual scalars")
    a("--batch-lr-scale", type=float, default=1.0, help="lr scale (-1: sqrt(batch / 2^19))")
    a("--weight-decay", type=float, default=0.28, help="Muon weight decay, before its scaling")
    a("--warmup-steps", type=int, default=40, help="base lr warmup steps (SFT: none)")
    a("--warmdown-ratio", type=float, default=0.65, help="base steps of lr decay (SFT: 0.5)")
    a("--final-lr-frac", type=float, default=0.05, help="base lr at the end, a fraction (SFT: 0)")
    a("--init-lr-frac", type=float, default=0.8, help="SFT lrs as a fraction of the base lrs")


def add_eval_flags(p):
    a = p.add_argument_group("evaluation, checkpoints, debugging").add_argument
    a("--eval-every", type=int, default=100, help="val bits per byte every N steps (0: never)")
    a("--eval-steps", type=int, default=8, help="val batches per evaluation")
    a("--eval-tasks", type=int, default=50, help="test conversations per chat task after SFT, RL")
    a("--eval-bundle", default=None, help="nanochat's eval_bundle directory: CORE after base")
    a("--chat-data", default=None, help="ChatCORE's datasets' directory: ChatCORE after SFT, RL")
    a("--eval-max", type=int, default=-1, help="at most N examples per CORE, ChatCORE task")
    a("--sample-every", type=int, default=100, help="print a sample every N steps (0: never)")
    a("--save-every", type=int, default=-1, help="a checkpoint every N steps (-1: only the last)")
    a("--keep", type=int, default=3, help="checkpoints kept per stage")
    a("--resume", action="store_true", help="continue from the stage's newest checkpoint, exactly")
    a("--seed", type=int, default=0, help="init, data order and SFT mixture seed")
    a("--debug", action="store_true", help="run the step un-jitted with NaN checks (print works)")
    a("--compile-cache", default=CACHE, help="persistent XLA compilation cache ('': none)")


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=HelpFormatter)
    for add in (add_run_flags, add_model_flags, add_optim_flags, rl.add_flags, add_eval_flags,
                sharding.add_flags):
        add(p)
    args = p.parse_args(argv)
    for k, v in rl.DEFAULTS.items():  # the RL flags not given: ours, or nanochat's on GSM8K
        setattr(args, k, getattr(args, k, v["gsm8k" in args.rl_tasks]))
    return args


def main(argv=None):
    args = parse_args(argv)
    kernels.tune_process(args.compile_cache, restart=argv is None)
    sharding.init_distributed(args.coordinator, args.num_processes, args.process_id,
                              args.distributed)
    t, results = time.perf_counter(), {}
    tok = data.tokenizer_for(args.out, args.data, args.vocab_size, args.tokenizer_max_chars,
                             retrain=args.stage == "tokenizer", write=jax.process_index() == 0)
    graded = args.questions and args.eval_tasks > 0  # the evaluations' data first: bad input fails
    questions = tasks.load_questions(args.questions) if graded else ()
    bundle = evaluate.load_bundle(args.eval_bundle, args.eval_max) if args.eval_bundle else None
    chat_tasks = tasks.load_chat_tasks(args.chat_data, args.eval_max) if args.chat_data else {}
    rows = NamedSharding(sharding.data_mesh(), P("data"))  # evaluations' rows over the devices
    docs, key = data.corpus(args.data, "train", seed=args.seed), jax.random.key(args.seed)
    evals = dict(val_docs=data.corpus(args.data, "val"), eval_every=args.eval_every,
                 eval_steps=args.eval_steps, sample_every=args.sample_every)
    for name in {"all": STAGES, "tokenizer": ()}.get(args.stage, (args.stage,)):
        if name == "base":
            cfg = model_config(tok.n_vocab, args.depth, args.aspect_ratio, args.head_dim,
                               args.max_seq_len, args.window_pattern, args.dtype)
            stage = base_stage(cfg, docs, key, args.num_iterations)
        elif name == "sft":
            extra = [c for path in args.sft_data for c in data.load_conversations(path)]
            stage = sft_stage(args.out, tok, docs, args.seed, extra, args.sft_text_every,
                              args.sft_iterations, args.init_lr_frac)
        else:
            stage = rl.rl_stage(args.out, tok, args.rl_tasks, args.seed, args.chat_data,
                                args.rl_prompts, args.rl_samples, args.rl_max_tokens,
                                args.rl_iterations, args.rl_lr_frac, args.rl_eval,
                                args.rl_eval_every)
        optim = {k: getattr(args, k) for k in OPTIM}
        params, cfg, losses, info = run_stage(
            name, stage, tok, args.out, args.device_batch_size, optim, evals, resume=args.resume,
            keep=args.keep, save_every=args.save_every, debug=args.debug,
            data_shards=args.data_shards, attention=args.attention, record=vars(args),
            shard=args.shard, remat=args.remat)
        results[name] = report.evaluate_stage(name, params, cfg, tok, losses, info, args.out,
                                              argv or sys.argv[1:], args.eval_tasks, questions,
                                              (args.eval_bundle, bundle),
                                              (args.chat_data, chat_tasks), rows)
    results["total_minutes"] = (time.perf_counter() - t) / 60
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {e}")
    except (KeyboardInterrupt, FloatingPointError) as e:  # Ctrl-C, or diverged: where to go on
        sys.exit(str(e) or "interrupted")
