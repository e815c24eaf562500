"""Benchmarks that print one JSON line each, to compare machines and commits side by side.

    python bench.py tokenizer    # BPE training on 5 MB of text to vocab 4096, then encoding
    python bench.py decode       # KV-cache generation: 16-token prompt, 200 new tokens, batch 1, 8
    python bench.py train        # the whole training step (fwd, bwd, MuonAdamW) of three models
    python bench.py accel        # on a GPU or TPU: nanochat's recipe at d12 and d20 (524,288
                                 # tokens a step, T 2048, bf16), without and with --remat
    python bench.py serve        # 1, 4, 16 concurrent streams through the slot engine (engine.py)
    python bench.py serve --infer-bench d6   # nanochat's infer_bench protocol, its JSON last
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
import collections
import dataclasses
import functools
import gzip
import http.client
import json
import pathlib
import resource
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import checkpoint
import data
import engine
import kernels
import kvcache
import lora
import muon
import nanochat as nc
import report
import runtime
import sharding
import tasks
import train

# The models PyTorch nanochat was measured on beside us (docs/performance.md), and their batches.
BATCH = {"nano-char": (32, 256), "nano": (32, 256), "d6": (8, 512)}
CONFIGS = {
    "nano-char": nc.Config(sequence_len=256, vocab_size=65, n_layer=4, n_head=4, n_kv_head=4,
                           n_embd=128, window_pattern="L"),
    "nano": nc.Config(sequence_len=256, vocab_size=4096, n_layer=4, n_head=4, n_kv_head=4,
                      n_embd=128, window_pattern="L"),
    "d6": nc.Config(sequence_len=512, vocab_size=8192, n_layer=6, n_head=6, n_kv_head=6,
                    n_embd=384, window_pattern="L"),
}


def peak_rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


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
                              "peak_rss_gb": round(peak_rss_gb(), 2)}), flush=True)


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
            "peak_rss_gb": peak_rss_gb()}


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


# -------------------------------------------------------------------------- serving (engine.py)

# HBM bandwidth per chip, bytes/s (nanochat's common.get_peak_bandwidth), matched as PEAK_BF16 is
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "H800": 3.35e12, "B200": 8.0e12,
                  "A100": 2.0e12, "L4": 3.0e11, "TPU v4": 1.2e12, "TPU v5 lite": 8.19e11,
                  "TPU v5": 2.76e12, "TPU v6 lite": 1.64e12}


def peak_bandwidth():
    """Bytes/s that MBU divides by: a known chip's, or on a CPU a measured streaming read."""
    kind = jax.devices()[0].device_kind
    if name := next((n for n in PEAK_BANDWIDTH if n.lower() in kind.lower()), None):
        return PEAK_BANDWIDTH[name]
    if jax.default_backend() != "cpu":
        return None
    x = jnp.ones(2**26, jnp.float32)  # 256 MiB, far past the caches
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(10):
        total(x).block_until_ready()
    return 10 * x.nbytes / (time.perf_counter() - t)


def decode_costs(cfg, context, kv_dtype=None):
    """nanochat's inference cost accounting (gpt.py): (weight bytes a decode step reads, in the
    compute dtype; KV bytes stored per token; KV bytes read per step and row at `context`;
    forward FLOPs per decoded token there: 2 per matmul weight plus attention). kv_dtype
    "int8": a byte a value and a scale in the compute dtype a token and head."""
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    head = cfg.head_dim + itemsize if kv_dtype == "int8" else cfg.head_dim * itemsize
    per_position = 2 * cfg.n_kv_head * head  # k and v, one layer
    seen = [min(context, w) for w in nc.window_sizes(cfg)]  # a window reads only its own
    flops = 2 * matmul_weights(cfg) + sum(4 * cfg.n_head * cfg.head_dim * s for s in seen)
    weights = nc.count(nc.param_shapes(cfg)) * itemsize
    return weights, per_position * cfg.n_layer, per_position * sum(seen), flops


def matmul_weights(cfg):
    """nanochat's num_matmul_params: the weights of its Linear layers (2 FLOPs each a token)."""
    shapes = nc.param_shapes(cfg)
    return nc.count(shapes["h"]) + nc.count(shapes["smear_gate"]) + nc.count(shapes["lm_head"])


def timed(eng, request):
    """(time, device call) of each token event of a request as the engine hands it out: the tokens
    of one chunk share its device call."""
    stamps = []
    add = request.add
    stats = eng.stats  # not eng: a request the engine holds would hold the engine

    def add_timed(event):
        if event.token is not None:
            stamps.append((time.perf_counter(), stats["calls"]))
        add(event)
    request.add = add_timed
    return stamps


def hand_outs(stamps):
    """[(time, tokens)] of each device call that handed a stream tokens, in order."""
    calls = {}
    for t, call in stamps:
        _, count = calls.get(call, (t, 0))
        calls[call] = (t, count + 1)
    return sorted(calls.values())


def percentile(values, q):
    return float(np.percentile(values, q)) if values else None


def serve_streams(eng, prompts, new_tokens, temperature=1.0):
    """prompts sent to the engine at once, each for new_tokens tokens with no stop id, the engine
    driven in this thread as the server's engine thread drives it: aggregate tokens/s, time to
    first token and time per output token (each chunk's gap over its tokens), over the streams."""
    before = dict(eng.stats)
    start = time.perf_counter()
    sampling = [engine.Sampling(max_tokens=new_tokens, temperature=temperature, seed=i)
                for i in range(len(prompts))]
    requests = [eng.submit(p, s) for p, s in zip(prompts, sampling)]
    stamps = [timed(eng, r) for r in requests]
    eng.drain()
    wall = time.perf_counter() - start
    tokens = sum(len(r.tokens[0]) for r in requests)
    ttft = [s[0][0] - start for s in stamps]
    tpot = []  # each hand-out's gap since the one before, over its tokens
    for s in stamps:
        out = hand_outs(s)
        tpot += [(t - before) / n for (before, _), (t, n) in zip(out, out[1:])]
    calls = eng.stats["calls"] - before.get("calls", 0)
    hops = eng.stats["hops"] - before.get("hops", 0)
    return {"streams": len(prompts), "tokens": tokens,
            "tok_per_s": round(tokens / wall, 1),
            "ttft_ms_p50": round(1e3 * percentile(ttft, 50), 1),
            "ttft_ms_p95": round(1e3 * percentile(ttft, 95), 1),
            "tpot_ms_p50": round(1e3 * percentile(tpot, 50), 2),
            "tpot_ms_p95": round(1e3 * percentile(tpot, 95), 2),
            "device_calls_per_token": round(calls / tokens, 4),
            "host_hops_per_token": round(hops / tokens, 4)}


def count_compiles():
    """A list that grows by one for each program lowered from now on."""
    compiles = []

    def listen(event, *_, **__):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            compiles.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    return compiles


def bench_serve(configs=("nano", "d6"), slots=16, kmax=16, streams=(1, 4, 16), new=200, rounds=3):
    """Concurrent streams through the slot engine (prompts of 16-64 random tokens, `new` tokens at
    temperature 1, no stop ids), beside the reference `generate` at batch 1 with the same
    protocol: a JSON line per setting, the median of `rounds` rounds (each round runs every
    setting, so that a drifting machine hits them all alike), compiles after warm-up."""
    attn = kernels.attention_fn()
    for name in configs:
        cfg = CONFIGS[name]
        params = nc.init_params(cfg, jax.random.key(0))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, cfg.vocab_size, rng.integers(16, 65)).tolist()
                   for _ in range(max(streams))]
        head = {"bench": "serve", "config": name, "params": nc.num_scaling_params(cfg)["total"],
                "device": jax.devices()[0].device_kind, "new_tokens": new}
        eng = engine.Engine(params, cfg, slots=slots, kmax=kmax, attn=attn)
        t = time.perf_counter()
        eng.warm_up()
        warm_up_s = time.perf_counter() - t
        generate_run(params, cfg, prompts[0], new, attn)  # compiles the reference's programs
        compiles = count_compiles()
        reference = []
        results = {n: [] for n in streams}
        for _ in range(rounds):
            reference.append(generate_run(params, cfg, prompts[0], new, attn))
            for n in streams:
                results[n].append(serve_streams(eng, prompts[:n], new))
        print(json.dumps({**head, "what": "generate", "streams": 1,
                          "tok_per_s": round(statistics.median(reference), 1)}), flush=True)
        for n in streams:
            median = sorted(results[n], key=lambda r: r["tok_per_s"])[rounds // 2]
            print(json.dumps({**head, "what": "engine", "slots": slots, "kmax": kmax, **median,
                              "warm_up_s": round(warm_up_s, 1),
                              "compiles_after_warm_up": len(compiles),
                              "peak_rss_gb": round(peak_rss_gb(), 2)}), flush=True)


def generate_run(params, cfg, prompt, new, attn):
    """Tokens/s of the reference `generate` (one token a device call) at batch 1, temperature 1."""
    sampling = engine.Sampling(max_tokens=new, seed=1)
    t = time.perf_counter()
    steps = sum(1 for _ in engine.generate(params, cfg, prompt, sampling, attn=attn))
    return steps / (time.perf_counter() - t)


def stream_reply(port, content, max_tokens):
    """One streamed chat completion from a chat.py server, greedy: (its text, seconds to the
    first content, seconds in all, tokens)."""
    body = json.dumps({"messages": [{"role": "user", "content": content}], "stream": True,
                       "max_tokens": max_tokens, "temperature": 0,
                       "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = ""
    first = None
    tokens = 0
    for line in response:  # server-sent events: "data: {json}" lines, then "data: [DONE]"
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):  # the last chunk
            tokens = chunk["usage"]["completion_tokens"]
            continue
        delta = chunk["choices"][0]["delta"].get("content")
        if delta and first is None:
            first = time.perf_counter() - start
        text += delta or ""
    conn.close()
    return text, first, time.perf_counter() - start, tokens


def bench_serve_http(checkpoint, clients=16, max_tokens=128, slots=16, rounds=3):
    """`python chat.py --serve` on a checkpoint, in a process of its own: `clients` streamed greedy
    requests sent one after another, then all at once, `rounds` times (a shared machine drifts:
    each round's pair is side by side). A JSON line per round and mode: tokens/s, time to first
    token p50/p95; the concurrent one says whether every reply equals the same request's reply
    alone, and its speed-up over the sequential run of its round."""
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, str(pathlib.Path(__file__).with_name("chat.py")), "--serve",
           "--checkpoint", checkpoint, "--port", str(port), "--slots", str(slots),
           "--compile-cache", ""]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        startup = wait_until_compiled(server, port)
        questions = [f"Tell me about topic number {i}, please." for i in range(clients)]
        for round_ in range(rounds):
            sequential = None
            for mode in ("sequential", "concurrent"):
                t = time.perf_counter()
                replies = ask_all(port, questions, max_tokens, at_once=mode == "concurrent")
                wall = time.perf_counter() - t
                tokens = sum(r[3] for r in replies)
                line = {"bench": "serve-http", "round": round_, "mode": mode,
                        "clients": clients, "max_tokens": max_tokens, "slots": slots,
                        "wall_s": round(wall, 2), "tokens": tokens,
                        "tok_per_s": round(tokens / wall, 1),
                        "ttft_ms_p50": round(1e3 * percentile([r[1] for r in replies], 50), 1),
                        "ttft_ms_p95": round(1e3 * percentile([r[1] for r in replies], 95), 1),
                        "startup_s": round(startup, 1)}
                if sequential is None:
                    sequential = replies
                else:
                    line["same_replies"] = [r[0] for r in replies] == [r[0] for r in sequential]
                    line["speedup"] = round(sum(r[2] for r in sequential) / wall, 2)
                print(json.dumps(line), flush=True)
    finally:
        server.terminate()
        server.wait()


def wait_until_compiled(server, port):
    """Seconds until a starting chat.py server says it has compiled every program."""
    start = time.perf_counter()
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if json.loads(conn.getresponse().read())["compiled"]:
                return time.perf_counter() - start
        except (OSError, ValueError):
            pass
        if server.poll() is not None:
            raise RuntimeError(f"chat.py --serve exited with {server.returncode}")
        time.sleep(0.5)


def ask_all(port, questions, max_tokens, at_once):
    """stream_reply for each question: one after another, or each from its own thread at once."""
    if not at_once:
        return [stream_reply(port, q, max_tokens) for q in questions]
    replies = [None] * len(questions)

    def ask(i):
        replies[i] = stream_reply(port, questions[i], max_tokens)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return replies


def infer_bench_prompt(cfg, length):
    """nanochat's infer_bench prompt is a paragraph repeated: a random model has no use for text,
    so a fixed pseudo-random one of the same length."""
    return np.random.default_rng(1).integers(0, cfg.vocab_size, length).tolist()


def serving_config(name):
    """A serving benchmark's model: one of CONFIGS, or nanochat's depth `dN` (T 2048, vocab
    32768, bf16)."""
    if name in CONFIGS:
        return CONFIGS[name]
    return nc.config_for_depth(int(name.lstrip("d")), 32768, sequence_len=2048,
                               compute_dtype="bfloat16")


def serving_params(cfg):
    """Random parameters in the compute dtype, as a served bf16 checkpoint holds them: fp32
    ones would keep twice their bytes on the device beside the engine's copy."""
    params = nc.init_params(cfg, jax.random.key(0))
    return jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params)


def bench_chat_traffic(name, requests, slots_most=128, kmax=16, reply=256, kv_cache=None):
    """Chat-like traffic: `requests` submitted at once, prompts of 100-400 random tokens (at
    most the context less the reply), `reply` tokens each at temperature 1 with no stop id,
    through an engine of min(requests, slots_most) slots after its warm-up, its pages as
    many as the slots' longest conversations need at once. One JSON line: tokens/s, TTFT and
    TPOT p50/p95, the pages and the most in use, the cache's bytes, peak device memory and
    compiles after warm-up; or, when the slots do not fit the device, the line that says so.
    kv_cache: the engine's."""
    cfg = serving_config(name)
    params = engine.prepare(serving_params(cfg), cfg)  # (the stacked ones freed)
    reply = min(reply, cfg.sequence_len // 2)
    longest = min(400, cfg.sequence_len - reply - 1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, rng.integers(min(100, longest), longest + 1))
               for _ in range(requests)]
    slots = min(requests, slots_most)
    # pages for the slots' longest conversations at once, each its prompt and reply
    page = kvcache.page_size(cfg.sequence_len)
    needs = sorted(-(-(len(p) + reply) // page) for p in prompts)
    pages = max(sum(needs[-slots:]), cfg.sequence_len // page)
    head = {"bench": "chat-traffic", "config": name, "device": jax.devices()[0].device_kind,
            "requests": requests, "reply_tokens": reply, "slots": slots, "pages": pages,
            "kv_cache": kv_cache or "exact"}
    try:
        eng = engine.Engine(params, cfg, slots=slots, kmax=kmax, attn=kernels.attention_fn(),
                            kv_cache=kv_cache, pages=pages)
    except ValueError as e:  # the slots' cache does not fit
        print(json.dumps({**head, "skipped": str(e)}), flush=True)
        return
    eng.warm_up()
    compiles = count_compiles()
    result = serve_streams(eng, [p.tolist() for p in prompts], reply)
    cache_bytes = engine.state_bytes(cfg, slots, kv_cache, pages)
    print(json.dumps({**head, **result, "pages_peak": eng.stats["pages_peak"],
                      "cache_bytes": cache_bytes,
                      "peak_device_bytes": device_peak_bytes(jax.devices()[0]),
                      "compiles_after_warm_up": len(compiles)}), flush=True)


def bench_decode_chunk(name, rows, positions=(100, 656), kmax=16, calls=5, kv_cache=None,
                       profile=None):
    """One decode chunk program alone (engine.decode_chunk, compiled once, no warm-up): `rows`
    live slots at positions drawn from `positions` (chat traffic's spread at d20: prompts of
    100-400 tokens, 256-token replies), the layers over the whole context in pages, each row
    its own, temperature 1; `calls` chunks of kmax steps after the first. One JSON line: the
    view, the median time a step and tokens/s, the first call's seconds beyond a step's (its
    compile, unless the engine's memory check compiled it). profile: a directory for jax's
    trace of `calls` chunks more, and a second line: the ops that took the most time a step
    (top_ops)."""
    cfg = serving_config(name)
    S = cfg.sequence_len
    # 1. each row's position, room for every call's tokens, and the pages that reach; the
    # slots live there (live_slots)
    chunks = 1 + calls * (2 if profile else 1)
    last = S - kmax * chunks
    if last < 1:
        raise SystemExit(f"bench.py serve --decode-chunk: a context of {S} has no room for "
                         f"{chunks} chunks of {kmax} tokens; pass a smaller --kmax")
    pos = np.random.default_rng(0).integers(min(positions[0], last), min(positions[1], last) + 1,
                                            rows)
    reach = pos + kmax * chunks
    view = min(v for v in kvcache.chunk_views(S) if v >= reach.max())
    head = {"bench": "decode-chunk", "config": name, "device": jax.devices()[0].device_kind,
            "rows": rows, "positions": [int(pos.min()), int(pos.max())], "view": view,
            "kv_cache": kv_cache or "exact", "kmax": kmax}
    page = kvcache.page_size(S)
    owned = -(-reach // page)
    pool = max(int(owned.sum()), S // page)  # an engine holds a context's pages at least
    try:
        eng = engine.Engine(engine.prepare(serving_params(cfg), cfg), cfg, slots=rows, kmax=kmax,
                            attn=kernels.attention_fn(), kv_cache=kv_cache, pages=pool)
    except ValueError as e:  # the slots' cache does not fit
        print(json.dumps({**head, "skipped": str(e)}), flush=True)
        return
    state, control = live_slots(eng, pos, owned)

    def chunk(state):  # one call, timed to its records on the host
        start = time.perf_counter()
        state, records = engine.decode_chunk(eng.layered, state, control, cfg=cfg, attn=eng.attn,
                                             rows=rows, view=view, kmax=kmax, paged=True)
        np.asarray(records)
        return state, time.perf_counter() - start
    # 2. the calls, then as many again under jax's profiler
    times = []
    for _ in range(calls + 1):
        state, seconds = chunk(state)
        times.append(seconds)
    step = float(np.median(times[1:])) / kmax
    print(json.dumps({**head, "step_ms": round(1e3 * step, 3), "tok_per_s": round(rows / step, 1),
                      "tokens": int(np.asarray(state["cache"]["pos"]).sum() - pos.sum()),
                      "compile_s": round(times[0] - step * kmax, 1)}), flush=True)
    if profile:
        with jax.profiler.trace(profile, create_perfetto_trace=True):
            for _ in range(calls):
                state, _ = chunk(state)
        print(json.dumps({**head, "profile": profile, "ops": top_ops(profile, calls * kmax)}),
              flush=True)


def live_slots(eng, pos, owned):
    """An engine's state and a decode call's control with every slot live at its position pos
    (B,), drawing at temperature 1, slot b holding owned[b] pages of its own (1, 2, ...: page 0
    is the null page)."""
    rows, S = len(pos), eng.cfg.sequence_len
    table = np.zeros((rows, S // eng.page), np.int32)
    for r, held in enumerate(np.split(np.arange(1, owned.sum() + 1), np.cumsum(owned)[:-1])):
        table[r, :len(held)] = held
    state = {**eng.state, "live": jnp.ones(rows, bool), "left": jnp.full(rows, S, jnp.int32),
             "temperature": jnp.ones(rows, jnp.float32),
             "cache": {**eng.state["cache"], "pos": jnp.asarray(pos, jnp.int32)}}
    return state, {**eng.idle_control(rows), "steps": np.int32(eng.kmax), "pages": table}


def top_ops(directory, steps, most=20):
    """What took the most time in the newest perfetto trace under `directory` (jax.profiler's),
    per step of `steps`: for each process ("/host:CPU", "/device:TPU:0", ...) its `most` events
    as [name, ms a step, runs a step], most first; jax's Python frames aside. Events nest: a
    runtime's own (ThunkExecutor::Execute) hold the ops they ran."""
    path = max(pathlib.Path(directory).glob("**/*.trace.json.gz"), key=os.path.getmtime)
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    micros = collections.Counter()
    runs = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith("$"):
            key = (processes.get(e["pid"], "?"), e["name"])
            micros[key] += e.get("dur", 0)
            runs[key] += 1
    ops = collections.defaultdict(list)
    for (process, op), us in micros.most_common():
        if len(ops[process]) < most:
            per_step = runs[process, op] / steps
            ops[process].append([op, round(us / 1e3 / steps, 4), round(per_step, 2)])
    return dict(ops)


def bench_agreement(path, max_tokens=64, slots=16):
    """How often a greedy reply through the slot engine, every question at once, equals the
    question's reply alone (engine.generate), at this machine's default matmul precision:
    testdata/heldout_questions.jsonl on the checkpoint at `path`, no calculator. A CPU's fp32
    gives every one; a chip's default precision runs fp32 matmuls as bf16 passes, where a
    row rounds differently in a batch than alone and a near tie can go the other way. One
    JSON line: the replies, how many are equal, and where each other one first differs."""
    params, cfg, tok = checkpoint.load_model(path)
    questions = tasks.load_questions(train.QUESTIONS)
    prompts = [data.render_for_completion(tok, [{"role": "user", "content": q["question"]},
                                                {"role": "assistant", "content": ""}])
               for q in questions]
    sampling = engine.Sampling(max_tokens=max_tokens, temperature=0.0,
                               stop_ids=data.reply_stops(tok))
    attn = kernels.attention_fn()
    alone = [[column[0] for column, _ in engine.generate(params, cfg, p, sampling, attn=attn)]
             for p in prompts]
    eng = engine.Engine(params, cfg, slots=slots, attn=attn)
    requests = [eng.submit(p, sampling) for p in prompts]
    eng.drain()
    together = [r.tokens[0] for r in requests]
    # where each reply that differs leaves its reply alone (a token index)
    differ = [next((i for i, (a, b) in enumerate(zip(one, all_)) if a != b),
                   min(len(one), len(all_)))
              for one, all_ in zip(alone, together) if one != all_]
    print(json.dumps({"bench": "agreement", "checkpoint": path,
                      "device": jax.devices()[0].device_kind,
                      "precision": str(jax.config.jax_default_matmul_precision),
                      "replies": len(prompts), "equal": len(prompts) - len(differ),
                      "first_differences": differ, "slots": slots,
                      "tokens": sum(map(len, alone))}), flush=True)


def bench_infer(name, batch_sizes=(1, 8, 32, 128), decode_tokens=256, slots_most=128, kmax=16,
                kv_cache=None):
    """nanochat's scripts/infer_bench.py protocol on the slot engine: a prompt of the context less
    decode_tokens, decode_tokens greedy tokens for a batch of B choices of it; TTFT, the median
    time per decode step, tokens/s, MBU and MFU by nanochat's formulas, peak memory. Prints its
    lines, then its last line: one JSON document of nanochat's schema. kv_cache: the engine's
    (its bytes counted as stored)."""
    cfg = serving_config(name)
    params = engine.prepare(serving_params(cfg), cfg)  # each batch's engine shares them
    attn = kernels.attention_fn()
    device = jax.devices()[0]
    decode_tokens = min(decode_tokens, cfg.sequence_len // 2)  # room for a prompt
    prompt_len = cfg.sequence_len - decode_tokens
    prompt = infer_bench_prompt(cfg, prompt_len)
    payload = infer_payload(cfg, device, prompt_len, decode_tokens, kv_cache)
    w_bytes, kv_read = payload["weight_bytes"], payload["kv_read_bytes_per_step"]
    flops, peak = payload["decode_flops_per_token"], payload["peak_flops_per_sec"]
    peak_bw = payload["peak_bandwidth_bytes_per_sec"]
    # what a step must read: nanochat's MBU counts every stored weight; wte and the value
    # embeddings are looked up, a row a token, so the matmuls' weights are the floor
    floor_bytes = matmul_weights(cfg) * jnp.dtype(cfg.compute_dtype).itemsize
    # prefill: batch 1, a single token (TTFT is the prefill)
    eng = engine.Engine(params, cfg, slots=1, kmax=kmax, attn=attn, kv_cache=kv_cache)
    infer_request(eng, prompt, 1, 2)
    prefill_s = infer_request(eng, prompt, 1, 2)[0]
    mfu = 100 * prefill_flops(cfg, prompt_len) / prefill_s / peak if peak else None
    payload["prefill"] = {"tok_per_sec": round(prompt_len / prefill_s, 1),
                          "mfu_percent": None if mfu is None else round(mfu, 2),
                          "time_sec": round(prefill_s, 6)}
    for batch in batch_sizes:
        eng = None  # the last batch's cache freed before this one's is checked
        try:
            eng = engine.Engine(params, cfg, slots=min(batch, slots_most), kmax=kmax, attn=attn,
                                kv_cache=kv_cache)
        except ValueError as e:  # its cache does not fit: that line, and the next batch
            print(json.dumps({"bench": "infer", "config": name, "batch_size": batch,
                              "skipped": str(e)}), flush=True)
            continue
        infer_request(eng, prompt, batch, 8)  # warm-up: compiles
        ttft, steps = infer_request(eng, prompt, batch, decode_tokens)
        tpot = sorted(steps)[len(steps) // 2]
        row = {"batch_size": batch, "ttft_sec": round(ttft, 6), "tpot_sec": round(tpot, 6),
               "tok_per_sec": round(batch * len(steps) / sum(steps), 1),
               "mbu_percent": round(100 * (w_bytes + batch * kv_read) / tpot / peak_bw, 2),
               "mfu_percent": round(100 * batch * flops / tpot / peak, 4) if peak else None,
               "peak_vram_bytes": device_peak_bytes(device),
               "decode_steps": len(steps)}
        physical = 100 * (floor_bytes + batch * kv_read) / tpot / peak_bw
        print(json.dumps({"bench": "infer", "config": name, **row,
                          "physical_mbu_percent": round(physical, 2),
                          "kv_cache": kv_cache or "exact"}), flush=True)
        payload["sweep"].append(row)
    print(json.dumps(payload))


def infer_payload(cfg, device, prompt_len, decode_tokens, kv_cache):
    """bench_infer's JSON document before its runs, in nanochat's schema: the model, the
    device's peaks, what a decode step costs at the middle of the decode (decode_costs)."""
    context_mid = prompt_len + decode_tokens // 2
    w_bytes, kv_store, kv_read, flops = decode_costs(cfg, context_mid, kv_cache)
    peak_bw = peak_bandwidth()
    stats = device.memory_stats() or {}
    total_memory = stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    params = nc.num_scaling_params(cfg)["total"]
    return {"source": "random init", "step": 0, "model_config": dataclasses.asdict(cfg),
            "gpu": device.device_kind, "peak_bandwidth_bytes_per_sec": peak_bw,
            "total_vram_bytes": total_memory, "num_params": params,
            "param_dtypes": {cfg.compute_dtype: params},
            "weight_bytes": w_bytes, "kv_bytes_per_token": kv_store,
            "kv_read_bytes_per_step": kv_read, "context_mid": context_mid,
            "peak_flops_per_sec": report.peak_flops()[0], "decode_flops_per_token": flops,
            "ceiling_bs1_tok_per_sec": round(peak_bw / (w_bytes + kv_read), 1),
            "max_full_context_rows": int((total_memory - w_bytes)
                                         / (kv_store * cfg.sequence_len)),
            "prompt_tokens": prompt_len, "decode_tokens": decode_tokens, "temperature": 0.0,
            "sweep": []}


def infer_request(eng, prompt, batch, tokens):
    """One request of `batch` greedy choices of `tokens` tokens through the engine: (TTFT,
    each decode step's time; a chunk of k steps gives k steps of its time over k)."""
    sampling = engine.Sampling(max_tokens=tokens, temperature=0.0)
    start = time.perf_counter()
    request = eng.submit(prompt, sampling, n=batch)
    stamps = timed(eng, request)
    eng.drain()
    steps = []
    out = hand_outs(stamps)
    for (before, _), (t, count) in zip(out, out[1:]):
        steps += [(t - before) * batch / count] * (count // batch)
    return stamps[0][0] - start, steps


def prefill_flops(cfg, n):
    """nanochat's estimate_prefill_flops: 2 per matmul weight per token, attention causal within
    each layer's window."""
    attention = 0
    for window in nc.window_sizes(cfg):
        w = min(window, n)
        attention += 4 * cfg.n_head * cfg.head_dim * (w * (w + 1) // 2 + (n - w) * w)
    return 2 * matmul_weights(cfg) * n + attention


def device_peak_bytes(device):
    """The accelerator's peak bytes in use, or on a CPU the process's peak resident memory."""
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    elif args.mode == "serve" and args.agreement:
        bench_agreement(args.agreement, slots=args.slots)
    elif args.mode == "serve" and args.http:
        bench_serve_http(args.http, slots=args.slots)
    elif args.mode == "serve" and args.chat_traffic:
        bench_chat_traffic(args.model, args.chat_traffic, kmax=args.kmax,
                           kv_cache=args.kv_cache)
    elif args.mode == "serve" and args.decode_chunk:
        bench_decode_chunk(args.decode_chunk, args.rows, kmax=args.kmax, kv_cache=args.kv_cache,
                           profile=args.profile)
    elif args.mode == "serve" and args.infer_bench:
        bench_infer(args.infer_bench, args.batch_sizes, kmax=args.kmax, kv_cache=args.kv_cache)
    elif args.mode == "serve":
        bench_serve(args.configs or ("nano", "d6"), args.slots, args.kmax, args.streams,
                    rounds=args.repeats)
    elif args.mode == "accel-child":
        bench_accel_child(args.depths[0], args.remat, args.steps)
    else:
        remats = (args.remat,) if args.remat else (False, True)
        bench_accel(args.depths, args.steps, remats)


if __name__ == "__main__":
    main()
