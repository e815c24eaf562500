"""Benchmarks that print one JSON line each, to compare machines and commits side by side.

    python bench.py tokenizer    # BPE training on 5 MB of text to vocab 4096, then encoding
    python bench.py decode       # KV-cache generation: 16-token prompt, 200 new tokens, batch 1, 8
    python bench.py train        # the whole training step (fwd, bwd, MuonAdamW) of three models
    python bench.py accel        # on a GPU or TPU: nanochat's recipe at d12 and d20 (524,288
                                 # tokens a step, T 2048, bf16), without and with --remat
    python bench.py serve        # 1, 4, 16 concurrent streams through the slot engine (engine.py)
    python bench.py serve --infer-bench d6   # nanochat's infer_bench protocol, its JSON last;
                                 # these and serve's other benchmarks: bench_serving.py
    python bench.py memory --depth 26 --devices 8 --shard full --fit 16 32 80
                                 # per-device memory of nanochat's d26 train step, compiled for 8
                                 # emulated devices; the largest device batch fitting each GB
    python bench.py memory --real --devices 1 --depth 20 --remat --device-batch-size 8
                                 # the accelerator's own plan of one device (train.py's)

Speed is measured here, never in a timed unit test; docs/performance.md has the method and the
numbers.
"""
import os
import time

# The time to the first step counts from here: imports, init, trace, compile and the step.
# BENCH_START carries it over runtime.tune_malloc's restart (onto huge pages, as train.py does).
START = float(os.environ.get("BENCH_START", time.time()))

import argparse
import functools
import json
import pathlib
import statistics
import subprocess
import sys
import sysconfig
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import bench_serving
import data
import engine
import kernels
import lora
import muon
import nanochat as nc
import report
import runtime
import sharding
import train

# The models PyTorch nanochat was measured on beside us (docs/performance.md; bench_serving's
# CONFIGS), and their batches.
BATCH = {"nano-char": (32, 256), "nano": (32, 256), "d6": (8, 512)}
CONFIGS = bench_serving.CONFIGS


def bench_tokenizer(mb=5.0, vocab_size=4096, repeats=3):
    """Train the BPE on mb MB of distinct text (the default corpus, then the stdlib's own source
    files): the median times of training and of encoding."""
    n, pieces = int(mb * 1e6), data.default_corpus()
    size = sum(map(len, pieces))
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if size >= n:
            break
        pieces.append(path.read_text(errors="replace"))
        size += len(pieces[-1])
    text = "\n\n".join(pieces)[:n]
    times, encode_times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tok = data.train_tokenizer([text], vocab_size)
        times.append(time.perf_counter() - t0)
    for _ in range(repeats):
        t0 = time.perf_counter()
        ids = tok.encode(text)
        encode_times.append(time.perf_counter() - t0)
    megabytes = len(text.encode()) / 1e6
    print(json.dumps({"bench": "tokenizer", "text_mb": round(megabytes, 2),
                      "vocab_size": tok.n_vocab, "train_s": round(statistics.median(times), 3),
                      "train_runs": len(times),
                      "encode_mb_per_s": round(megabytes / statistics.median(encode_times), 2),
                      "bytes_per_token": round(megabytes * 1e6 / len(ids), 3)}))


def generate_timing(params, cfg, batch, prompt_len=16, new=200, repeats=3):
    """nanochat's Engine benchmark: a random prompt, `new` tokens sampled at temperature 1 for
    `batch` rows; the first generate call (compiling prefill and decode), then the median, and the
    prefill alone."""
    prompt = list(np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len))
    attn = kernels.attention_fn()

    def run():
        steps = engine.generate(params, cfg, prompt, engine.Sampling(max_tokens=new, seed=1),
                                num_samples=batch, attn=attn)
        return sum(1 for _ in steps)
    t0 = time.perf_counter()
    run()
    first_s, times = time.perf_counter() - t0, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        steps = run()
        times.append(time.perf_counter() - t0)
    p = engine.prepare(params, cfg)  # as generate
    tokens = np.array([prompt], np.int32)
    max_len = min(engine.bucket(prompt_len + new), cfg.sequence_len)

    def prefill():
        out = engine.prefill(p, tokens, prompt_len, jax.random.key(1), (1.0, 0, 1.0), cfg=cfg,
                             max_len=max_len, num_samples=batch, attn=attn)
        return jax.block_until_ready(out)
    prefill()
    t0 = time.perf_counter()
    for _ in range(10):
        prefill()
    prefill_s = (time.perf_counter() - t0) / 10
    return {"batch": batch, "prompt": prompt_len, "new_tokens": steps,
            "decode_tok_per_s": round(batch * steps / statistics.median(times)),
            "first_generate_s": round(first_s, 2), "prefill_ms": round(prefill_s * 1e3, 2),
            "prefill_tok_per_s": round(prompt_len / prefill_s)}


def bench_decode(configs=("nano", "d6"), repeats=3):
    """nanochat's Engine benchmark: a 16-token prompt, 200 sampled tokens, batch 1 and 8."""
    peak = report.peak_flops()[0]  # a 1024^2 fp32 matmul's FLOP/s here
    for name in configs:
        cfg = CONFIGS[name]
        params = nc.init_params(cfg, jax.random.key(0))
        for batch in (1, 8):
            r = generate_timing(params, cfg, batch, repeats=repeats)
            gflops = nc.estimate_flops(cfg) / 3 * r["decode_tok_per_s"] / 1e9  # the forward third
            print(json.dumps({"bench": "decode", "config": name,
                              "params": nc.num_scaling_params(cfg)["total"], **r,
                              "gflop_per_s": round(gflops, 2), "mfu": round(gflops * 1e9 / peak, 4),
                              "peak_rss_gb": round(bench_serving.peak_rss_gb(), 2)}), flush=True)


def train_step_timing(cfg, B, steps, warmup=3):
    """In this process: the time from its start to the first finished step, the first call alone
    (compile included), then the median step time, on random tokens (B, cfg.sequence_len)."""
    params = kernels.init_params(cfg, jax.random.key(0))
    opt_state = muon.init(params, *nc.param_groups(params))
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (1, B, cfg.sequence_len), dtype=np.int32)
            for _ in range(2))
    # train.py's settings; a nonzero Muon weight decay, so the cautious decay runs as it would
    sched, lrs = train.base_schedule(1000, weight_decay=0.2), train.learning_rates()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        params, opt_state, m = train.jit_train_step(params, opt_state, (x, y), i, sched, lrs,
                                                    cfg=cfg, attn=kernels.attention_fn())
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
        if i == 0:
            first = time.time() - START
    return {"first_step_s": first, "first_call_s": times[0],
            "step_s": statistics.median(times[warmup:]), "loss": float(m["loss"]),
            "peak_rss_gb": bench_serving.peak_rss_gb()}


def bench_train(configs=tuple(CONFIGS), steps=10):
    """Each model in a fresh process with an empty compilation cache (cold), then again with it
    filled (warm)."""
    peak = report.peak_flops()[0]  # a 1024^2 fp32 matmul's FLOP/s here
    for name in configs:
        cfg, (B, T) = CONFIGS[name], BATCH[name]
        runs = []
        with tempfile.TemporaryDirectory() as cache:
            for _ in ("cold", "warm"):
                cmd = [sys.executable, __file__, "train-child", "--configs", name, "--steps",
                       str(steps)]
                out = subprocess.run(cmd, env=dict(os.environ, BENCH_CACHE=cache),
                                     capture_output=True, text=True, check=True).stdout
                runs.append(json.loads(out.splitlines()[-1]))
        tok_s = B * T / statistics.median(r["step_s"] for r in runs)
        gflops = nc.estimate_flops(cfg) * tok_s / 1e9
        print(json.dumps({"bench": "train", "config": name,
                          "params": nc.num_scaling_params(cfg)["total"], "batch": [B, T],
                          "dtype": cfg.compute_dtype, "tok_per_s": round(tok_s),
                          "step_ms": round(B * T / tok_s * 1e3, 1),
                          "gflop_per_s": round(gflops, 1),
                          "sgemm_peak_gflop_per_s": round(peak / 1e9, 1),
                          "mfu": round(gflops * 1e9 / peak, 3),
                          "first_step_cold_s": round(runs[0]["first_step_s"], 2),
                          "first_step_warm_s": round(runs[1]["first_step_s"], 2),
                          "peak_rss_gb": round(max(r["peak_rss_gb"] for r in runs), 2),
                          "loss": round(runs[-1]["loss"], 4)}), flush=True)


RECIPE_TOKENS = 2**19  # nanochat's tokens a step (524,288)


def accel_child(depth, remat, steps):
    """nanochat's recipe in this process: d<depth> at T 2048 in bf16, the largest device batch
    whose step train.py's memory plan fits (train.plan_memory), micro-batches making up
    RECIPE_TOKENS a step, then `steps` timed steps after one more warm-up (0: the first step
    only)."""
    cfg = nc.config_for_depth(depth, 32768, sequence_len=2048, compute_dtype="bfloat16")
    params = kernels.init_params(cfg, jax.random.key(0))
    opt_state = jax.device_put(muon.init(params, *nc.param_groups(params)))
    step_fn = functools.partial(train.jit_train_step, sched=train.base_schedule(1000, 0.2),
                                lrs=train.learning_rates(), cfg=cfg, attn=kernels.attention_fn(),
                                layout=train.Layout(remat=remat))
    # 1. the plan: train.py's, on this device
    stage = train.Stage(name="base", cfg=cfg, init=None, iterations=0)
    run, _, planned = train.plan_memory(stage, train.Run(), RECIPE_TOKENS, step_fn,
                                        (params, opt_state, None, 0))
    B = run.device_batch_size
    A = RECIPE_TOKENS // (B * cfg.sequence_len)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (A, B, cfg.sequence_len), dtype=np.int32)
            for _ in range(2))
    # 2. the first step from process start, then the timed ones
    times = []
    for i in range(1 + (steps and steps + 1)):
        t0 = time.perf_counter()
        params, opt_state, metrics = step_fn(params, opt_state, (x, y), i)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        if i == 0:
            first = time.time() - START
    stats = jax.devices()[0].memory_stats() or {}
    return {"device_batch": B, "micro_batches": A, "planned_bytes": planned,
            "first_step_s": first, "step_s": statistics.median(times[2:]) if steps else None,
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "peak_bytes_reserved": stats.get("peak_bytes_reserved"),
            "loss": float(metrics["loss"])}


def bench_accel(depths=(12, 20), steps=5, remats=(False, True)):
    """nanochat's recipe (RECIPE_TOKENS a step, T 2048, bf16) at each depth, without and with
    --remat: each in a fresh process with an empty compilation cache (cold: the memory plan's
    compiles included), then again with it filled (warm: the first step only)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        skipped = "no GPU or TPU here; run it where one is (CPU: bench.py train)"
        print(json.dumps({"bench": "accel", "skipped": skipped}))
        return
    peak = report.peak_flops()[0]  # the chip's dense bf16 peak
    for depth in depths:
        cfg = nc.config_for_depth(depth, 32768, sequence_len=2048, compute_dtype="bfloat16")
        for remat in remats:
            head = {"bench": "accel", "device": device.device_kind, "jax": jax.__version__,
                    "depth": depth, "remat": remat, "tokens_per_step": RECIPE_TOKENS}
            runs = []
            with tempfile.TemporaryDirectory() as cache:
                for timed in (steps, 0):  # cold, then warm
                    cmd = [sys.executable, __file__, "accel-child", "--depths", str(depth),
                           "--steps", str(timed)] + ["--remat"] * remat
                    r = subprocess.run(cmd, env=dict(os.environ, BENCH_CACHE=cache),
                                       capture_output=True, text=True)
                    if r.returncode:  # the traceback's last lines: the error, not JAX's note
                        lines = [line for line in r.stderr.splitlines()
                                 if line.strip() and "JAX_TRACEBACK_FILTERING" not in line]
                        print(json.dumps({**head, "error": "\n".join(lines[-6:])}), flush=True)
                        break
                    runs.append(json.loads(r.stdout.splitlines()[-1]))
            if len(runs) < 2:
                continue
            cold, warm = runs
            tok_s = RECIPE_TOKENS / cold["step_s"]
            flops = nc.estimate_flops(cfg) * tok_s
            print(json.dumps({**head, "params": nc.num_scaling_params(cfg)["total"],
                              "device_batch": cold["device_batch"],
                              "micro_batches": cold["micro_batches"],
                              "tok_per_s": round(tok_s), "step_s": round(cold["step_s"], 3),
                              "tflop_per_s": round(flops / 1e12, 1),
                              "mfu": round(flops / peak, 3) if peak else None,
                              "planned_gib": round(cold["planned_bytes"] / 2**30, 2),
                              "peak_in_use_gib": round(cold["peak_bytes_in_use"] / 2**30, 2),
                              "peak_reserved_gib": round(cold["peak_bytes_reserved"] / 2**30, 2),
                              "first_step_cold_s": round(cold["first_step_s"], 1),
                              "first_step_warm_s": round(warm["first_step_s"], 1),
                              "loss": round(cold["loss"], 4)}), flush=True)




MEMORY_NOTE = ("XLA's CPU buffer assignment, memory-optimized schedule: an estimate of an "
               "accelerator's, whose compiler fuses and schedules differently")


def step_memory(cfg, devices, device_batch_size, shard="optimizer", remat=False,
                attention="splash", lora_rank=0, real=False):
    """The training step of cfg compiled for `devices` emulated CPU devices from abstract shapes
    (no weights allocated): the exact bytes per device of params, gradients and optimizer state
    (from the shardings), and the compiled step's arguments, outputs, temporaries and total.
    attention: a route of kernels.ROUTES; splash (interpreted here) keeps what a fused attention
    keeps for the backward, q, k, v, the output and the softmax statistics. lora_rank: the step
    trains adapters of every block matrix (lora.py); params are then the adapters, and frozen
    the base's bytes per device. real: compiled for the default backend's first device (a
    chip's own compiler and plan; devices must be 1), as train.py's memory plan does."""
    mesh = Mesh(np.array((jax.devices() if real else jax.devices("cpu"))[:devices]), ("data",))
    params, opt_state, base = trained_shapes(cfg, lora_rank)
    frozen = None
    shard = sharding.choose_mode(shard, devices, log=lambda line: None)

    def abstract(tree, specs):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                              sharding=NamedSharding(mesh, s)),
                            tree, specs)
    p_specs, o_specs = sharding.state_specs(params, opt_state, devices, shard)
    if lora_rank:  # laid out as the params are
        base_specs, _ = sharding.state_specs(base, {}, devices, shard)
        frozen = lora.frozen(abstract(base, base_specs), lora_rank, alpha=16.0)
    # one micro-batch; on a real device as many as nanochat's recipe takes (the scan that sums
    # their gradients holds more than one micro-batch's step)
    A = max(1, RECIPE_TOKENS // (device_batch_size * devices * cfg.sequence_len)) if real else 1
    rows = jax.ShapeDtypeStruct((A, device_batch_size * devices, cfg.sequence_len), jnp.int32,
                                sharding=NamedSharding(mesh, P(None, "data")))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # (splash's shard_map)
        lowered = train.jit_train_step.lower(
            abstract(params, p_specs), abstract(opt_state, o_specs), (rows, rows), 0,
            train.base_schedule(1000, weight_decay=0.2), train.learning_rates(), cfg=cfg,
            attn=kernels.attention_fn(attention),
            layout=train.Layout(shard=shard, mesh=mesh if shard != "none" else None, remat=remat),
            frozen=frozen)
        if real:  # the chip's plan, or XLA's count when it refuses (out of memory)
            state = sharding.memory(params, opt_state, devices, shard)
            planned = runtime.needed_bytes(lowered, state["params"] + state["optimizer"])
            return {"shard": shard, "device": jax.devices()[0].device_kind,
                    "total_bytes": planned, "total_gib": round(planned / 2**30, 3),
                    "compile_s": round(time.perf_counter() - t0, 1)}
        # CPU XLA's default schedule is for concurrency and keeps every activation alive
        scheduler = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
        compiled = lowered.compile(scheduler)
    m = compiled.memory_analysis()
    state = sharding.memory(params, opt_state, devices, shard)
    if lora_rank:
        state["frozen"] = sharding.memory(base, {}, devices, shard)["params"]
    state = {f"{k}_bytes": v for k, v in state.items()}
    step = {"arguments_bytes": m.argument_size_in_bytes, "outputs_bytes": m.output_size_in_bytes,
            "aliased_bytes": m.alias_size_in_bytes, "temporaries_bytes": m.temp_size_in_bytes}
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    total += m.temp_size_in_bytes
    return {"shard": shard, **state, **step, "total_bytes": total,
            "total_gb": round(total / 1e9, 3), "compile_s": round(time.perf_counter() - t0, 1)}


def trained_shapes(cfg, lora_rank=0):
    """What a training step of cfg trains, as shapes: (params, optimizer state, base), base
    None; with lora_rank the params are the adapters of every block matrix and base the
    model's, frozen."""
    params, groups, base = nc.param_shapes(cfg), nc.param_groups, None
    if lora_rank:
        base = params
        params = jax.eval_shape(lambda p: lora.init(p, lora_rank, lora.TARGETS,
                                                    jax.random.key(0)), base)
        groups = lora.param_groups
    return params, jax.eval_shape(lambda p: muon.init(p, *groups(p)), params), base


def bench_memory(cfg, devices, device_batch_size, shard, remat, attention, fit=(),
                 lora_rank=0, real=False):
    """One JSON line: step_memory of cfg, per device. With fit (GB, 10^9 bytes): the device batch
    doubled from 1 while it fits the largest, a line each, then a line with the largest power of
    two fitting each (nanochat's total batch of 2^19 tokens needs one), 0 where none does."""
    head = {"bench": "memory", "depth": cfg.n_layer, "params": nc.num_scaling_params(cfg)["total"],
            "devices": devices, "max_seq_len": cfg.sequence_len, "remat": remat,
            "attention": attention, "lora_rank": lora_rank}

    def measure(batch):
        r = step_memory(cfg, devices, batch, shard=shard, remat=remat, attention=attention,
                        lora_rank=lora_rank, real=real)
        note = {} if real else {"estimate": MEMORY_NOTE}
        print(json.dumps({**head, "device_batch_size": batch, **r, **note}), flush=True)
        return r
    if not fit:
        measure(device_batch_size)
        return
    batch, totals = 1, {}
    while batch <= 1024 and (not totals or totals[max(totals)] <= max(fit) * 1e9):
        r = measure(batch)
        totals[batch] = r["total_bytes"]
        batch *= 2
    largest = {f"{gb:g}": max((b for b, t in totals.items() if t <= gb * 1e9), default=0)
               for gb in fit}
    print(json.dumps({**head, "shard": r["shard"], "fits": largest,
                      "total_gb": {str(b): round(t / 1e9, 3) for b, t in totals.items()},
                      "estimate": MEMORY_NOTE}), flush=True)


def bench_accel_child(depth, remat, steps):
    """accel_child in this process (bench_accel runs it in a fresh one), its JSON last."""
    os.environ.setdefault("BENCH_START", repr(START))
    runtime.use_compile_cache(os.environ["BENCH_CACHE"])
    print(json.dumps(accel_child(depth, remat, steps)))


def bench_train_child(config, steps):
    """One model's training step timed in this process (bench_train runs it in a fresh one)."""
    os.environ.setdefault("BENCH_START", repr(START))
    runtime.tune_malloc(restart=True)  # as train.py's: on huge pages the child starts over once
    runtime.use_compile_cache(os.environ["BENCH_CACHE"])
    print(json.dumps(train_step_timing(CONFIGS[config], BATCH[config][0], steps)))


MODES = ("tokenizer", "decode", "train", "train-child", "accel", "accel-child", "memory",
         "serve")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("mode", choices=MODES, help="what to measure")
    p.add_argument("--mb", type=float, default=5.0, help="tokenizer: MB of text to train on")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer: vocab size, specials "
                   "included")
    p.add_argument("--repeats", type=int, default=3, help="runs; the median time is reported")
    p.add_argument("--configs", nargs="*", choices=sorted(CONFIGS), default=None,
                   help="models (default: train all three, decode nano and d6)")
    p.add_argument("--steps", type=int, default=10, help="train, accel: timed steps after 3 "
                   "warm-up steps (accel: 1)")
    p.add_argument("--depths", type=int, nargs="*", default=[12, 20],
                   help="accel: nanochat depths (T 2048, bf16)")
    s = p.add_argument_group("serve (docs/serving.md)").add_argument
    s("--infer-bench", metavar="MODEL", help="nanochat's infer_bench instead: nano, d6, or a depth "
      "like d20 (T 2048, bf16); its last line is one JSON document of infer_bench's schema")
    s("--slots", type=int, default=16, help="the engine's slots")
    s("--kmax", type=int, default=16, help="most tokens one device call decodes")
    s("--streams", type=int, nargs="*", default=[1, 4, 16], help="concurrent streams")
    s("--batch-sizes", type=int, nargs="*", default=[1, 8, 32, 128], help="infer_bench's")
    s("--chat-traffic", type=int, metavar="N", help="N requests at once, prompts of 100-400 "
      "tokens, 256-token replies, through --model")
    s("--model", default="d20", help="--chat-traffic's: nano, d6, or a depth like d20")
    s("--decode-chunk", metavar="MODEL", help="one decode chunk program alone, --rows live "
      "slots at chat traffic's positions, the long layers paged: its time a step")
    s("--rows", type=int, default=128, help="--decode-chunk's live slots")
    s("--positions", type=int, nargs=2, default=[100, 656], metavar=("LO", "HI"),
      help="--decode-chunk's rows' positions, drawn from LO to HI (chat traffic's at d20; "
      "infer_bench's full rows: 1690 1872)")
    s("--profile", metavar="DIR", help="--decode-chunk: jax's trace into DIR, and the ops that "
      "took the most time a step")
    s("--kv-cache", choices=["int8"], help="--infer-bench's, --chat-traffic's and "
      "--decode-chunk's engine: an int8 KV cache, a scale a token and head (none: the compute "
      "dtype's, exact)")
    s("--http", metavar="CHECKPOINT", help="through chat.py --serve on this checkpoint: 16 "
      "clients one after another, then at once")
    s("--agreement", metavar="CHECKPOINT", help="how many greedy replies through the engine, "
      "all at once, equal each alone: the held-out questions on this checkpoint")
    m = p.add_argument_group("memory (docs/scaling-out.md)").add_argument
    m("--depth", type=int, default=20, help="nanochat's depth (vocab 32768, bf16 compute)")
    m("--devices", type=int, default=8, help="emulated devices of the data mesh")
    m("--device-batch-size", type=int, default=1, help="rows per device")
    m("--max-seq-len", type=int, default=2048, help="T")
    m("--shard", choices=sharding.MODES, default="optimizer", help="train.py's --shard")
    m("--remat", action="store_true", help="train.py's --remat (accel: only with it)")
    m("--attention", choices=kernels.ROUTES, default="splash",
      help="route whose memory is estimated (splash: a fused kernel's, interpreted)")
    m("--fit", type=float, nargs="*", default=[],
      help="GB per device: the largest power-of-two device batch fitting each")
    m("--real", action="store_true", help="plan this machine's accelerator (its compiler), "
      "one device, at the micro-batches of nanochat's 524,288 tokens a step")
    m("--lora-rank", type=int, default=0,
      help="the step trains LoRA adapters of this rank on a frozen base (0: every weight)")
    return p.parse_args(argv)



def main(argv=None):
    args = parse_args(argv)
    if args.mode == "memory":
        if args.devices < 1 or args.device_batch_size < 1:
            raise SystemExit("bench.py memory: --devices and --device-batch-size must be >= 1")
        if args.real and args.devices != 1:
            raise SystemExit("bench.py memory --real plans one device: pass --devices 1")
        if not args.real:  # before the CPU backend starts
            jax.config.update("jax_num_cpu_devices", args.devices)
        cfg = nc.config_for_depth(args.depth, 32768, sequence_len=args.max_seq_len,
                                  compute_dtype="bfloat16")  # nanochat's recipe's model
        bench_memory(cfg, args.devices, args.device_batch_size,
                     real=args.real,
                     shard=args.shard,
                     remat=args.remat,
                     attention=args.attention,
                     fit=args.fit,
                     lora_rank=args.lora_rank)
    elif args.mode == "tokenizer":
        bench_tokenizer(args.mb, args.vocab_size, args.repeats)
    elif args.mode == "decode":
        bench_decode(args.configs or ("nano", "d6"), args.repeats)
    elif args.mode == "train":
        bench_train(args.configs or tuple(CONFIGS), args.steps)
    elif args.mode == "train-child":
        bench_train_child(args.configs[0], args.steps)
    elif args.mode == "serve":
        bench_serving.serve(args)
    elif args.mode == "accel-child":
        bench_accel_child(args.depths[0], args.remat, args.steps)
    else:
        remats = (args.remat,) if args.remat else (False, True)
        bench_accel(args.depths, args.steps, remats)


if __name__ == "__main__":
    main()
