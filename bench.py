"""
Benchmarks that print one JSON line each, so numbers can be compared across machines and commits.

    python bench.py tokenizer    # BPE training on 5 MB of distinct text to vocab 4096, then encode speed
    python bench.py decode       # KV-cache generation: 16-token prompt, 200 new tokens at batch 1 and 8
    python bench.py train        # the whole training step (fwd, bwd, MuonAdamW) of the performance issue's configs
    python bench.py accel        # on a GPU or TPU: d12 and d20 training steps (T 2048, bf16) and generation

Speed is measured here, never in a timed unit test.
"""
import os
import time

# time to first step counts from here: imports, init, trace, compile and the step. BENCH_START carries it over
# train.setup_process's restart (with huge pages, a script starts over once, as `python train.py` does)
START = float(os.environ.get("BENCH_START", time.time()))

import argparse
import json
import pathlib
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import data
import evaluate
import muon
import nanochat as nc
import train

# The performance issue's configs (PyTorch nanochat baselines were measured on the same shapes) and batch sizes.
BATCH = {"nano-char": (32, 256), "nano": (32, 256), "d6": (8, 512)}
CONFIGS = {
    "nano-char": nc.Config(sequence_len=256, vocab_size=65, n_layer=4, n_head=4, n_kv_head=4, n_embd=128,
                           window_pattern="L"),
    "nano": nc.Config(sequence_len=256, vocab_size=4096, n_layer=4, n_head=4, n_kv_head=4, n_embd=128,
                      window_pattern="L"),
    "d6": nc.Config(sequence_len=512, vocab_size=8192, n_layer=6, n_head=6, n_kv_head=6, n_embd=384,
                    window_pattern="L"),
}

def bench_tokenizer(args):
    """Train the BPE on `--mb` MB of distinct text (the default corpus, then the stdlib's own source files); median
    times of training and encoding."""
    n, pieces = int(args.mb * 1e6), data.default_corpus()
    size = sum(map(len, pieces))
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if size >= n:
            break
        pieces.append(path.read_text(errors="replace"))
        size += len(pieces[-1])
    text = "\n\n".join(pieces)[:n]
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        tok = data.train_tokenizer([text], args.vocab_size)
        times.append(time.perf_counter() - t0)
    encode_times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ids = tok.encode(text)
        encode_times.append(time.perf_counter() - t0)
    encode_s = statistics.median(encode_times)
    mb = len(text.encode()) / 1e6
    print(json.dumps({"bench": "tokenizer", "text_mb": round(mb, 2), "vocab_size": tok.n_vocab,
                      "train_s": round(statistics.median(times), 3), "train_runs": len(times),
                      "encode_mb_per_s": round(mb / encode_s, 2), "bytes_per_token": round(mb * 1e6 / len(ids), 3)}))


def generate_timing(params, cfg, batch, prompt_len=16, new=200, repeats=3):
    """nanochat's Engine benchmark: a random prompt, `new` tokens sampled at temperature 1 for `batch` rows; the
    first generate call (compiling prefill and decode), then the median, and the prefill alone."""
    prompt = list(np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len))
    run = lambda: sum(1 for _ in nc.generate(params, cfg, prompt, max_tokens=new, key=jax.random.key(1),
                                             num_samples=batch))
    t0 = time.perf_counter()
    run()
    first_s, times = time.perf_counter() - t0, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        steps = run()
        times.append(time.perf_counter() - t0)
    p = nc.unstack(jax.tree.map(lambda w: w.astype(cfg.compute_dtype), params), cfg)  # as generate calls prefill
    tokens = np.array([prompt], np.int32)
    max_len = min(nc._bucket(prompt_len + new), cfg.sequence_len)
    pre = lambda: jax.block_until_ready(nc.prefill(p, tokens, prompt_len, jax.random.key(1), (1.0, 0, 1.0), cfg,
                                                   max_len, batch))
    pre()
    t0 = time.perf_counter()
    for _ in range(10):
        pre()
    prefill_s = (time.perf_counter() - t0) / 10
    return {"batch": batch, "prompt": prompt_len, "new_tokens": steps,
            "decode_tok_per_s": round(batch * steps / statistics.median(times)), "first_generate_s": round(first_s, 2),
            "prefill_ms": round(prefill_s * 1e3, 2), "prefill_tok_per_s": round(prompt_len / prefill_s)}


def bench_decode(args):
    """nanochat's Engine benchmark: a 16-token prompt, 200 sampled tokens (temperature 1), batch 1 and 8."""
    peak = evaluate.peak_flops()[0]  # a 1024^2 fp32 matmul's FLOP/s here
    for name in args.configs:
        cfg = CONFIGS[name]
        params = nc.init_params(cfg, jax.random.key(0))
        for batch in (1, 8):
            r = generate_timing(params, cfg, batch, repeats=args.repeats)
            gflops = nc.estimate_flops(cfg) / 3 * r["decode_tok_per_s"] / 1e9  # the forward third of the training count
            print(json.dumps({"bench": "decode", "config": name, "params": nc.num_scaling_params(cfg)["total"], **r,
                              "gflop_per_s": round(gflops, 2), "mfu": round(gflops * 1e9 / peak, 4), "peak_rss_gb":
                              round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}), flush=True)


def train_step_timing(cfg, B, steps, warmup=3):
    """In this process: time from process start to the first finished step, the first call alone (compile
    included), then the median step time, on random tokens (B, cfg.sequence_len)."""
    params = train.new_params(cfg, jax.random.key(0))
    opt_state = muon.init(params, *nc.param_groups(params))
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (1, B, cfg.sequence_len), dtype=np.int32) for _ in range(2))
    # train.py's default settings; a nonzero Muon weight decay, so the cautious decay runs as in pretraining
    sched, lrs = train.base_schedule(train.parse_args([]), 1000, 1.0, 0.2)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        params, opt_state, m = train.jit_train_step(params, opt_state, (x, y), i, sched, lrs, cfg=cfg)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
        if i == 0:
            first = time.time() - START
    return {"first_step_s": first, "first_call_s": times[0], "step_s": statistics.median(times[warmup:]),
            "loss": float(m["loss"]), "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def bench_train(args):
    """Each config in a fresh process with an empty compilation cache (cold), then again with it filled (warm)."""
    peak = evaluate.peak_flops()[0]  # a 1024^2 fp32 matmul's FLOP/s here
    for name in args.configs:
        cfg, (B, T) = CONFIGS[name], BATCH[name]
        runs = []
        with tempfile.TemporaryDirectory() as cache:
            for _ in ("cold", "warm"):
                out = subprocess.run([sys.executable, __file__, "train-child", "--configs", name, "--steps",
                                      str(args.steps)], env=dict(os.environ, BENCH_CACHE=cache),
                                     capture_output=True, text=True, check=True).stdout
                runs.append(json.loads(out.splitlines()[-1]))
        tok_s = B * T / statistics.median(r["step_s"] for r in runs)
        gflops = nc.estimate_flops(cfg) * tok_s / 1e9
        print(json.dumps({"bench": "train", "config": name, "params": nc.num_scaling_params(cfg)["total"],
                          "batch": [B, T], "dtype": cfg.compute_dtype, "tok_per_s": round(tok_s),
                          "step_ms": round(B * T / tok_s * 1e3, 1), "gflop_per_s": round(gflops, 1),
                          "sgemm_peak_gflop_per_s": round(peak / 1e9, 1), "mfu": round(gflops * 1e9 / peak, 3),
                          "first_step_cold_s": round(runs[0]["first_step_s"], 2),
                          "first_step_warm_s": round(runs[1]["first_step_s"], 2),
                          "peak_rss_gb": round(max(r["peak_rss_gb"] for r in runs), 2),
                          "loss": round(runs[-1]["loss"], 4)}), flush=True)


def bench_accel(args):
    """nanochat's d12 and d20 at T 2048 in bf16 on the accelerator: the training step at the largest device batch
    that fits (tried from 64 down), then prefill of 1,024 tokens and decoding 200 tokens at batch 1 and 32."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        skipped = "no GPU or TPU here; run it where one is (CPU: bench.py train)"
        print(json.dumps({"bench": "accel", "skipped": skipped}))
        return
    peak = evaluate.peak_flops()[0]  # the chip's dense bf16 peak
    for depth in args.depths:
        cfg = nc.config_for_depth(depth, 32768, sequence_len=2048, compute_dtype="bfloat16")
        for B in (64, 32, 16, 8, 4, 2, 1):
            try:
                r = train_step_timing(cfg, B, args.steps)
                break
            except jax.errors.JaxRuntimeError as e:  # out of memory: try half the batch
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
        tok_s = B * cfg.sequence_len / r["step_s"]
        flops = nc.estimate_flops(cfg) * tok_s
        route = nc.attention_route(cfg.attention, device.platform, jnp.bfloat16, cfg.sequence_len, cfg.head_dim)
        print(json.dumps({"bench": "accel", "what": "train", "device": device.device_kind, "depth": depth,
                          "attention": route, "params": nc.num_scaling_params(cfg)["total"],
                          "batch": [B, cfg.sequence_len],
                          "tok_per_s": round(tok_s), "step_ms": round(r["step_s"] * 1e3, 1),
                          "tflop_per_s": round(flops / 1e12, 1), "mfu": round(flops / peak, 3) if peak else None,
                          "first_step_s": round(r["first_call_s"], 1), "loss": round(r["loss"], 4)}), flush=True)
        params = nc.init_params(cfg, jax.random.key(0))
        for batch in (1, 32):
            print(json.dumps({"bench": "accel", "what": "generate", "device": device.device_kind, "depth": depth,
                              **generate_timing(params, cfg, batch, prompt_len=1024, new=200, repeats=2)}), flush=True)


def bench_train_child(args):
    os.environ.setdefault("BENCH_START", repr(START))
    train.setup_process(os.environ["BENCH_CACHE"], restart=True)
    print(json.dumps(train_step_timing(CONFIGS[args.configs[0]], BATCH[args.configs[0]][0], args.steps)))


MODES = {"tokenizer": bench_tokenizer, "decode": bench_decode, "train": bench_train, "train-child": bench_train_child,
         "accel": bench_accel}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--mb", type=float, default=5.0, help="tokenizer: MB of text to train on")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer: vocab size, specials included")
    p.add_argument("--repeats", type=int, default=3, help="runs; the median time is reported")
    p.add_argument("--configs", nargs="*", choices=sorted(CONFIGS),
                   help="models (default: train all three, decode nano and d6)")
    p.add_argument("--steps", type=int, default=10, help="train, accel: timed steps after 3 warm-up steps")
    p.add_argument("--depths", type=int, nargs="*", default=[12, 20], help="accel: nanochat depths (T 2048, bf16)")
    args = p.parse_args()
    args.configs = args.configs or (list(CONFIGS) if args.mode == "train" else ["nano", "d6"])
    MODES[args.mode](args)


if __name__ == "__main__":
    main()
