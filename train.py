"""Train nanochat in JAX: pretraining, SFT and RL in one jitted step; checkpoints resume
exactly.

    python train.py                  # the default pipeline: tokenizer -> base -> SFT -> RL
    python train.py --stage base --depth 6 --data 'shards/*.parquet' ...

A run reads top to bottom: `main` builds each stage (`base_stage`, `sft_stage`,
rl.rl_stage: a `Stage`), `run_stage` plans it (`horizon`), places it on the devices and
runs `train_loop`, which calls the jitted `train_step` once a step. docs/training.md
tells the story with nanochat's names; --debug runs the step un-jitted (print works).
"""

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpoint
import data
import evaluate
import kernels
import lora
import muon
import nanochat as nc
import report
import rl
import runtime
import sharding
import tasks

# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Optim:
    """The horizon, batch and learning-rate settings, one default each: the default
    run's, which are nanochat's base_train defaults but for the batch."""
    # tokens per step; nanochat's default is -1, its Power Lines rule (`horizon`)
    total_batch_size: int = 4096
    target_flops: float = -1.0  # base training FLOPs (-1: from the data ratio)
    target_param_data_ratio: float = 12.0  # tokens per scaling parameter
    batch_lr_scale: float = 1.0  # -1: sqrt(batch / 2^19)
    weight_decay: float = 0.28  # Muon's, before its scaling with the batch and horizon
    warmup_steps: int = 40
    warmdown_ratio: float = 0.65
    final_lr_frac: float = 0.05
    # base_train's learning rates (nanochat's setup_optimizer has other defaults: see
    # nanochat.param_groups)
    embedding_lr: float = 0.3
    unembedding_lr: float = 0.008
    matrix_lr: float = 0.02
    scalar_lr: float = 0.5


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the training state lies on the devices (sharding.py): --shard's mode, the
    mesh it splits over (None: as on one device), and --remat (recompute each block
    in the backward pass). A static argument of the jitted step."""
    shard: str = "none"
    mesh: jax.sharding.Mesh | None = None
    remat: bool = False

# ----------------------------------------------------------------------------------- the step


def schedules(step, s):
    """(lr multiplier, Muon momentum, Muon weight decay) at a traced step, from the
    schedule s."""
    n = s["num_iterations"]
    warmup = s["warmup_steps"]
    warmdown = jnp.round(s["warmdown_ratio"] * n)
    # 1. the lr: a linear warmup, flat, then a linear warmdown to final_lr_frac
    p = (n - step) / jnp.maximum(warmdown, 1)  # 1 -> 0 through the warmdown
    decay = p + (1 - p) * s["final_lr_frac"]
    warming_lr = (step + 1) / jnp.maximum(warmup, 1)
    lrm = jnp.where(step < warmup, warming_lr, jnp.where(step <= n - warmdown, 1.0, decay))
    # 2. Muon's momentum: up from momentum_start, flat, then down to momentum_end
    f = step / s["momentum_warmup"]
    q = 1 - p  # progress through the warmdown
    warming = (1 - f) * s["momentum_start"] + f * s["momentum"]
    cooling = (1 - q) * s["momentum"] + q * s["momentum_end"]
    late = jnp.where(step >= n - warmdown, cooling, s["momentum"])
    momentum = jnp.where(step < s["momentum_warmup"], warming, late)
    # 3. Muon's weight decay: a cosine to 0
    weight_decay = s["weight_decay"] * 0.5 * (1 + jnp.cos(jnp.pi * step / n))
    return lrm, momentum, weight_decay


def weighted_loss(params, cfg, inputs, targets, weights=None, attn=nc.causal_attention,
                  remat=False, frozen=None):
    """The mean cross-entropy over valid targets; with per-token weights (RL's
    advantages) sum(nll * w) / valid, nanochat's chat_rl objective with DAPO's
    token-level normalization. With frozen, params are LoRA adapters of its base."""
    if frozen is not None:
        params = lora.apply(frozen, params)
    if weights is None:
        return nc.loss_fn(params, inputs, targets, cfg, attn=attn, remat=remat)
    # -log p of each token
    nll = nc.loss_fn(params, inputs, targets, cfg, reduction="none", attn=attn, remat=remat)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(targets >= 0), 1)


def train_step(params, opt_state, batch, step, sched, lrs, cfg, attn=nc.causal_attention,
               layout=Layout(), frozen=None):
    """Forward, backward over A micro-batches and one MuonAdamW update. batch: (inputs,
    targets), int (A, B, T) each, and RL's per-token weights (A, B, T); sched:
    `schedules`' constants; lrs: the base learning rates (`learning_rates`); attn: the
    model's attention (kernels.py). frozen: LoRA's {"base": params, "scale": alpha / r};
    params are then its adapters, the only leaves differentiated and updated."""
    mesh = layout.mesh
    # 1. this step's hyper-parameters, as muon.py's parameter groups (LoRA's adapters take
    # the matrices' learning rate)
    lrm, momentum, weight_decay = schedules(step, sched)
    if frozen is None:
        labels, groups = nc.param_groups(params, lrm, momentum, weight_decay,
                                         muon_dtype=cfg.compute_dtype, **lrs)
    else:
        labels, groups = lora.param_groups(params, lrm, momentum, weight_decay,
                                           lr=lrs["matrix_lr"], muon_dtype=cfg.compute_dtype)
    params_axes, state_axes = sharding.split_on(layout.shard)

    # 2. the gradients summed over the micro-batches, then divided by A as nanochat does
    def micro(grads, b):
        loss_and_grad = jax.value_and_grad(weighted_loss)
        loss, g = loss_and_grad(params, cfg, *b, attn=attn, remat=layout.remat, frozen=frozen)
        return sharding.constrain(jax.tree.map(jnp.add, grads, g), mesh, params_axes), loss
    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, losses = jax.lax.scan(micro, zeros, batch)
    grads = jax.tree.map(lambda g: g / batch[0].shape[0], grads)
    # 3. (with a mesh) the gradients reduce-scattered, the params sliced to the state's
    # layout, and Muon's stacks split into whole matrices per device
    grads = sharding.constrain(grads, mesh, state_axes)
    params = sharding.constrain(params, mesh, state_axes)
    shards, constrain_stack = 1, None
    if mesh is not None:
        shards = mesh.size
        constrain_stack = functools.partial(sharding.constrain, mesh=mesh, split_on="stack")
    params, opt_state = muon.update(grads, opt_state, params, labels, groups,
                                    shards=shards, constrain_stack=constrain_stack)
    # 4. the state back in the layout it came in (no recompile), and whether all was
    # finite
    params = sharding.constrain(params, mesh, params_axes)
    opt_state = sharding.constrain(opt_state, mesh, state_axes)
    finite = jnp.isfinite(losses).all()
    finite &= jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    return params, opt_state, {"loss": losses.mean(), "lrm": lrm, "finite": finite}


jit_train_step = jax.jit(train_step, static_argnames=("cfg", "attn", "layout"),
                         donate_argnames=("params", "opt_state"))


# ---------------------------------------------------------------------------- the memory plan


def fit_device_batch(needs, limit, most=64, given=None, base=0):
    """(device batch, the bytes its step needs): `given` when its step fits in `limit` bytes,
    or (given None) the largest power of two from `most` down that fits. needs(rows): the
    bytes of the step for that many rows a device, at least `base` (the arguments') and
    growing with the rows at most in proportion: a size that a refused larger one proves too
    large is not compiled. A given batch that does not fit is a one-line ValueError naming
    what it needs, the limit and the largest that fits."""
    sizes = [2**i for i in reversed(range(int(math.log2(most)) + 1))]
    if given:
        sizes = [given] + [rows for rows in sizes if rows < given]
    found = {}
    for rows in sizes:
        # a refused r rows that needed n: these rows need at least base + (n - base) rows / r
        if any(base + (n - base) * rows / r > limit for r, n in found.items() if n < math.inf):
            continue
        found[rows] = needs(rows)
        if found[rows] <= limit:
            break
    fits = [rows for rows, n in found.items() if n <= limit]
    gib = f"the {limit / 2**30:.1f} GiB a step may take on a device"
    if given and given not in fits:
        largest = fits[0] if fits else "none (try --remat)"
        verdict = f"needs {found[given] / 2**30:.1f} GiB, more than"
        if found[given] == math.inf:  # (XLA named no number)
            verdict = "does not fit in"
        raise ValueError(f"--device-batch-size {given} {verdict} {gib}; the largest that fits "
                         f"is {largest}")
    if not fits:
        raise ValueError(f"not even one row a device fits in {gib}: try --remat, --shard "
                         "full or a shorter --max-seq-len")
    return fits[0], found[fits[0]]


def horizon(cfg, rows_per_step, iterations, optim):
    """nanochat's scaling rules: (steps, tokens per step, batch lr scale, scaled Muon
    weight decay). Steps: iterations if positive, else from optim.target_flops, else
    target_param_data_ratio tokens per scaling parameter; total_batch_size -1 is
    nanochat's Power Lines rule (arXiv 2505.13738: B_opt grows as D^0.383),
    batch_lr_scale -1 its sqrt(batch / 2^19)."""
    def n_scaling(c):
        counts = nc.num_scaling_params(c)
        return counts["transformer_matrices"] + counts["lm_head"]
    # 1. the tokens this model should see, and those of nanochat's reference, d12
    target_tokens = optim.target_param_data_ratio * n_scaling(cfg)
    d12 = nc.config_for_depth(12, cfg.vocab_size)
    d_ref = optim.target_param_data_ratio * n_scaling(d12)
    b_ref = 2**19
    # 2. the batch: given, or grown from the reference's as the data grows
    batch = optim.total_batch_size
    if batch <= 0:
        batch = 2 ** round(math.log2(b_ref * (target_tokens / d_ref) ** 0.383))
        batch = max(batch, rows_per_step * cfg.sequence_len)
    # 3. the steps
    if iterations > 0:
        steps = iterations
    elif optim.target_flops > 0:
        steps = round(optim.target_flops / (nc.estimate_flops(cfg) * batch))
    else:
        steps = int(target_tokens) // batch
    # 4. the lr scale and the weight decay follow the batch and the horizon
    lr_scale = optim.batch_lr_scale
    if lr_scale < 0:
        lr_scale = (batch / b_ref) ** 0.5
    weight_decay = optim.weight_decay * (batch / b_ref) ** 0.5 * d_ref / target_tokens
    return steps, batch, lr_scale, weight_decay


def base_schedule(steps, weight_decay, optim=Optim()):
    """The pretraining schedule's constants (train_step's `sched`), nanochat's momentum
    ramps."""
    return dict(num_iterations=steps,
                warmup_steps=optim.warmup_steps,
                warmdown_ratio=optim.warmdown_ratio,
                final_lr_frac=optim.final_lr_frac,
                momentum_start=0.85,
                momentum=0.97,
                momentum_end=0.90,
                momentum_warmup=400,
                weight_decay=weight_decay)


def learning_rates(optim=Optim(), scale=1.0):
    """The base learning rates (train_step's `lrs`), each times scale."""
    return dict(unembedding_lr=optim.unembedding_lr * scale,
                embedding_lr=optim.embedding_lr * scale,
                matrix_lr=optim.matrix_lr * scale,
                scalar_lr=optim.scalar_lr * scale)

# ----------------------------------------------------------------------------------- the loop


@contextlib.contextmanager
def ctrl_c_flag():
    """Within it, Ctrl-C fills the yielded list instead of raising (a second one
    raises), for the loop to read where params, step and data position agree: a
    KeyboardInterrupt inside the step would leave donated buffers behind."""
    pressed = []

    # a press is noted, and the handler that raises is back for the next one
    def handler(*_):
        pressed.append(signal.signal(signal.SIGINT, signal.default_int_handler))
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def step_scope(debug=False, mesh=None):
    """Where each step runs: inside the mesh (splash's shard_map reads it); with debug,
    un-jitted and with NaN checks, so print() and breakpoint() work in the step."""
    in_mesh = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    with jax.disable_jit(debug), jax.debug_nans(debug), in_mesh:
        yield


def nothing(*args):
    """A hook that does nothing."""


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What train_loop calls besides the step."""
    before_step: Callable = nothing  # (params, step, last): evaluations and samples
    save: Callable = nothing  # (params, opt_state, step, states) -> the checkpoint's path
    save_every: int = -1  # steps between checkpoints (-1: only the last)
    log: Callable = nothing  # (record): a line of metrics.jsonl
    stop: Sequence = ()  # non-empty once Ctrl-C was pressed (ctrl_c_flag)


def train_loop(params, opt_state, next_batch, states, step, *, steps, step_fn, flops,
               hooks=Hooks(), scope=step_scope):
    """Train from `step` to `steps`: (params, opt_state, this call's losses).

    next_batch(params, step) -> (batch, data states after it) (RL samples it from the
    params); step_fn(params, opt_state, batch, step) -> (params, opt_state, metrics),
    inside scope(); flops: per token, for the log line. Raises FloatingPointError on a
    non-finite loss, and KeyboardInterrupt (after saving) once hooks.stop is non-empty
    anywhere."""
    start = step
    last_saved = None
    losses = []
    smooth = 0.0
    t_run = time.perf_counter()
    while True:
        last = step == steps
        # 1. Ctrl-C: save where params, step and data agree (all processes, or one would
        # hang)
        pressed = bool(hooks.stop)
        if jax.process_count() > 1:
            pressed = bool(multihost_utils.process_allgather(np.array(pressed)).any())
        if pressed:
            saved = hooks.save(params, opt_state, step, states)
            raise KeyboardInterrupt(f"interrupted: saved {saved}; continue with --resume")
        # 2. evaluate, save, and stop at the end
        hooks.before_step(params, step, last)
        periodic = hooks.save_every > 0 and step > 0 and step % hooks.save_every == 0
        if last or periodic:
            last_saved = hooks.save(params, opt_state, step, states)
        if last:
            return params, opt_state, losses
        # 3. one step
        batch, next_states = next_batch(params, step)
        t0 = time.perf_counter()
        with scope():
            params, opt_state, metrics = step_fn(params, opt_state, batch, step)
        loss = float(metrics["loss"])
        dt = time.perf_counter() - t0
        if not bool(metrics["finite"]):
            raise FloatingPointError(diverged(step, loss, last_saved))
        step = step + 1
        states = next_states
        # 4. the live line and the metrics
        losses.append(loss)
        smooth = 0.9 * smooth + 0.1 * loss
        tps = batch[0].size / dt
        eta = (steps - step) * (time.perf_counter() - t_run) / (step - start)
        print(f"step {step:5d}/{steps} | loss {smooth / (1 - 0.9 ** (step - start)):.4f} | lrm "
              f"{float(metrics['lrm']):.3f} | {dt * 1e3:.0f} ms | {tps:,.0f} tok/s | "
              f"{tps * flops / 1e9:,.1f} GFLOP/s | eta {eta / 60:.1f} min", flush=True)
        hooks.log({"step": step, "loss": loss, "lrm": float(metrics["lrm"]), "dt": dt,
                   "tokens": batch[0].size, "tok_per_s": tps})


def diverged(step, loss, last_saved):
    """The message of a non-finite loss: where to go on from."""
    if last_saved:
        where = f"the last good checkpoint is {last_saved} (--resume continues from it)"
    else:
        where = "no checkpoint was saved yet (--save-every N saves one every N steps)"
    return f"step {step}: loss {loss} is not finite; {where}. Lower the learning rates"

# --------------------------------------------------------------------------------- the stages


@dataclasses.dataclass(frozen=True)
class Stage:
    """One training stage: the model, the params it starts from, what it trains on, for
    how long and how fast. base_stage, sft_stage and rl.rl_stage build them."""
    name: str  # base, sft or rl: its checkpoints go under out/<name>
    cfg: nc.Config
    init: Callable  # () -> the params it starts from (unless it resumes)
    iterations: int  # steps; base: -1 follows nanochat's rules (`horizon`)
    schedule: dict = dataclasses.field(default_factory=dict)  # base_schedule values it changes
    lr_frac: float = 1.0  # its learning rates: this fraction of the base ones
    packer: Callable | None = None  # packed stages: data.pretrain_batches or sft_batches ...
    docs: Callable | None = None  # ... over these documents (epoch -> texts)
    sample: Callable | None = None  # RL: sample(params, step, batch_sharding)
    evaluate: Callable | None = None  # more evaluation before each step (RL's pass@k)
    shape: str = ""  # the startup line's words for a step's batch (RL's)
    source: str = ""  # the step directory init's params come from (SFT's base, RL's SFT)
    # LoRA (lora_stage): init gives adapters of this {"base": params, "scale": alpha / r}
    frozen: dict | None = None
    lora: dict | None = None  # the adapters' config and base reference, for the checkpoints


@dataclasses.dataclass(frozen=True)
class Run:
    """Where and how run_stage runs a stage: train.py's flags of the same names."""
    out: str = "checkpoints"  # the root: a stage's checkpoints go under out/<stage>
    # rows per device per micro-batch (None: 16 on a CPU; on an accelerator the largest
    # that fits, plan_memory)
    device_batch_size: int | None = None
    resume: bool = False  # continue from the stage's newest checkpoint, exactly
    keep: int = 3  # checkpoints kept
    save_every: int = -1  # a checkpoint every N steps (-1: only the last)
    debug: bool = False  # the step un-jitted with NaN checks
    data_shards: int = 0  # data.process_batches' (0: one per process)
    attention: str = "auto"  # the training step's route of kernels.ROUTES
    shard: str | None = None  # --shard (None: sharding.choose_mode's default)
    remat: bool = False


def model_config(vocab_size, depth=3, aspect_ratio=32, head_dim=32, max_seq_len=256,
                 window_pattern="L", dtype="auto"):
    """The model of a depth (nanochat's dial); dtype auto: float32 on a CPU, else
    bfloat16."""
    if dtype == "auto":
        dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return nc.config_for_depth(depth, vocab_size, aspect_ratio, head_dim,
                               sequence_len=max_seq_len, window_pattern=window_pattern,
                               compute_dtype=dtype)


def base_stage(cfg, documents, key, iterations=-1):
    """Pretraining from fresh weights on documents (epoch -> texts, data.corpus)."""
    return Stage(name="base",
                 cfg=cfg,
                 init=lambda: kernels.init_params(cfg, key),
                 iterations=iterations,
                 packer=data.pretrain_batches,
                 docs=documents)


def sft_stage(out, tok, documents, seed=0, conversations=(), text_every=8, iterations=1500,
              lr_frac=0.8):
    """SFT from the newest base checkpoint on the synthetic chat tasks (and user
    conversations) with a pretraining document every `text_every` conversations, and
    nanochat's chat_sft schedule: lr_frac of the lrs, no warmup, a linear warmdown over
    the last half to 0, no weight decay."""
    params, cfg, path = checkpoint.load_stage(out, "base", tok)
    # the tasks' conversations, the user's, and a corpus document every text_every
    mixture = tasks.sft_mixture(seed, list(conversations), documents, text_every)
    schedule = dict(warmup_steps=0, warmdown_ratio=0.5, final_lr_frac=0.0, momentum=0.95,
                    momentum_end=0.95, momentum_warmup=300, weight_decay=0.0)
    return Stage(name="sft",
                 cfg=cfg,
                 init=lambda: params,
                 iterations=iterations,
                 schedule=schedule,
                 lr_frac=lr_frac,
                 packer=data.sft_batches,
                 docs=mixture,
                 source=path)


def lora_stage(stage, out, rank, alpha, targets, key, tokens=()):
    """The stage training LoRA adapters of `rank` on `targets` and deltas of the `tokens`'
    embeddings (lora.py), scaled by alpha / rank, over its initial params, frozen; its
    checkpoints hold the adapters and name that base by its path from the stage's folder
    and its CRC-32 (checkpoint.load_params)."""
    if not stage.source:
        raise ValueError(f"--lora-rank adapts a trained model, and {stage.name} starts from "
                         "none: pass --stage sft or rl")
    base = stage.init()
    lora.check(base, rank, targets)
    reference = checkpoint.reference(stage.source, os.path.join(out, stage.name))
    spec = {"rank": rank, "alpha": alpha, "targets": list(targets), "tokens": list(tokens),
            "base": reference}
    return dataclasses.replace(stage,
                               init=lambda: lora.init(base, rank, targets, key, tokens),
                               frozen=lora.frozen(base, rank, alpha, tokens),
                               lora=spec)


def packed_plan(stage, optim, rows):
    """A packed stage's (sched, lrs, tokens per step, batch lr scale) from nanochat's
    rules (`horizon`): the pretraining schedule with the stage's changes, the base
    lrs times its lr_frac. rows: rows of a micro-batch over all devices."""
    cfg = stage.cfg
    steps, batch, lr_scale, wd = horizon(cfg, rows, stage.iterations, optim)
    sched = {**base_schedule(steps, wd, optim), **stage.schedule}
    lrs = learning_rates(optim, lr_scale)
    lrs = {name: lr * stage.lr_frac for name, lr in lrs.items()}
    return sched, lrs, batch, lr_scale


def sampled_plan(stage, optim):
    """RL's (sched, lrs): its own steps and schedule, the base lrs times its lr_frac.
    Its batch is its rollouts, so no batch rule applies."""
    sched = {**base_schedule(stage.iterations, 0.0, optim), **stage.schedule}
    lrs = {name: lr * stage.lr_frac for name, lr in learning_rates(optim).items()}
    return sched, lrs


def stage_plan(stage, optim, device_batch_size):
    """(sched, lrs, tokens per step, batch lr scale, the startup line's words for a
    step): sampled_plan's for RL, packed_plan's for a packed stage, whose batch must
    fill whole rows on every device."""
    if stage.sample is not None:
        sched, lrs = sampled_plan(stage, optim)
        return sched, lrs, None, 1.0, stage.shape
    T = stage.cfg.sequence_len
    rows = device_batch_size * jax.device_count()
    sched, lrs, batch, lr_scale = packed_plan(stage, optim, rows)
    if rows < 1 or batch % (rows * T):  # (at least a row on each device of the mesh)
        raise ValueError(f"--total-batch-size {batch} must be a multiple of {rows * T} "
                         f"(device batch {device_batch_size}, at least 1, x devices x T)")
    shape = f"{batch:,} tokens ({batch // (rows * T)} x {rows} x {T})"
    return sched, lrs, batch, lr_scale, shape


def resume_or_init(stage, out_dir, resume, sched, lrs):
    """(step, params, opt_state, sched, lrs, loader states): the stage's newest
    checkpoint with resume (its schedule and position), else its initial params and
    fresh optimizer state."""
    # 1. the newest checkpoint, if it holds the model these flags make
    if resume and (found := checkpoint.load_newest(out_dir)):
        path, params, opt_state, meta = found
        saved = checkpoint.config_from(meta["config"], path)
        if saved != stage.cfg:  # another --depth, --max-seq-len, ...: the weights would not fit
            raise ValueError(f"{path} holds {saved}, but these flags make {stage.cfg}: resume "
                             "with the flags it was trained with, or train into another --out")
        if meta.get("lora") != stage.lora:  # adapters of another rank or base, or none
            raise ValueError(f"{path} holds LoRA {meta.get('lora')}, but these flags train "
                             f"{stage.lora}: resume with the flags and base it was trained with")
        print(f"resuming {path} at step {meta['step']}")
        return meta["step"], params, opt_state, meta["schedule"], meta["lrs"], meta["data_states"]
    # 2. else the stage's first params (LoRA: adapters) and a fresh optimizer state
    params = stage.init()
    groups = nc.param_groups if stage.frozen is None else lora.param_groups
    return 0, params, muon.init(params, *groups(params)), sched, lrs, None


def print_startup(stage, sched, shape, attention, lr_scale, layout_words, plan_line=""):
    """The startup line: the model, its size, the steps, the devices, the kernel, the
    layout; then the memory plan's line, if any."""
    cfg = stage.cfg
    dtype = jnp.dtype(cfg.compute_dtype)
    route = kernels.resolve_route(attention, jax.default_backend(), dtype,
                                  cfg.sequence_len, cfg.head_dim)
    print(f"{stage.name}: {cfg}\n{nc.num_scaling_params(cfg)['total']:,} params, "
          f"{sched['num_iterations']} steps of {shape}, {jax.device_count()} devices, attention "
          f"{route}, lr scale {lr_scale:.3f}, Muon wd {sched['weight_decay']:.3g}\n"
          f"{layout_words}")
    if plan_line:
        print(plan_line)


def stage_meta(stage, sched, lrs, record, run):
    """What each of a stage's checkpoints records beside its params: the stage, config,
    tokenizer, schedule, learning rates, the run's flags (record; its device batch as
    settled, where planned) and LoRA's settings."""
    meta = {"stage": stage.name, "config": dataclasses.asdict(stage.cfg),
            "tokenizer": "tokenizer.json", "schedule": sched, "lrs": lrs, "args": record or {},
            "lora": stage.lora}
    if "device_batch_size" in meta["args"]:  # the flag's value as settled (None: planned)
        meta["args"] = {**meta["args"], "device_batch_size": run.device_batch_size}
    return meta


def stage_batches(tok, stage, run, batch, mesh, states=None):
    """(next_batch(params, step), loader states): RL's sampled from the params, else
    packed into micro-batches of the run's rows, `batch` tokens a step."""
    batch_sharding = NamedSharding(mesh, P(None, "data"))  # rows over the devices
    # RL: each step's batch sampled from the params of that step
    if stage.sample is not None:
        return functools.partial(stage.sample, batch_sharding=batch_sharding), states
    # packed: each process packs its shards of the documents, from the saved positions
    T = stage.cfg.sequence_len
    rows = run.device_batch_size * jax.device_count()
    A = batch // (rows * T)  # micro-batches a step
    batches, states = data.process_batches(
        stage.packer, tok, stage.docs, (A, rows, T),
        process=(jax.process_index(), jax.process_count()), data_shards=run.data_shards,
        states=states)

    def next_batch(params, step):
        inputs, targets, states = next(batches)
        return sharding.global_arrays((inputs, targets), batch_sharding), states
    return next_batch, states


def checkpoint_saver(stage, tok, run, meta, results):
    """save(params, opt_state, step, states) for train_loop: the state gathered from
    every process, written by process 0 with the tokenizer inside the atomic write
    (chat.py needs it); returns the checkpoint's path on every process."""
    out_dir = os.path.join(run.out, stage.name)

    def save(params, opt_state, step, states):
        info = {**meta, "step": step, "data_states": sharding.gather_states(states),
                "val_bpb": results["val_bpb"]}
        # a collective: every process joins, process 0 writes
        params, opt_state = sharding.gather_tree((params, opt_state))
        if jax.process_index() == 0:
            return checkpoint.save_checkpoint(out_dir, step, params, opt_state, info,
                                              keep=run.keep, files={"tokenizer.json": tok.save})
        return os.path.join(out_dir, f"step_{step:06d}")
    return save


# the share of a device's memory a planned step may take: the plan has come 1-3% under the
# measured peak (d12 and d20 on a v5e), and a step squeezed into the last few percent runs
# slower (d20 at 4 rows a device, 15.2 GiB planned of 15.75: 50.8% MFU against 2 rows' 56.2%)
PLAN_SHARE = 0.95


def memory_limit():
    """The bytes the memory plan lets a step use on this process's first device:
    PLAN_SHARE of its limit; None on a CPU (no fixed limit)."""
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    return limit and int(PLAN_SHARE * limit)


def plan_memory(stage, run, batch, step_fn, state):
    """(run with its device batch settled, the startup line of the memory plan, the bytes
    it plans): the device batch given, checked against the device's memory, or the largest
    power of two that fits (fit_device_batch). Each try compiles step_fn for its batch; the
    one kept is compiled again for the loop from the compilation cache, and the refused
    ones are remembered beside it (refused_compiles)."""
    params, opt_state, frozen, step = state
    T = stage.cfg.sequence_len
    devices = jax.device_count()
    batch_sharding = NamedSharding(sharding.data_mesh(), P(None, "data"))
    # the step's arguments, in bytes per device
    state_bytes = sum(leaf.addressable_shards[0].data.nbytes
                      for leaf in jax.tree.leaves((params, opt_state, frozen)))
    limit = memory_limit()
    refused, remember = refused_compiles()

    def needs(rows):
        shape = (batch // (rows * devices * T), rows * devices, T)  # (A, B, T)
        tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding)
        lowered = step_fn.func.lower(params, opt_state, (tokens, tokens), step,
                                     **step_fn.keywords)
        program = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        if program in refused:
            return refused[program]
        need = runtime.needed_bytes(lowered, state_bytes)
        if need > limit:
            refused[program] = need
            remember()
        return need
    # at most 64 rows, and no more than one micro-batch of the step holds
    most = 2 ** int(math.log2(max(1, min(64, batch // (devices * T)))))
    rows, need = fit_device_batch(needs, limit, most, given=run.device_batch_size,
                                  base=state_bytes)
    line = (f"memory plan: {batch // (rows * devices * T)} micro-batches of {rows} rows a "
            f"device, {need / 2**30:.1f} of the {limit / 2**30:.1f} GiB a step may take")
    return dataclasses.replace(run, device_batch_size=rows), line, need


def refused_compiles():
    """({program's sha256: the bytes it needs}, remember()): the memory plan's compiles
    that did not fit this device, read from the compilation cache's directory, and a
    function that writes the dict back there (atomically). XLA caches no refused compile,
    and each of d20's takes 14-19 s or more: a warm start compiles the one that fits only.
    Without a cache, an empty dict and remember() does nothing."""
    cache = jax.config.jax_compilation_cache_dir
    if not cache:
        return {}, nothing
    name = f"memory-plan-{jax.local_devices()[0].device_kind}-{jax.__version__}.json"
    path = os.path.join(cache, name.replace(" ", "_"))
    refused = {}
    with contextlib.suppress(OSError, ValueError):
        with open(path) as f:
            refused = json.load(f)

    def remember():
        os.makedirs(cache, exist_ok=True)
        data.write_atomic(path, json.dumps(refused))
    return refused, remember


def run_stage(stage, tok, run=Run(), optim=Optim(), evals=None, record=None):
    """Run a stage to its horizon, or on from its newest checkpoint under run.out/<name>:
    (params, cfg, this run's losses, info). evals: evaluate.during_training's; record: more
    to save in each checkpoint's meta (train.py: its flags)."""
    cfg = stage.cfg
    out_dir = os.path.join(run.out, stage.name)
    planned = memory_limit() is not None and stage.sample is None and not run.debug
    if not planned:  # (a CPU, or RL: its batch is its rollouts)
        run = dataclasses.replace(run, device_batch_size=run.device_batch_size or 16)
    # 1. the schedule and learning rates: RL's own, a packed stage's by nanochat's rules
    sched, lrs, batch, lr_scale, shape = stage_plan(stage, optim, run.device_batch_size or 1)
    # 2. the params and optimizer state, fresh or resumed, laid out on the devices
    step, params, opt_state, sched, lrs, states = resume_or_init(stage, out_dir, run.resume,
                                                                 sched, lrs)
    mesh = sharding.data_mesh()
    shard = sharding.choose_mode(run.shard, mesh.size)
    # (LoRA's frozen base laid out as its adapters are)
    (params, frozen), opt_state = sharding.place((params, stage.frozen), opt_state, mesh, shard)
    layout = Layout(shard=shard, mesh=mesh if shard != "none" else None, remat=run.remat)
    step_fn = functools.partial(train_step if run.debug else jit_train_step, sched=sched, lrs=lrs,
                                cfg=cfg, attn=kernels.attention_fn(run.attention), layout=layout,
                                frozen=frozen)
    # 3. on an accelerator, the device batch checked against its memory, or the largest that fits
    plan_line = ""
    if planned:
        run, plan_line, _ = plan_memory(stage, run, batch, step_fn,
                                        (params, opt_state, frozen, step))
        sched, lrs, batch, lr_scale, shape = stage_plan(stage, optim, run.device_batch_size)
    next_batch, states = stage_batches(tok, stage, run, batch, mesh, states)
    words = sharding.describe(params, opt_state, jax.device_count(), shard)
    print_startup(stage, sched, shape, run.attention, lr_scale, words, plan_line=plan_line)
    # 4. the checkpoints and the metrics
    os.makedirs(out_dir, exist_ok=True)
    meta = stage_meta(stage, sched, lrs, record, run)
    results = {"val_bpb": None, "tokens": 0, "train_time": 0.0}
    t = time.perf_counter()
    metrics = os.path.join(out_dir, "metrics.jsonl") if jax.process_index() == 0 else os.devnull
    with open(metrics, "a") as f, ctrl_c_flag() as stop:
        def log(entry):
            f.write(json.dumps(entry) + "\n")
            if "dt" in entry and entry["step"] > step + 1:  # for MFU; the first step compiled
                results["tokens"] += entry["tokens"]
                results["train_time"] += entry["dt"]
        before = evaluate.during_training(stage.name, tok, cfg, results, log,
                                          run.device_batch_size,
                                          periodic=evaluate.Periodic(**(evals or {})),
                                          stage_eval=stage.evaluate)
        hooks = Hooks(before_step=lora.merged(before, frozen),
                      save=checkpoint_saver(stage, tok, run, meta, results),
                      save_every=run.save_every, log=log, stop=stop)
        # 5. the loop (LoRA: over the adapters; the evaluations and RL's samples merge them)
        next_batch = lora.merged(next_batch, frozen)
        params, _, losses = train_loop(params, opt_state, next_batch, states, step,
                                       steps=sched["num_iterations"], step_fn=step_fn,
                                       flops=nc.estimate_flops(cfg), hooks=hooks,
                                       scope=functools.partial(step_scope, run.debug, mesh))
    info = {**results, "steps": sched["num_iterations"], "time": time.perf_counter() - t}
    if frozen is not None:  # LoRA: the model's params, the adapters merged onto their base
        params = lora.apply(frozen, params)
    return params, cfg, losses, info

# ---------------------------------------------------------------------------------- command line

STAGES = ("base", "sft", "rl")
QUESTIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata",
                         "heldout_questions.jsonl")
CACHE = os.path.expanduser("~/.cache/nanochat_jax/xla")
DEFAULT = Optim()  # the flags' defaults


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
    a("--attention", default="auto", choices=kernels.ROUTES,
      help="the training step's attention kernel (kernels.py; evaluation and generation "
           "choose their own)")
    a("--remat", action="store_true", help="recompute each block in the backward: less memory")


def add_optim_flags(p):
    a = p.add_argument_group("horizon and batch").add_argument
    a("--num-iterations", type=int, default=600, help="base steps (-1: from flops or ratio)")
    a("--sft-iterations", type=int, default=1500, help="SFT steps")
    a("--target-flops", type=float, default=DEFAULT.target_flops,
      help="base training FLOPs (-1: the ratio)")
    a("--target-param-data-ratio", type=float, default=DEFAULT.target_param_data_ratio,
      help="tokens per scaling parameter")
    a("--device-batch-size", type=int, default=Run.device_batch_size,
      help="rows per device per micro-batch (none: 16 on a CPU, else the largest that fits)")
    a("--total-batch-size", type=int, default=DEFAULT.total_batch_size,
      help="tokens per step (-1: nanochat's rule)")
    a = p.add_argument_group("optimization (nanochat's defaults)").add_argument
    a("--embedding-lr", type=float, default=DEFAULT.embedding_lr,
      help="AdamW lr of wte and the value embeddings")
    a("--unembedding-lr", type=float, default=DEFAULT.unembedding_lr, help="AdamW lr of lm_head")
    a("--matrix-lr", type=float, default=DEFAULT.matrix_lr,
      help="Muon lr of the transformer's matrices")
    a("--scalar-lr", type=float, default=DEFAULT.scalar_lr,
      help="AdamW lr of the per-layer residual scalars")
    a("--batch-lr-scale", type=float, default=DEFAULT.batch_lr_scale,
      help="lr scale of packed stages (-1: sqrt(batch / 2^19))")
    a("--weight-decay", type=float, default=DEFAULT.weight_decay,
      help="Muon weight decay, before its scaling")
    a("--warmup-steps", type=int, default=DEFAULT.warmup_steps,
      help="base lr warmup steps (SFT: none)")
    a("--warmdown-ratio", type=float, default=DEFAULT.warmdown_ratio,
      help="base steps of lr decay (SFT: 0.5)")
    a("--final-lr-frac", type=float, default=DEFAULT.final_lr_frac,
      help="base lr at the end, a fraction (SFT: 0)")
    a("--init-lr-frac", type=float, default=0.8, help="SFT lrs as a fraction of the base lrs")


def add_lora_flags(p):
    a = p.add_argument_group("LoRA: SFT and RL train adapters of a frozen model (docs/lora.md)")
    a = a.add_argument
    a("--lora-rank", type=int, default=0, help="adapters' rank r (0: train every weight)")
    a("--lora-alpha", type=float, default=16.0, help="the adapters' scale is alpha / r")
    a("--lora-targets", nargs="+", default=list(lora.TARGETS), choices=lora.TARGETS,
      metavar="TARGET", help="the layers' matrices adapted")


def add_eval_flags(p):
    a = p.add_argument_group("evaluation, checkpoints, debugging").add_argument
    a("--eval-every", type=int, default=100, help="val bits per byte every N steps (0: never)")
    a("--eval-steps", type=int, default=8, help="val batches per evaluation")
    a("--eval-tasks", type=int, default=50, help="test conversations per chat task after SFT, RL")
    a("--eval-bundle", default=None, help="nanochat's eval_bundle directory: CORE after base")
    a("--chat-data", default=None, help="ChatCORE's datasets' directory: ChatCORE after SFT, RL")
    a("--eval-max", type=int, default=-1, help="at most N examples per CORE, ChatCORE task")
    a("--sample-every", type=int, default=100, help="print a sample every N steps (0: never)")
    a("--save-every", type=int, default=Run.save_every,
      help="a checkpoint every N steps (-1: only the last)")
    a("--keep", type=int, default=Run.keep, help="checkpoints kept per stage")
    a("--resume", action="store_true", help="continue from the stage's newest checkpoint, exactly")
    a("--seed", type=int, default=0, help="init, data order and SFT mixture seed")
    a("--debug", action="store_true", help="run the step un-jitted with NaN checks (print works)")
    a("--compile-cache", default=CACHE, help="persistent XLA compilation cache ('': none)")


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=HelpFormatter)
    for add in (add_run_flags, add_model_flags, add_optim_flags, add_lora_flags, rl.add_flags,
                add_eval_flags, sharding.add_flags):
        add(p)
    args = p.parse_args(argv)
    # the RL flags not given: ours, or nanochat's on GSM8K
    for k, v in rl.DEFAULTS.items():
        setattr(args, k, getattr(args, k, v["gsm8k" in args.rl_tasks]))
    return args


def main(argv=None):
    args = parse_args(argv)
    check_lora_flags(args)  # before anything is written
    runtime.use_compile_cache(args.compile_cache)
    sharding.init_distributed(args.coordinator, args.num_processes, args.process_id,
                              args.distributed)
    t = time.perf_counter()
    results = {}
    # 1. the tokenizer: trained once, then read
    tok = data.tokenizer_for(args.out, args.data, args.vocab_size, args.tokenizer_max_chars,
                             retrain=args.stage == "tokenizer", write=jax.process_index() == 0)
    # 2. the evaluations' data first, so that bad input fails before any training
    graded = args.questions and args.eval_tasks > 0
    questions = tasks.load_questions(args.questions) if graded else ()
    bundle = evaluate.load_bundle(args.eval_bundle, args.eval_max) if args.eval_bundle else None
    chat_tasks = tasks.load_chat_tasks(args.chat_data, args.eval_max) if args.chat_data else {}
    row_sharding = NamedSharding(sharding.data_mesh(), P("data"))  # evaluations' rows
    # 3. the settings every stage shares
    docs = data.corpus(args.data, "train", seed=args.seed)
    evals = dict(val_docs=data.corpus(args.data, "val"), eval_every=args.eval_every,
                 eval_steps=args.eval_steps, sample_every=args.sample_every)
    optim = Optim(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Optim)})
    run = Run(**{field.name: getattr(args, field.name) for field in dataclasses.fields(Run)})
    # 4. each stage: built, trained, evaluated
    for name in {"all": STAGES, "tokenizer": ()}.get(args.stage, (args.stage,)):
        stage = build_stage(name, args, tok, docs)
        params, cfg, losses, info = run_stage(stage, tok, run, optim, evals, record=vars(args))
        results[name] = report.evaluate_stage(
            name, params, cfg, tok, losses, info,
            out=args.out, argv=argv or sys.argv[1:], evaluations=report.Evaluations(
                eval_tasks=args.eval_tasks, questions=questions,
                bundle=(args.eval_bundle, bundle),
                chat_tasks=(args.chat_data, chat_tasks), row_sharding=row_sharding))
    results["total_minutes"] = (time.perf_counter() - t) / 60
    print(json.dumps(results))
    return results


def check_lora_flags(args):
    """--lora-rank's bad input, found before anything is written: a stage that starts from
    no model, or (--stage all) a rank or target the model of these flags cannot take."""
    if not args.lora_rank:
        return
    if args.stage in ("base", "tokenizer"):
        raise ValueError("--lora-rank adapts a trained model: pass --stage sft, rl or all (all "
                         "trains the base in full)")
    if args.stage == "all":
        # the base these flags will train (its matrices do not depend on the vocab)
        cfg = model_config(args.vocab_size, depth=args.depth, aspect_ratio=args.aspect_ratio,
                           head_dim=args.head_dim, max_seq_len=args.max_seq_len)
        lora.check(nc.param_shapes(cfg), args.lora_rank, args.lora_targets)


def build_stage(name, args, tok, docs):
    """The stage `name` as train.py's flags describe it; SFT and RL with --lora-rank train
    adapters of the model they start from."""
    if name == "base":
        cfg = model_config(tok.n_vocab, depth=args.depth, aspect_ratio=args.aspect_ratio,
                           head_dim=args.head_dim, max_seq_len=args.max_seq_len,
                           window_pattern=args.window_pattern, dtype=args.dtype)
        return base_stage(cfg, docs, jax.random.key(args.seed), args.num_iterations)
    if name == "sft":
        extra = [c for path in args.sft_data for c in data.load_conversations(path)]
        stage = sft_stage(args.out, tok, docs, seed=args.seed, conversations=extra,
                          text_every=args.sft_text_every, iterations=args.sft_iterations,
                          lr_frac=args.init_lr_frac)
    else:
        settings = rl.Settings(task_names=args.rl_tasks, seed=args.seed,
                               chat_data=args.chat_data, prompts=args.rl_prompts,
                               samples=args.rl_samples, max_tokens=args.rl_max_tokens,
                               iterations=args.rl_iterations, lr_frac=args.rl_lr_frac,
                               eval_n=args.rl_eval, eval_every=args.rl_eval_every)
        stage = Stage(**rl.rl_stage(args.out, tok, settings))
    # the chat's special tokens, which pretraining never taught, get embedding deltas too
    if args.lora_rank:  # (lora.init derives each target's key from the seed's)
        stage = lora_stage(stage, args.out, args.lora_rank, args.lora_alpha, args.lora_targets,
                           key=jax.random.key(args.seed), tokens=sorted(tok.special.values()))
    return stage


if __name__ == "__main__":
    # glibc malloc set for XLA's buffers, first: on huge pages the script starts over once here
    runtime.tune_malloc(restart=True)
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {e}")
    except (KeyboardInterrupt, FloatingPointError) as e:  # Ctrl-C, or diverged: where to go on
        sys.exit(str(e) or "interrupted")
