"""Scaling laws for nanochat in JAX: sweeps run in-process through train.py, and the command line.
The fits and plots (nanochat's isoFLOP analysis, Chinchilla's arXiv 2203.15556) are
scaling_fits.py's, in plain numpy.

    python scaling.py                                 # scale_c: 1.5 decades, grids around N*(C)
    python scaling.py --sweep scale_n --tokens 2e6    # loss vs size: L(N) = E + A N^-alpha
    python scaling.py --sweep scale_d --depths 3 --tokens 2.5e5 5e5 1e6 2e6
    python scaling.py --fit-only --params-convention total
    python scaling.py --no-adaptive --depths 2 3 4 5 6   # nanochat's grid: every depth, every C

- Sweeps (nanochat's runs/scaling_laws.sh): scale_c trains depths at FLOP budgets C with
  num_iterations = round(C / (estimate_flops(cfg) * batch tokens)); scale_n and scale_d train a
  grid of depths x token counts. Each run calls `train.run_stage` with train.py's defaults but
  --eval-steps 16 and --weight-decay (then --train-args), in its own checkpoint root under
  --out/runs, and appends one row to --out/<sweep>.csv (scaling_fits.COLUMNS: nanochat's columns
  plus seed). Rows already there are skipped and half-done runs continue from their checkpoint,
  so an interrupted sweep resumes.
- --together trains a run's seeds as one program (`train_together`: params, optimizer states and
  data streams stacked, the train step vmapped; tested equal to the runs one by one). On a CPU it
  is slower than one by one (the vmapped backward pass is the cost), so it is off by default; it
  is for accelerators, where one tiny model leaves the chip idle.
- The default scale_c: budgets 4e11 to 1.27e13 FLOPs (4, half a decade apart: 1.5 decades; below
  them the optimum would lie under d2, the smallest model nanochat's smear gate allows at this
  aspect ratio), aspect ratio 12 and head_dim 12 (d2 = 23K to d8 = 0.9M kaplan params), T = 128,
  vocab 384, 2,048 tokens per step, on the python-source corpus.
  adaptive_sweep picks each budget's depths: --width (4) around the running estimate of N*(C),
  widened a depth at a time until the parabola's vertex (the isoFLOP fit's N*) is inside.
  --no-adaptive trains every --depths at every budget instead. --repeat: the default sweep's
  second seed at the small budgets' two best depths, so that the fits' intervals hold the seeds'
  spread (as --seeds N does everywhere).
- --jobs (worker_pool): runs trained at once, each process on its share of the cores (default:
  one per core on a CPU), since one tiny model keeps about one core busy.
- --corpus python-source (default): the standard library's source and the installed numpy's and
  jax's (python_source); adaptive_sweep trains no run longer than one pass of the loader over it
  (corpus_room), so no run reads a token twice (each row records the loader's data_epoch);
  docstrings: train.py's default corpus.
- Weight decay: nanochat scales the Muon weight decay as 0.28 sqrt(B / 2^19) D_REF / D
  (calibrated at d12 with half-million-token batches). For the default sizes that is wd 1.6 (d8)
  to 65 (d2): Muon's lr * wd reaches 1.3, where a decay step shrinks a weight past zero. The sweep
  trains without it by default (--weight-decay 0.28 restores it).
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

# jax and the modules of ours on it are imported where they are used: --fit-only needs numpy only,
# and a --jobs worker is pinned to its cores before JAX starts its threads.

# ---------------------------------------------------------------------------------- sweeps


def model_row(cfg):
    """The CSV's model columns for a config (nanochat's names)."""
    import nanochat as nc
    p = nc.num_scaling_params(cfg)
    return {"depth": cfg.n_layer, "model_dim": cfg.n_embd, "params_wte": p["wte"],
            "params_value_embeds": p["value_embeds"], "params_lm_head": p["lm_head"],
            "params_transformer": p["transformer_matrices"], "params_scalars": p["scalars"],
            "params_total": p["total"]}


def plan(sweep, depths, budgets=(), tokens=(), batch=2048, vocab_size=384, aspect_ratio=12,
         head_dim=12, T=128):
    """Run specs {flops_budget, depth, model_dim, num_iterations} of a sweep: scale_c crosses
    depths with FLOP budgets (num_iterations = C / (flops per token x batch)); scale_n and scale_d
    cross depths with token counts."""
    import nanochat as nc
    specs = []
    for d in depths:
        cfg = nc.config_for_depth(d, vocab_size, aspect_ratio, head_dim, sequence_len=T)
        f = nc.estimate_flops(cfg)
        if sweep == "scale_c":
            specs += [{"flops_budget": c, "depth": d, "model_dim": cfg.n_embd,
                       "num_iterations": max(1, round(c / (f * batch)))} for c in budgets]
        else:
            specs += [{"flops_budget": f * batch * max(1, round(t / batch)), "depth": d,
                       "model_dim": cfg.n_embd, "num_iterations": max(1, round(t / batch))}
                      for t in tokens]
    return specs


def run_sweep(specs, csv_path, runner, seeds=(0,), write=True, pool=None):
    """Run every (spec, seed) whose row is not yet in csv_path, the seeds of a spec in one runner
    call (with a pool, worker_pool's, several specs at once), appending the rows in order as they
    finish (if write: one process of a multi-host run writes); returns all rows."""
    done = {scaling_fits.run_key(r) for r in scaling_fits.read_results(csv_path)}
    todo = [[dict(spec, seed=seed) for seed in seeds
             if scaling_fits.run_key(dict(spec, seed=seed)) not in done] for spec in specs]
    for i, (spec, runs) in enumerate(zip(specs, todo)):
        print(f"[{i + 1}/{len(specs)}] {'run' if runs else 'skip (done)'}: {spec}, seeds "
              f"{[r['seed'] for r in runs] or list(seeds)}", flush=True)
    todo = [runs for runs in todo if runs]
    for runs, rows in zip(todo, (pool.map if pool else map)(runner, todo)):
        for run, row in zip(runs, rows):
            if write:
                scaling_fits.append_result(csv_path, dict(run, **row))
    return scaling_fits.read_results(csv_path)


def optimum_estimate(rows, C):
    """The running estimate of N*(C) from the runs at smaller budgets: before any optimum,
    Chinchilla's D = 20 N; after one, N* ~ C^0.5 from it; after two or more, the isoFLOP fit's
    N* ~ C^a."""
    optima = scaling_fits.fit_isoflop(rows)["optima"] if rows else np.zeros((0, 5))
    if len(optima) >= 2:
        a, log_k = np.polyfit(np.log10(optima[:, 0]), np.log10(optima[:, 1]), 1)
        return 10 ** (a * np.log10(C) + log_k)
    if len(optima):
        return optima[-1, 1] * (C / optima[-1, 0]) ** 0.5
    return (C / 120) ** 0.5  # C = 6 N D with D = 20 N


def adaptive_sweep(budgets, csv_path, runner, spec_of, sizes, seeds=(0,), write=True, width=4,
                   pool=None, repeat=0):
    """scale_c with the grid chosen from the data: the budgets in increasing order, each trained
    at `width` depths around the running estimate of N*(C) (optimum_estimate), extended a depth at
    a time while the optimum lies outside the grid: the vertex of the parabola through the runs
    (mean over seeds), as the isoFLOP fit finds it, or where the runs do not curve upward the best
    run, on an edge. So every budget has runs on both sides of its optimum (a best run on an edge
    with the vertex inside is the seeds' noise on a flat bottom, not a reason to train one more
    size). Then the `repeat` best runs of every budget up to a tenth of the largest get one more
    seed, so that the fits' residuals hold the seeds' spread, measured where runs are cheap (the
    larger budgets cost most of a sweep). The choices follow from the CSV, so a resumed sweep
    makes the same ones. spec_of(depth, C) -> spec, or None where the run would read past the
    corpus; sizes: {depth: N}."""
    budgets, more = sorted(budgets), [max(seeds) + 1]
    for C in budgets:
        before = [r for r in scaling_fits.read_results(csv_path)
                  if r["flops_budget"] < C * (1 - 1e-9)]
        n_star = optimum_estimate(before, C)
        depths = [d for d in sorted(sizes) if spec_of(d, C)]  # the sizes whose run fits the corpus
        if len(depths) < width:
            raise SystemExit(f"C = {C:.3g}: {len(depths)} sizes have runs that fit in the corpus, "
                             f"a grid needs {width}; give smaller --budgets or a larger corpus")
        centre = min(range(len(depths)), key=lambda i: abs(math.log(sizes[depths[i]] / n_star)))
        # an even width: one more above
        lo = max(0, min(centre - (width - 1) // 2, len(depths) - width))
        grid = depths[lo:lo + width]
        while True:
            trained = run_sweep([spec_of(d, C) for d in grid], csv_path, runner, seeds, write, pool)
            rows = [r for r in trained if abs(r["flops_budget"] / C - 1) < 1e-6
                    and r["depth"] in grid and int(r["seed"]) in seeds]
            bpb = {d: np.mean([r["val_bpb"] for r in rows if r["depth"] == d]) for d in grid}
            x, y = np.log10([sizes[d] for d in grid]), np.array([bpb[d] for d in grid])
            # the isoFLOP fit's N*, before fit_isoflop pins it inside the runs
            vertex = scaling_fits.parabola_min(x, y)[1]
            i = depths.index(grid[0])
            if vertex <= x[0] and i > 0:
                grid.insert(0, depths[i - 1])
            elif vertex >= x[-1] and grid[-1] != depths[-1]:
                grid.append(depths[depths.index(grid[-1]) + 1])
            else:
                break
        if vertex <= x[0]:  # no smaller size to widen to
            why = ("is the smallest model there is; the optimum may lie below it (give larger "
                   "--budgets)" if grid[0] == min(sizes) else "is the smallest whose tokens fit "
                   "in the corpus; the optimum may lie below it (give a larger corpus or smaller "
                   "--budgets)")
            print(f"C = {C:.3g}: the smallest run, d{grid[0]}, {why}", flush=True)
        if C <= budgets[-1] / 10 * (1 + 1e-9) and repeat:
            best = sorted(bpb, key=bpb.get)[:repeat]
            run_sweep([spec_of(d, C) for d in best], csv_path, runner, more, write, pool)
    return scaling_fits.read_results(csv_path)


def python_source(out, min_chars=100, max_chars=250):
    """The scaling corpus, written once to out/python_source.jsonl: this Python's standard library
    source and the source of the numpy and jax it runs on (their .py files, tests included: the
    default corpus's docstrings are inside it, so it replaces that corpus rather than joining it),
    cut at blank lines into documents of min_chars to max_chars (about one 128-token row), exact
    repeats dropped. Offline and the same on every machine with the same Python and
    requirements.txt; a sweep's runs then read each token at most once."""
    import sysconfig
    import jax
    import data
    path = os.path.join(out, "python_source.jsonl")
    if os.path.isfile(path):
        return path
    stdlib, docs = sysconfig.get_paths()["stdlib"], {}
    roots = (stdlib, os.path.dirname(np.__file__), os.path.dirname(jax.__file__))
    files = sorted(os.path.join(d, f) for root in roots
                   for d, _, fs in os.walk(root) if root != stdlib or "site-packages" not in d
                   for f in fs if f.endswith(".py"))
    for name in files:
        doc, n = [], 0
        with open(name, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True) + ["\n"]
        for line in lines:
            doc.append(line)
            n += len(line)
            if n >= max_chars or not line.strip() and n >= min_chars:
                docs.setdefault("".join(doc).strip(), None)  # a dict: repeats dropped, order kept
                doc, n = [], 0
    docs = [d for d in docs if d]
    order = np.random.default_rng(0).permutation(len(docs))
    # shuffled once: each run reads the same mix from the start
    data.write_atomic(path, "".join(json.dumps({"text": docs[i]}) + "\n" for i in order))
    return path


def corpus_room(tok, paths, B, T):
    """Tokens a run can train on before train.py's loader (paths as its --data, B rows of T + 1
    tokens a batch) reads a document a second time: one pass of the loader, counted. Best-fit
    packing crops what does not fit in a row and drops the rest, so a corpus's token count
    overstates it."""
    import data
    batches = data.pretrain_batches(tok, data.corpus(paths, "train"), B, T)
    for n, (_, _, state) in enumerate(batches):
        # this batch's buffer holds the first documents again; the batches before it do not
        if state["epoch"] > 0:
            return n * B * T


def train_runner(out, batch=2048, device_batch_size=16, vocab_size=384, aspect_ratio=12,
                 head_dim=12, T=128, eval_steps=16, data_paths=(), optim=None,
                 tokenizer_max_chars=2e9, compile_cache="", model=None, run=None,
                 distributed=None, together=False, restart=False):
    """A runner for run_sweep: one spec's seeds trained by train.run_stage in-process one by one,
    each in its own checkpoint root under out/runs (an interrupted run resumes from it), or with
    together=True as one vmapped program (train_together; an interrupted group starts over).
    optim: train.Optim's values (the batch is `batch`); model: train.model_config's more
    keywords (window_pattern, dtype); run: train.Run's (attention, data_shards, debug);
    distributed: sharding.init_distributed's; restart: runtime.tune_malloc's."""
    import jax
    import checkpoint
    import data
    import runtime
    import train
    runtime.tune_malloc(restart)  # as train.py does
    runtime.use_compile_cache(compile_cache)  # a resumed sweep skips compiles
    sharding.init_distributed(**(distributed or {}))  # on a pod every host runs the sweep
    tok = data.tokenizer_for(out, data_paths, vocab_size, tokenizer_max_chars,
                             write=jax.process_index() == 0)  # one tokenizer for every run
    optim, run = {**(optim or {}), "total_batch_size": batch}, run or {}

    def run_of(spec):
        """(the run's checkpoint root, its stage, its warmup steps)"""
        d, n, seed = int(spec["depth"]), int(spec["num_iterations"]), int(spec["seed"])
        name = f"d{d}_ar{aspect_ratio}_hd{head_dim}_v{vocab_size}_T{T}_b{batch}_n{n}_s{seed}"
        cfg = train.model_config(tok.n_vocab, d, aspect_ratio, head_dim, T, **(model or {}))
        docs = data.corpus(data_paths, "train", seed=seed)
        stage = train.base_stage(cfg, docs, jax.random.key(seed), n)
        return os.path.join(out, "runs", name), stage, min(40, n // 5)

    def one(spec):
        t = time.perf_counter()
        root, stage, warmup = run_of(spec)
        evals = dict(val_docs=data.corpus(data_paths, "val"), eval_every=stage.iterations,
                     eval_steps=eval_steps, sample_every=0)
        settings = train.Run(out=root, device_batch_size=device_batch_size, resume=True, keep=1,
                             **run)
        optim_of_run = train.Optim(**{**optim, "warmup_steps": warmup})
        _, cfg, _, info = train.run_stage(stage, tok, settings, optim_of_run, evals)
        with open(os.path.join(checkpoint.latest_checkpoint(root, ("base",)), "meta.json")) as f:
            epoch = max(s["epoch"] for s in json.load(f)["data_states"])
        return dict(model_row(cfg), num_iterations=info["steps"],
                    tokens_trained=info["steps"] * batch, val_bpb=info["val_bpb"],
                    train_time_sec=time.perf_counter() - t, data_epoch=epoch)

    def train_specs(specs):
        if not (together and len(specs) > 1):
            return [one(spec) for spec in specs]
        t = time.perf_counter()
        stages = [run_of(spec)[1] for spec in specs]
        warmup = run_of(specs[0])[2]
        cfg, steps, _, bpb = train_together(stages, tok, device_batch_size,
                                            train.Optim(**{**optim, "warmup_steps": warmup}),
                                            data.corpus(data_paths, "val"), eval_steps,
                                            attention=run.get("attention", "auto"))
        return [dict(model_row(cfg), num_iterations=steps, tokens_trained=steps * batch,
                     val_bpb=b, train_time_sec=(time.perf_counter() - t) / len(specs))
                for b in bpb]
    return train_specs


def worker_pool(jobs, **runner_kwargs):
    """`jobs` worker processes for run_sweep, each pinned to its share of this process's CPU cores
    (before XLA sizes its thread pool) and running a train_runner(**runner_kwargs): the sweep's
    tiny models keep about one core busy each, so runs side by side share the cores well."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of JAX's threads
    cores = ctx.Queue()
    for share in np.array_split(sorted(os.sched_getaffinity(0)), jobs):
        cores.put({int(c) for c in share})
    return concurrent.futures.ProcessPoolExecutor(jobs, ctx, initializer=_start_worker,
                                                  initargs=(cores, runner_kwargs))


_WORKER = {"stopped": False}  # a worker process's runner, and whether it has seen a Ctrl-C


def _start_worker(cores, runner_kwargs):
    os.sched_setaffinity(0, cores.get())
    signal.signal(signal.SIGINT, _interrupted)  # outside a run's training loop, which saves first
    _WORKER["run"] = train_runner(**runner_kwargs)


def _interrupted(*_):
    _WORKER["stopped"] = True
    raise KeyboardInterrupt


def _worker_run(specs):
    """The worker's runner on specs; after a Ctrl-C it starts none (the pool hands a worker its
    next one early)."""
    if _WORKER["stopped"]:
        raise KeyboardInterrupt("not started: the sweep was interrupted")
    try:
        return _WORKER["run"](specs)
    except KeyboardInterrupt:
        _WORKER["stopped"] = True
        raise


def train_together(stages, tok, device_batch_size, optim, val_docs, eval_steps, lrs=None,
                   attention="auto"):
    """Train one model size under several seeds as one compiled program: the runs' params,
    optimizer states and data streams (train.base_stage's, which must agree on all but the seed)
    stacked on a leading axis, train.train_step vmapped over it; lrs: one train.learning_rates
    dict per run, to train several learning rates together. Returns (cfg, steps, each run's
    losses (steps, runs), each run's final val bits per byte), as train.run_stage would give them
    one by one."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import data
    import evaluate
    import kernels
    import muon
    import nanochat as nc
    import train
    cfg = stages[0].cfg
    T, rows = cfg.sequence_len, device_batch_size * jax.device_count()
    sched, base_lrs, batch, _ = train.packed_plan(stages[0], optim, rows)

    def stack(trees):
        return jax.tree.map(lambda *x: jnp.stack(x), *trees)
    lrs = stack(lrs or [base_lrs] * len(stages))  # {name: (runs,)}
    inits = [s.init() for s in stages]
    params, opt_state = stack(inits), stack([muon.init(p, *nc.param_groups(p)) for p in inits])
    batch_sharding = NamedSharding(sharding.data_mesh(), P(None, "data"))
    shape = (batch // (rows * T), rows, T)
    process = (jax.process_index(), jax.process_count())
    streams = [data.process_batches(s.packer, tok, s.docs, shape, process=process)[0]
               for s in stages]
    step = functools.partial(train.train_step, cfg=cfg, attn=kernels.attention_fn(attention))
    step_fn = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None, None, 0)), donate_argnums=(0, 1))
    losses = []
    for i in range(sched["num_iterations"]):
        inputs, targets = zip(*(sharding.global_arrays(next(stream)[:2], batch_sharding)
                                for stream in streams))
        batch_i = (jnp.stack(inputs), jnp.stack(targets))
        params, opt_state, m = step_fn(params, opt_state, batch_i, i, sched, lrs)
        losses.append(np.asarray(m["loss"]))
        if not np.asarray(m["finite"]).all():
            raise FloatingPointError(f"step {i}: a loss is not finite ({losses[-1]}); lower the "
                                     "learning rates")
    token_bytes = jnp.asarray(tok.token_bytes())
    bpb = [evaluate.evaluate_bpb(jax.tree.map(lambda x: x[i], params), cfg,
                                 data.pretrain_batches(tok, val_docs, device_batch_size, T),
                                 token_bytes, eval_steps) for i in range(len(stages))]
    return cfg, sched["num_iterations"], np.array(losses), bpb


def adaptive_grid(candidates, convention, out, data_paths, device_batch_size, shape):
    """adaptive_sweep's sizes {depth: N} among the candidate depths (those the aspect ratio
    allows) and its spec_of(depth, C): plan's spec, None where the run would read past the corpus
    (corpus_room). shape: plan's batch, vocab_size, aspect_ratio, head_dim and T."""
    import data
    import nanochat as nc
    sizes = {}
    for d in candidates:
        with contextlib.suppress(ValueError):  # too narrow for this aspect ratio
            cfg = nc.config_for_depth(d, shape["vocab_size"], shape["aspect_ratio"],
                                      shape["head_dim"], sequence_len=shape["T"])
            sizes[d] = scaling_fits.effective_params([model_row(cfg)], convention)[0]
    tok = data.Tokenizer.load(os.path.join(out, "tokenizer.json"))  # train_runner's
    room = corpus_room(tok, data_paths, device_batch_size, shape["T"])
    print(f"corpus: {room / 1e6:.1f}M tokens to train on before any repeats", flush=True)

    def spec_of(d, c):
        spec = plan("scale_c", [d], [c], (), **shape)[0]
        return spec if spec["num_iterations"] * shape["batch"] <= room else None
    return sizes, spec_of


def train_sweep(sweep, csv_path, runner_kwargs, depths, budgets=(), tokens=(), seeds=(0,),
                jobs=0, adaptive=True, width=4, repeat=2, convention="kaplan", restart=False):
    """Train the sweep's runs that csv_path lacks: scale_c with adaptive=True by adaptive_sweep
    (depths: its candidates), else the whole plan by run_sweep; jobs runs at once in worker_pool
    (0: one per core on a CPU, else 1). runner_kwargs: train_runner's. Returns whether this
    process writes the results (process 0 of a multi-host run)."""
    runner = train_runner(**runner_kwargs, restart=restart)  # here: the one tokenizer, trained
    import jax  # used after train_runner, which joins a multi-host run
    cpu = jax.default_backend() == "cpu"
    jobs = jobs or (len(os.sched_getaffinity(0)) if cpu and not runner_kwargs["together"] else 1)
    if jobs > 1 and jax.process_count() > 1:
        raise ValueError("--jobs is for one process: a multi-host sweep trains each run on every "
                         "host")
    shape = {k: runner_kwargs[k] for k in ("batch", "vocab_size", "aspect_ratio", "head_dim", "T")}
    pool = worker_pool(jobs, **runner_kwargs) if jobs > 1 else None
    try:
        runner = _worker_run if pool else runner
        if not (adaptive and sweep == "scale_c"):
            specs = plan(sweep, depths, budgets, tokens, **shape)
            run_sweep(specs, csv_path, runner, seeds, jax.process_index() == 0, pool)
        elif jax.process_count() > 1:
            raise ValueError("--adaptive is for one process: its choices follow from results only "
                             "process 0 writes")
        else:
            sizes, spec_of = adaptive_grid(depths, convention, runner_kwargs["out"],
                                           runner_kwargs["data_paths"],
                                           runner_kwargs["device_batch_size"], shape)
            adaptive_sweep(budgets, csv_path, runner, spec_of, sizes, seeds, width=width,
                           pool=pool, repeat=repeat)
    except KeyboardInterrupt:  # a run's "continue with --resume" is train.py's: the sweep resumes
        raise KeyboardInterrupt("interrupted: the runs in progress saved a checkpoint; the same "
                                "command resumes the sweep") from None
    finally:  # on Ctrl-C (every worker gets it too, and saves its run) the queued runs never start
        if pool:
            pool.shutdown(cancel_futures=True)
    return jax.process_index() == 0

# ---------------------------------------------------------------------------------- command line

DEFAULTS = {"scale_c": {"depths": [2, 3, 4, 5, 6], "budgets": [4e11, 1.27e12, 4e12, 1.27e13],
                        "tokens": []},
            "scale_n": {"depths": [2, 3, 4, 5, 6], "budgets": [], "tokens": [1e6]},
            "scale_d": {"depths": [2], "budgets": [], "tokens": [1.25e5, 2.5e5, 5e5, 1e6, 2e6]}}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def _per_sweep(key):
    """DEFAULTS[sweep][key] of the sweeps that have one, for --help."""
    return "; ".join(f"{s}: {' '.join(f'{v:g}' for v in d[key])}"
                     for s, d in DEFAULTS.items() if d[key])


def parse_args(argv=None):
    """The command line, with the sweep's defaults filled in for --depths, --budgets, --tokens."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    a = p.add_argument
    a("--sweep", default="scale_c", choices=list(DEFAULTS), help="what to sweep (see above)")
    a("--depths", type=int, nargs="*", help="model sizes (None: with scale_c --adaptive, 1 to "
      f"24, those the aspect ratio allows; else the sweep's, {_per_sweep('depths')})")
    a("--adaptive", action=argparse.BooleanOptionalAction, default=True,
      help="scale_c: choose each budget's depths (among --depths, if given) around the running "
      "estimate of N*(C), widening the grid until the optimum is inside it (adaptive_sweep); "
      "--no-adaptive: every depth at every budget")
    a("--width", type=int, default=4, help="--adaptive: depths per budget before any widening")
    a("--repeat", type=int, default=2, help="--adaptive: the best runs of every budget up to a "
      "tenth of the largest trained with one more seed, so that the intervals hold the seeds' "
      "spread")
    a("--corpus", default="python-source", choices=["docstrings", "python-source"],
      help="docstrings: train.py's default corpus; python-source: the standard library's, "
      "numpy's and jax's source, so that large budgets never read a token twice")
    a("--budgets", type=float, nargs="*", help="scale_c: training FLOP budgets C (None: the "
      f"sweep's, {_per_sweep('budgets')})")
    a("--tokens", type=float, nargs="*", help="scale_n / scale_d: tokens per run (None: the "
      f"sweep's, {_per_sweep('tokens')})")
    a("--seed", type=int, default=0, help="training seed (init, data order) and bootstrap seed")
    a("--seeds", type=int, default=1, help="train each run with this many seeds: --seed, "
      "--seed+1, ...")
    a("--jobs", type=int, default=0, help="runs trained at once, each in its own process on its "
      "share of the cores (0: one per core on a CPU, else 1)")
    a("--together", action="store_true", help="train a run's seeds as one vmapped program "
      "(slower than one by one on a CPU, docs/scaling-laws.md; for accelerators)")
    a("--params-convention", default="kaplan", choices=list(scaling_fits.CONVENTIONS),
      help="N for the fits: kaplan = transformer matrices + lm_head (nanochat), total, "
      "transformer")
    a("--out", default="scaling_results", help="results CSV, plots and one checkpoint root per run")
    a("--batch", type=int, default=2048, help="tokens per step")
    a("--seq-len", type=int, default=128, help="context length T")
    a("--vocab-size", type=int, default=384, help="tokenizer vocab size")
    a("--aspect-ratio", type=int, default=12, help="model_dim = depth x aspect ratio")
    a("--head-dim", type=int, default=12, help="attention head size")
    a("--bootstrap", type=int, default=200, help="bootstrap resamples for the 90%% intervals")
    a("--fit-only", action="store_true", help="fit and plot the existing CSV, train nothing")
    a("--weight-decay", type=float, default=0.0, help="train.py's --weight-decay (nanochat: "
      "0.28), scaled by nanochat's rule; see the notes above")
    a("--train-args", default="", help="train.py flags for every run, e.g. '--matrix-lr 0.03': "
      "its optimization, --data, --window-pattern, --dtype, --attention, --device-batch-size, "
      "--eval-steps and multi-host flags (the sweep sets the stage, sizes and horizons)")
    args = p.parse_args(argv)
    d = DEFAULTS[args.sweep]
    adaptive = args.adaptive and args.sweep == "scale_c"
    every = list(range(1, 25))  # adaptive_grid keeps the sizes the aspect ratio allows
    args.depths = args.depths or (every if adaptive else d["depths"])
    args.budgets, args.tokens = args.budgets or d["budgets"], args.tokens or d["tokens"]
    if args.sweep == "scale_c" and not args.budgets or args.sweep != "scale_c" and not args.tokens:
        p.error(f"--sweep {args.sweep} needs "
                f"{'--budgets' if args.sweep == 'scale_c' else '--tokens'}")
    if (min(args.depths) < 1 or min(args.budgets + args.tokens) <= 0 or args.width < 3
            or args.jobs < 0 or args.repeat < 0):
        p.error("--depths must be 1 or more, --budgets and --tokens positive, --width 3 or more "
                "(a parabola), --jobs and --repeat 0 or more")
    return args


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    csv_path = os.path.join(args.out, f"{args.sweep}.csv")
    t = time.perf_counter()
    if not args.fit_only:
        import train
        # the sweep's train.py flags; --train-args, after them, override them
        sweep_flags = ["--eval-steps", "16", "--weight-decay", str(args.weight_decay),
                       "--device-batch-size", str(min(16, args.batch // args.seq_len))]
        if args.corpus == "python-source":
            sweep_flags += ["--data", python_source(args.out)]
        targs = train.parse_args([*sweep_flags, *shlex.split(args.train_args)])
        runner_kwargs = dict(
            out=args.out, batch=args.batch, device_batch_size=targs.device_batch_size,
            vocab_size=args.vocab_size, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
            T=args.seq_len, eval_steps=targs.eval_steps, data_paths=targs.data,
            optim={f.name: getattr(targs, f.name) for f in dataclasses.fields(train.Optim)},
            tokenizer_max_chars=targs.tokenizer_max_chars, compile_cache=targs.compile_cache,
            model=dict(window_pattern=targs.window_pattern, dtype=targs.dtype),
            run=dict(attention=targs.attention, data_shards=targs.data_shards, debug=targs.debug),
            distributed=dict(coordinator=targs.coordinator, num_processes=targs.num_processes,
                             process_id=targs.process_id, distributed=targs.distributed),
            together=args.together)
        writes = train_sweep(args.sweep, csv_path, runner_kwargs, args.depths, args.budgets,
                             args.tokens, range(args.seed, args.seed + args.seeds), args.jobs,
                             args.adaptive, args.width, args.repeat, args.params_convention,
                             restart=argv is None)
        if not writes:
            return None  # process 0 writes, fits and plots
    rows = scaling_fits.read_results(csv_path)
    if not rows:
        sys.exit(f"error: no results in {csv_path}: run without --fit-only first")
    res = scaling_fits.analyze(args.sweep, rows, args.out, args.params_convention, args.bootstrap,
                               args.seed)
    print(f"wrote {csv_path} and plots to {args.out}/ in {(time.perf_counter() - t) / 60:.1f} min")
    return res


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:  # Ctrl-C: where to go on from
        sys.exit(str(e) or "interrupted")
