"""Scaling laws for nanochat in JAX: sweeps run in-process through train.py, and the
command line. The fits and plots (nanochat's isoFLOP analysis, Chinchilla's arXiv
2203.15556) are scaling_fits.py's, in plain numpy.

    python scaling.py                               # scale_c: 1.5 decades around N*(C)
    python scaling.py --sweep scale_n --tokens 2e6  # loss vs size: L(N) = E + A N^-alpha
    python scaling.py --sweep scale_d --depths 3 --tokens 2.5e5 5e5 1e6 2e6
    python scaling.py --fit-only --params-convention total
    python scaling.py --no-adaptive --depths 2 3 4 5 6  # nanochat's grid: every depth

Sweeps (nanochat's runs/scaling_laws.sh) train depths at FLOP budgets (scale_c) or token
counts, each run a train.run_stage in its own checkpoint root and a row of the CSV, so an
interrupted sweep resumes (`run_sweep`); `adaptive_sweep` picks each budget's depths
around the running estimate of N*(C). docs/scaling-laws.md tells the method, the
defaults (the corpus, --jobs, --together) and the results.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import shlex
import signal
import sys
import time

import numpy as np

import scaling_fits
import sharding

# jax and the modules of ours on it are imported where they are used: --fit-only needs
# numpy only, and a --jobs worker is pinned to its cores before JAX starts its threads.

# -------------------------------------------------------------------------------- sweeps


@dataclasses.dataclass(frozen=True)
class Shape:
    """What every run of a sweep shares but its depth and horizon: tokens per step, the
    vocab, nanochat's depth dial's aspect ratio and head_dim, the context T."""
    batch: int = 2048
    vocab_size: int = 384
    aspect_ratio: int = 12
    head_dim: int = 12
    T: int = 128


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """How train_runner trains each run of a sweep: plain values, so that a --jobs worker
    gets them before JAX starts."""
    out: str  # the sweep's directory: the tokenizer, and runs/, a checkpoint root a run
    shape: Shape = Shape()
    device_batch_size: int = 16
    eval_steps: int = 16
    data_paths: tuple = ()  # train.py's --data
    optim: dict | None = None  # train.Optim's values (the batch is shape.batch)
    tokenizer_max_chars: float = 2e9
    compile_cache: str = ""  # runtime.use_compile_cache's path
    model: dict | None = None  # train.model_config's keywords: window_pattern, dtype
    run: dict | None = None  # train.Run's (attention, data_shards, debug)
    distributed: dict | None = None  # sharding.init_distributed's
    together: bool = False  # a spec's seeds as one vmapped program (train_together)


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """How adaptive_sweep chooses each budget's depths: `width` depths around the running
    estimate of N*(C), its sizes N counted by `convention`; then the `repeat` best runs
    of every budget up to a tenth of the largest trained under one more seed."""
    width: int = 4
    repeat: int = 2
    convention: str = "kaplan"


def model_row(cfg):
    """The CSV's model columns for a config (nanochat's names)."""
    import nanochat as nc
    counts = nc.num_scaling_params(cfg)
    return {"depth": cfg.n_layer, "model_dim": cfg.n_embd,
            "params_wte": counts["wte"], "params_value_embeds": counts["value_embeds"],
            "params_lm_head": counts["lm_head"],
            "params_transformer": counts["transformer_matrices"],
            "params_scalars": counts["scalars"], "params_total": counts["total"]}


def plan(sweep, depths, budgets=(), tokens=(), shape=Shape()):
    """Run specs {flops_budget, depth, model_dim, num_iterations} of a sweep: scale_c
    crosses depths with FLOP budgets (num_iterations = C / (flops per token x batch));
    scale_n and scale_d cross depths with token counts."""
    import nanochat as nc
    batch = shape.batch
    specs = []
    for d in depths:
        cfg = nc.config_for_depth(d, shape.vocab_size, shape.aspect_ratio,
                                  shape.head_dim, sequence_len=shape.T)
        f = nc.estimate_flops(cfg)
        # scale_c: a budget's steps; scale_n, scale_d: a token count's steps, budget
        if sweep == "scale_c":
            specs += [{"flops_budget": c, "depth": d, "model_dim": cfg.n_embd,
                       "num_iterations": max(1, round(c / (f * batch)))}
                      for c in budgets]
        else:
            specs += [{"flops_budget": f * batch * max(1, round(t / batch)), "depth": d,
                       "model_dim": cfg.n_embd,
                       "num_iterations": max(1, round(t / batch))} for t in tokens]
    return specs


def run_sweep(specs, csv_path, runner, seeds=(0,), write=True, pool=None):
    """Run every (spec, seed) whose row is not yet in csv_path, the seeds of a spec in
    one runner call (with a pool, worker_pool's, several specs at once), appending the
    rows in order as they finish (if write: one process of a multi-host run writes);
    returns all rows."""
    # 1. each spec's seeds not yet in the CSV
    done = {scaling_fits.run_key(r) for r in scaling_fits.read_results(csv_path)}
    todo = [[dict(spec, seed=seed) for seed in seeds
             if scaling_fits.run_key(dict(spec, seed=seed)) not in done]
            for spec in specs]
    for i, (spec, runs) in enumerate(zip(specs, todo)):
        what = "run" if runs else "skip (done)"
        print(f"[{i + 1}/{len(specs)}] {what}: {spec}, seeds "
              f"{[r['seed'] for r in runs] or list(seeds)}", flush=True)
    # 2. trained, a spec's seeds at a time, each row appended as its spec finishes
    todo = [runs for runs in todo if runs]
    trained = (pool.map if pool else map)(runner, todo)
    for runs, rows in zip(todo, trained):
        for run, row in zip(runs, rows):
            if write:
                scaling_fits.append_result(csv_path, dict(run, **row))
    return scaling_fits.read_results(csv_path)


def optimum_estimate(rows, C):
    """The running estimate of N*(C) from the runs at smaller budgets: before any
    optimum, Chinchilla's D = 20 N; after one, N* ~ C^0.5 from it; after two or more, the
    isoFLOP fit's N* ~ C^a."""
    optima = scaling_fits.fit_isoflop(rows)["optima"] if rows else np.zeros((0, 5))
    # two optima or more: the power law through them; one: the square root from it
    if len(optima) >= 2:
        log_c = np.log10(optima[:, 0])
        a, log_k = np.polyfit(log_c, np.log10(optima[:, 1]), 1)
        return 10 ** (a * np.log10(C) + log_k)
    if len(optima):
        return optima[-1, 1] * (C / optima[-1, 0]) ** 0.5
    return (C / 120) ** 0.5  # C = 6 N D with D = 20 N

def adaptive_sweep(budgets, csv_path, runner, spec_of, sizes, seeds=(0,), write=True,
                   width=4, pool=None, repeat=0):
    """scale_c with the grid chosen from the data (docs/scaling-laws.md): each budget, in
    increasing order, trained at `width` depths around the running estimate of N*(C),
    widened a depth at a time while the vertex of its runs' parabola lies outside; then
    the `repeat` best runs of the budgets up to a tenth of the largest under one more
    seed. The choices follow from the CSV, so a resumed sweep makes the same ones.
    spec_of(depth, C) -> spec, None past the corpus; sizes: {depth: N}."""
    budgets = sorted(budgets)
    more = [max(seeds) + 1]
    for C in budgets:
        # 1. the sizes whose run fits in the corpus, and the first grid among them
        before = [r for r in scaling_fits.read_results(csv_path)
                  if r["flops_budget"] < C * (1 - 1e-9)]
        n_star = optimum_estimate(before, C)
        depths = [d for d in sorted(sizes) if spec_of(d, C)]
        if len(depths) < width:
            raise SystemExit(f"C = {C:.3g}: {len(depths)} sizes have runs that fit in "
                             f"the corpus, a grid needs {width}; give smaller --budgets "
                             "or a larger corpus")
        grid = first_grid(depths, sizes, n_star, width)
        # 2. trained, and widened a size at a time while the vertex lies outside
        while True:
            specs = [spec_of(d, C) for d in grid]
            trained = run_sweep(specs, csv_path, runner, seeds, write=write, pool=pool)
            bpb = grid_bpb(trained, C, grid, seeds)
            x = np.log10([sizes[d] for d in grid])
            y = np.array([bpb[d] for d in grid])
            # the isoFLOP fit's N*, before fit_isoflop pins it inside the runs
            vertex = scaling_fits.parabola_min(x, y)[1]
            i = depths.index(grid[0])
            if vertex <= x[0] and i > 0:
                grid.insert(0, depths[i - 1])
            elif vertex >= x[-1] and grid[-1] != depths[-1]:
                grid.append(depths[depths.index(grid[-1]) + 1])
            else:
                break
        # 3. no smaller size to widen to: the optimum may lie below the grid
        if vertex <= x[0]:
            if grid[0] == min(sizes):
                why = ("is the smallest model there is; the optimum may lie below it "
                       "(give larger --budgets)")
            else:
                why = ("is the smallest whose tokens fit in the corpus; the optimum may "
                       "lie below it (give a larger corpus or smaller --budgets)")
            print(f"C = {C:.3g}: the smallest run, d{grid[0]}, {why}", flush=True)
        # 4. the small budgets' best runs under one more seed
        if C <= budgets[-1] / 10 * (1 + 1e-9) and repeat:
            best = sorted(bpb, key=bpb.get)[:repeat]
            specs = [spec_of(d, C) for d in best]
            run_sweep(specs, csv_path, runner, more, write=write, pool=pool)
    return scaling_fits.read_results(csv_path)


def first_grid(depths, sizes, n_star, width):
    """adaptive_sweep's first grid: the `width` depths around the one whose size is
    nearest n_star in log (an even width: one more above), within depths."""
    # each size's distance to n_star, in log
    distance = [abs(math.log(sizes[d] / n_star)) for d in depths]
    centre = min(range(len(depths)), key=lambda i: distance[i])
    lo = max(0, min(centre - (width - 1) // 2, len(depths) - width))
    return depths[lo:lo + width]


def grid_bpb(rows, C, grid, seeds):
    """{depth: its mean val bpb over seeds} of the grid's runs at budget C among rows."""
    here = [r for r in rows if abs(r["flops_budget"] / C - 1) < 1e-6
            and r["depth"] in grid and int(r["seed"]) in seeds]
    return {d: np.mean([r["val_bpb"] for r in here if r["depth"] == d]) for d in grid}


def python_source(out, min_chars=100, max_chars=250):
    """The scaling corpus, written once to out/python_source.jsonl: the .py files of this
    Python's standard library and of the numpy and jax it runs on, cut at blank lines
    into documents of min_chars to max_chars (about one 128-token row), repeats dropped.
    Offline, and the same wherever Python and requirements.txt are the same."""
    import sysconfig
    import jax
    import data
    path = os.path.join(out, "python_source.jsonl")
    if os.path.isfile(path):
        return path
    # 1. the .py files of the standard library (not its site-packages), numpy and jax
    stdlib = sysconfig.get_paths()["stdlib"]
    roots = (stdlib, os.path.dirname(np.__file__), os.path.dirname(jax.__file__))
    files = []
    for root in roots:
        for folder, _, names in os.walk(root):
            if root == stdlib and "site-packages" in folder:
                continue
            files += [os.path.join(folder, f) for f in names if f.endswith(".py")]
    # 2. each cut at a blank line past min_chars, or at max_chars; repeats dropped
    unique = {}  # a dict: repeats dropped, order kept
    for name in sorted(files):
        chunk = []
        chars = 0
        with open(name, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True) + ["\n"]
        for line in lines:
            chunk.append(line)
            chars += len(line)
            if chars >= max_chars or not line.strip() and chars >= min_chars:
                unique.setdefault("".join(chunk).strip(), None)
                chunk = []
                chars = 0
    # 3. shuffled once: each run reads the same mix from the start
    docs = [d for d in unique if d]
    order = np.random.default_rng(0).permutation(len(docs))
    data.write_atomic(path, "".join(json.dumps({"text": docs[i]}) + "\n" for i in order))
    return path


def corpus_room(tok, paths, B, T):
    """Tokens a run can train on before train.py's loader (paths as its --data, B rows
    of T + 1 tokens a batch) reads a document a second time: one pass of the loader,
    counted. Best-fit packing crops what does not fit in a row and drops the rest, so a
    corpus's token count overstates it."""
    import data
    batches = data.pretrain_batches(tok, data.corpus(paths, "train"), B, T)
    for n, (_, _, state) in enumerate(batches):
        # this batch's buffer holds the first documents again; those before it do not
        if state["epoch"] > 0:
            return n * B * T

def train_runner(settings, restart=False):
    """A runner for run_sweep: one spec's seeds trained by train.run_stage in-process one
    by one, each in its own checkpoint root under out/runs (an interrupted run resumes
    from it), or with settings.together as one vmapped program (train_together; an
    interrupted group starts over). restart: runtime.tune_malloc's."""
    import jax
    import data
    import runtime
    # 1. the process, as train.py sets it up; on a pod every host runs the sweep
    runtime.tune_malloc(restart)
    runtime.use_compile_cache(settings.compile_cache)  # a resumed sweep skips compiles
    sharding.init_distributed(**(settings.distributed or {}))
    # 2. one tokenizer for every run
    tok = data.tokenizer_for(settings.out, settings.data_paths,
                             settings.shape.vocab_size, settings.tokenizer_max_chars,
                             write=jax.process_index() == 0)

    def train_specs(specs):
        if settings.together and len(specs) > 1:
            return train_seeds_together(settings, tok, specs)
        return [train_spec(settings, tok, spec) for spec in specs]
    return train_specs


def base_run(settings, tok, spec):
    """A spec's (checkpoint root, train.base_stage, train.Optim: the sweep's values, its
    batch, a warmup of a fifth of its steps, at most 40)."""
    import jax
    import data
    import train
    shape = settings.shape
    depth = int(spec["depth"])
    steps = int(spec["num_iterations"])
    seed = int(spec["seed"])
    name = (f"d{depth}_ar{shape.aspect_ratio}_hd{shape.head_dim}_v{shape.vocab_size}"
            f"_T{shape.T}_b{shape.batch}_n{steps}_s{seed}")
    cfg = train.model_config(tok.n_vocab, depth, shape.aspect_ratio, shape.head_dim,
                             shape.T, **(settings.model or {}))
    docs = data.corpus(settings.data_paths, "train", seed=seed)
    stage = train.base_stage(cfg, docs, jax.random.key(seed), steps)
    values = {**(settings.optim or {}), "total_batch_size": shape.batch}
    optim = train.Optim(**{**values, "warmup_steps": min(40, steps // 5)})
    return os.path.join(settings.out, "runs", name), stage, optim


def train_spec(settings, tok, spec):
    """One run through train.run_stage, resumed from its checkpoint if it has one: its
    CSV columns."""
    import checkpoint
    import data
    import train
    t = time.perf_counter()
    root, stage, optim = base_run(settings, tok, spec)
    # 1. trained, and evaluated once, at the end
    evals = dict(val_docs=data.corpus(settings.data_paths, "val"),
                 eval_every=stage.iterations, eval_steps=settings.eval_steps,
                 sample_every=0)
    run = train.Run(out=root, device_batch_size=settings.device_batch_size, resume=True,
                    keep=1, **(settings.run or {}))
    _, cfg, _, info = train.run_stage(stage, tok, run, optim, evals)
    # 2. whether it read a token twice: the loader's pass, from its last checkpoint
    last = checkpoint.latest_checkpoint(root, ("base",))
    with open(os.path.join(last, "meta.json")) as f:
        epoch = max(state["epoch"] for state in json.load(f)["data_states"])
    seconds = time.perf_counter() - t
    tokens = info["steps"] * settings.shape.batch
    return dict(model_row(cfg), num_iterations=info["steps"], tokens_trained=tokens,
                val_bpb=info["val_bpb"], train_time_sec=seconds, data_epoch=epoch)


def train_seeds_together(settings, tok, specs):
    """One spec's seeds as one vmapped program (train_together): their CSV columns, the
    time shared out."""
    import data
    t = time.perf_counter()
    stages = [base_run(settings, tok, spec)[1] for spec in specs]
    optim = base_run(settings, tok, specs[0])[2]
    attention = (settings.run or {}).get("attention", "auto")
    cfg, steps, _, bpb = train_together(stages, tok, settings.device_batch_size, optim,
                                        data.corpus(settings.data_paths, "val"),
                                        settings.eval_steps, attention=attention)
    seconds = (time.perf_counter() - t) / len(specs)
    tokens = steps * settings.shape.batch
    return [dict(model_row(cfg), num_iterations=steps, tokens_trained=tokens, val_bpb=b,
                 train_time_sec=seconds) for b in bpb]


def worker_pool(jobs, settings):
    """`jobs` worker processes for run_sweep, each pinned to its share of this process's
    CPU cores (before XLA sizes its thread pool) and running a train_runner(settings):
    the sweep's tiny models keep about one core busy each, so runs side by side share
    the cores well."""
    # a fresh interpreter: no fork of JAX's threads
    ctx = multiprocessing.get_context("spawn")
    # each worker takes one share of the cores from the queue as it starts
    cores = ctx.Queue()
    for share in np.array_split(sorted(os.sched_getaffinity(0)), jobs):
        cores.put({int(c) for c in share})
    return concurrent.futures.ProcessPoolExecutor(jobs, ctx, initializer=_start_worker,
                                                  initargs=(cores, settings))


# a worker process's runner, and whether it has seen a Ctrl-C
_WORKER = {"stopped": False}


def _start_worker(cores, settings):
    os.sched_setaffinity(0, cores.get())
    # outside a run's training loop, which saves first
    signal.signal(signal.SIGINT, _interrupted)
    _WORKER["run"] = train_runner(settings=settings)


def _interrupted(*_):
    _WORKER["stopped"] = True
    raise KeyboardInterrupt


def _worker_run(specs):
    """The worker's runner on specs; after a Ctrl-C it starts none (the pool hands a
    worker its next one early)."""
    if _WORKER["stopped"]:
        raise KeyboardInterrupt("not started: the sweep was interrupted")
    try:
        return _WORKER["run"](specs)
    except KeyboardInterrupt:
        _WORKER["stopped"] = True
        raise

def train_together(stages, tok, device_batch_size, optim, val_docs, eval_steps, lrs=None,
                   attention="auto"):
    """One model size under several seeds as one compiled program: the runs' params,
    optimizer states and data streams (train.base_stage's, alike but for the seed)
    stacked, train.train_step vmapped over them; lrs: a train.learning_rates dict per
    run. Returns (cfg, steps, losses (steps, runs), each run's final val bits per byte),
    as train.run_stage would give them one by one."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import data
    import evaluate
    import muon
    import nanochat as nc
    import train
    cfg = stages[0].cfg
    T = cfg.sequence_len
    rows = device_batch_size * jax.device_count()
    sched, base_lrs, batch, _ = train.packed_plan(stages[0], optim, rows)

    # 1. the runs' learning rates, params and optimizer states, stacked
    def stack(trees):
        return jax.tree.map(lambda *x: jnp.stack(x), *trees)
    lrs = stack(lrs or [base_lrs] * len(stages))  # {name: (runs,)}
    inits = [stage.init() for stage in stages]
    params = stack(inits)
    opt_state = stack([muon.init(p, *nc.param_groups(p)) for p in inits])
    # 2. each run's data stream: this process's rows of each step's batch
    batch_sharding = NamedSharding(sharding.data_mesh(), P(None, "data"))
    batch_shape = (batch // (rows * T), rows, T)  # (micro-batches, rows, T)
    process = (jax.process_index(), jax.process_count())
    streams = [data.process_batches(stage.packer, tok, stage.docs, batch_shape,
                                    process=process)[0]
               for stage in stages]
    # 3. the steps, train_step vmapped over the runs
    step_fn = vmapped_step(cfg, attention)
    losses = []
    for i in range(sched["num_iterations"]):
        batches = [sharding.global_arrays(next(stream)[:2], batch_sharding)
                   for stream in streams]
        inputs, targets = zip(*batches)
        batch_i = (jnp.stack(inputs), jnp.stack(targets))
        params, opt_state, m = step_fn(params, opt_state, batch_i, i, sched, lrs)
        losses.append(np.asarray(m["loss"]))
        if not np.asarray(m["finite"]).all():
            raise FloatingPointError(f"step {i}: a loss is not finite ({losses[-1]}); "
                                     "lower the learning rates")
    # 4. each run's val bits per byte
    token_bytes = jnp.asarray(tok.token_bytes())
    bpb = []
    for i in range(len(stages)):
        run_params = jax.tree.map(lambda x: x[i], params)
        val = data.pretrain_batches(tok, val_docs, device_batch_size, T)
        bpb.append(evaluate.evaluate_bpb(run_params, cfg, val, token_bytes, eval_steps))
    return cfg, sched["num_iterations"], np.array(losses), bpb


def vmapped_step(cfg, attention):
    """train.train_step vmapped over stacked runs (params, optimizer states, batches and
    lrs; the step and schedule shared), jitted with the state donated."""
    import jax
    import kernels
    import train
    attn = kernels.attention_fn(attention)
    step = functools.partial(train.train_step, cfg=cfg, attn=attn)
    over_runs = jax.vmap(step, in_axes=(0, 0, 0, None, None, 0))
    return jax.jit(over_runs, donate_argnums=(0, 1))


def adaptive_grid(candidates, convention, settings):
    """adaptive_sweep's sizes {depth: N} among the candidate depths (those the aspect
    ratio allows) and its spec_of(depth, C): plan's spec, None where the run would read
    past the corpus (corpus_room). settings: train_runner's."""
    import data
    import nanochat as nc
    shape = settings.shape
    # 1. each size's N, where the aspect ratio allows the depth
    sizes = {}
    for d in candidates:
        with contextlib.suppress(ValueError):  # too narrow for this aspect ratio
            cfg = nc.config_for_depth(d, shape.vocab_size, shape.aspect_ratio,
                                      shape.head_dim, sequence_len=shape.T)
            sizes[d] = scaling_fits.effective_params([model_row(cfg)], convention)[0]
    # 2. the tokens the corpus holds before the loader reads one twice
    tok = data.Tokenizer.load(os.path.join(settings.out, "tokenizer.json"))
    room = corpus_room(tok, settings.data_paths, settings.device_batch_size, shape.T)
    print(f"corpus: {room / 1e6:.1f}M tokens to train on before any repeats", flush=True)

    def spec_of(d, c):
        spec = plan("scale_c", [d], [c], (), shape)[0]
        return spec if spec["num_iterations"] * shape.batch <= room else None
    return sizes, spec_of


def train_sweep(sweep, csv_path, settings, depths, budgets=(), tokens=(), seeds=(0,),
                jobs=0, adaptive=Adaptive(), restart=False):
    """Train the sweep's runs that csv_path lacks: scale_c by adaptive_sweep unless
    adaptive is None (depths: its candidates), else the whole plan by run_sweep; jobs
    runs at once in worker_pool (0: one per core on a CPU, else 1). settings:
    train_runner's. Returns whether this process writes the results (process 0 of a
    multi-host run)."""
    # 1. here: the one tokenizer, trained; a multi-host run joined
    runner = train_runner(settings=settings, restart=restart)
    import jax
    cpu = jax.default_backend() == "cpu"
    # 2. the runs at once: one per core on a CPU (tiny models keep about one core busy)
    if not jobs:
        jobs = len(os.sched_getaffinity(0)) if cpu and not settings.together else 1
    if jobs > 1 and jax.process_count() > 1:
        raise ValueError("--jobs is for one process: a multi-host sweep trains each run "
                         "on every host")
    pool = worker_pool(jobs, settings) if jobs > 1 else None
    # 3. the sweep: the whole plan, or scale_c's grids chosen as it goes
    try:
        runner = _worker_run if pool else runner
        if not (adaptive and sweep == "scale_c"):
            specs = plan(sweep, depths, budgets, tokens, settings.shape)
            run_sweep(specs, csv_path, runner, seeds, write=jax.process_index() == 0,
                      pool=pool)
        elif jax.process_count() > 1:
            raise ValueError("--adaptive is for one process: its choices follow from "
                             "results only process 0 writes")
        else:
            sizes, spec_of = adaptive_grid(depths, adaptive.convention, settings)
            adaptive_sweep(budgets, csv_path, runner, spec_of, sizes, seeds,
                           width=adaptive.width, pool=pool, repeat=adaptive.repeat)
    # a run's "continue with --resume" is train.py's: the sweep resumes
    except KeyboardInterrupt:
        raise KeyboardInterrupt("interrupted: the runs in progress saved a checkpoint; "
                                "the same command resumes the sweep") from None
    # on Ctrl-C (every worker gets it too, and saves its run) the queued runs never start
    finally:
        if pool:
            pool.shutdown(cancel_futures=True)
    return jax.process_index() == 0

# ------------------------------------------------------------------------- command line

DEFAULTS = {
    "scale_c": {"depths": [2, 3, 4, 5, 6], "budgets": [4e11, 1.27e12, 4e12, 1.27e13],
                "tokens": []},
    "scale_n": {"depths": [2, 3, 4, 5, 6], "budgets": [], "tokens": [1e6]},
    "scale_d": {"depths": [2], "budgets": [], "tokens": [1.25e5, 2.5e5, 5e5, 1e6, 2e6]}}


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def _per_sweep(key):
    """DEFAULTS[sweep][key] of the sweeps that have one, for --help."""
    return "; ".join(f"{s}: {' '.join(f'{v:g}' for v in d[key])}"
                     for s, d in DEFAULTS.items() if d[key])


def add_sweep_flags(p):
    """What a sweep trains, and how its grids are chosen."""
    a = p.add_argument
    a("--sweep", default="scale_c", choices=list(DEFAULTS),
      help="what to sweep (see above)")
    a("--depths", type=int, nargs="*",
      help="model sizes (None: with scale_c --adaptive, 1 to 24, those the aspect ratio "
           f"allows; else the sweep's, {_per_sweep('depths')})")
    a("--adaptive", action=argparse.BooleanOptionalAction, default=True,
      help="scale_c: choose each budget's depths (among --depths, if given) around the "
           "running estimate of N*(C), widening the grid until the optimum is inside it "
           "(adaptive_sweep); --no-adaptive: every depth at every budget")
    a("--width", type=int, default=4,
      help="--adaptive: depths per budget before any widening")
    a("--repeat", type=int, default=2,
      help="--adaptive: the best runs of every budget up to a tenth of the largest "
           "trained with one more seed, so that the intervals hold the seeds' spread")
    a("--corpus", default="python-source", choices=["docstrings", "python-source"],
      help="docstrings: train.py's default corpus; python-source: the standard "
           "library's, numpy's and jax's source, so that large budgets never read a "
           "token twice")
    a("--budgets", type=float, nargs="*",
      help="scale_c: training FLOP budgets C (None: the sweep's, "
           f"{_per_sweep('budgets')})")
    a("--tokens", type=float, nargs="*",
      help="scale_n / scale_d: tokens per run (None: the sweep's, "
           f"{_per_sweep('tokens')})")
    a("--seed", type=int, default=0,
      help="training seed (init, data order) and bootstrap seed")
    a("--seeds", type=int, default=1,
      help="train each run with this many seeds: --seed, --seed+1, ...")
    a("--jobs", type=int, default=0,
      help="runs trained at once, each in its own process on its share of the cores (0: "
           "one per core on a CPU, else 1)")
    a("--together", action="store_true",
      help="train a run's seeds as one vmapped program (slower than one by one on a "
           "CPU, docs/scaling-laws.md; for accelerators)")


def add_run_flags(p):
    """How each run trains, and how the results are fit."""
    a = p.add_argument
    a("--params-convention", default="kaplan", choices=list(scaling_fits.CONVENTIONS),
      help="N for the fits: kaplan = transformer matrices + lm_head (nanochat), total, "
           "transformer")
    a("--out", default="scaling_results",
      help="results CSV, plots and one checkpoint root per run")
    a("--batch", type=int, default=Shape.batch, help="tokens per step")
    a("--seq-len", type=int, default=Shape.T, help="context length T")
    a("--vocab-size", type=int, default=Shape.vocab_size, help="tokenizer vocab size")
    a("--aspect-ratio", type=int, default=Shape.aspect_ratio,
      help="model_dim = depth x aspect ratio")
    a("--head-dim", type=int, default=Shape.head_dim, help="attention head size")
    a("--bootstrap", type=int, default=200,
      help="bootstrap resamples for the 90%% intervals")
    a("--fit-only", action="store_true",
      help="fit and plot the existing CSV, train nothing")
    a("--weight-decay", type=float, default=0.0,
      help="train.py's --weight-decay (nanochat: 0.28), scaled by nanochat's rule; see "
           "docs/scaling-laws.md")
    a("--train-args", default="",
      help="train.py flags for every run, e.g. '--matrix-lr 0.03': its optimization, "
           "--data, --window-pattern, --dtype, --attention, --device-batch-size, "
           "--eval-steps and multi-host flags (the sweep sets the stage, sizes and "
           "horizons)")


def parse_args(argv=None):
    """The command line, with the sweep's defaults filled in for --depths, --budgets,
    --tokens."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_sweep_flags(p)
    add_run_flags(p)
    args = p.parse_args(argv)
    # the sweep's defaults; adaptive_grid keeps the sizes the aspect ratio allows
    defaults = DEFAULTS[args.sweep]
    adaptive = args.adaptive and args.sweep == "scale_c"
    every = list(range(1, 25))
    args.depths = args.depths or (every if adaptive else defaults["depths"])
    args.budgets = args.budgets or defaults["budgets"]
    args.tokens = args.tokens or defaults["tokens"]
    # the values no sweep can take
    lacks_budgets = args.sweep == "scale_c" and not args.budgets
    if lacks_budgets or args.sweep != "scale_c" and not args.tokens:
        p.error(f"--sweep {args.sweep} needs "
                f"{'--budgets' if args.sweep == 'scale_c' else '--tokens'}")
    if (min(args.depths) < 1 or min(args.budgets + args.tokens) <= 0 or args.width < 3
            or args.jobs < 0 or args.repeat < 0):
        p.error("--depths must be 1 or more, --budgets and --tokens positive, --width 3 "
                "or more (a parabola), --jobs and --repeat 0 or more")
    return args


def run_settings(args, train_args):
    """train_runner's settings from the command line: train.py's flags as the sweep sets
    them (--eval-steps 16, --weight-decay, a device batch, the corpus), then
    --train-args."""
    import train
    # the sweep's train.py flags, then --train-args (the last occurrence wins)
    sweep_flags = ["--eval-steps", "16", "--weight-decay", str(args.weight_decay),
                   "--device-batch-size", str(min(16, args.batch // args.seq_len))]
    if args.corpus == "python-source":
        sweep_flags += ["--data", python_source(args.out)]
    targs = train.parse_args([*sweep_flags, *train_args])
    shape = Shape(batch=args.batch, vocab_size=args.vocab_size,
                  aspect_ratio=args.aspect_ratio, head_dim=args.head_dim, T=args.seq_len)
    optim = {f.name: getattr(targs, f.name) for f in dataclasses.fields(train.Optim)}
    distributed = dict(coordinator=targs.coordinator, num_processes=targs.num_processes,
                       process_id=targs.process_id, distributed=targs.distributed)
    return RunSettings(
        out=args.out, shape=shape, device_batch_size=targs.device_batch_size,
        eval_steps=targs.eval_steps, data_paths=targs.data, optim=optim,
        tokenizer_max_chars=targs.tokenizer_max_chars, compile_cache=targs.compile_cache,
        model=dict(window_pattern=targs.window_pattern, dtype=targs.dtype),
        run=dict(attention=targs.attention, data_shards=targs.data_shards,
                 debug=targs.debug),
        distributed=distributed, together=args.together)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, f"{args.sweep}.csv")
    t = time.perf_counter()
    # 1. the runs the CSV lacks (process 0 of a multi-host run writes, fits and plots)
    if not args.fit_only:
        settings = run_settings(args, shlex.split(args.train_args))
        adaptive = None
        if args.adaptive:
            adaptive = Adaptive(width=args.width, repeat=args.repeat,
                                convention=args.params_convention)
        seeds = range(args.seed, args.seed + args.seeds)
        writes = train_sweep(args.sweep, csv_path, settings, args.depths,
                             budgets=args.budgets, tokens=args.tokens, seeds=seeds,
                             jobs=args.jobs, adaptive=adaptive, restart=argv is None)
        if not writes:
            return None
    # 2. the fits and plots
    rows = scaling_fits.read_results(csv_path)
    if not rows:
        sys.exit(f"error: no results in {csv_path}: run without --fit-only first")
    res = scaling_fits.analyze(args.sweep, rows, args.out, args.params_convention,
                               args.bootstrap, args.seed)
    minutes = (time.perf_counter() - t) / 60
    print(f"wrote {csv_path} and plots to {args.out}/ in {minutes:.1f} min")
    return res


if __name__ == "__main__":
    try:
        main()
    # bad input: one line, no traceback
    except (ValueError, FileNotFoundError, ImportError) as e:
        sys.exit(f"error: {e}")
    # Ctrl-C: where to go on from
    except KeyboardInterrupt as e:
        sys.exit(str(e) or "interrupted")
