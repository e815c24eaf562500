"""
Benchmarks that print one JSON line each, so numbers can be compared across machines and commits.

    python bench.py tokenizer    # BPE training on ~5 MB of the default corpus to vocab 4096, then encode speed
    python bench.py decode       # KV-cache generation: 16-token prompt, 200 new tokens at batch 1 and 8

Speed is measured here, never in a timed unit test.
"""
import argparse
import json
import statistics
import time

import jax
import numpy as np

import data
import nanochat as nc

# The performance issue's configs (PyTorch nanochat baselines were measured on the same shapes).
CONFIGS = {
    "nano-char": nc.Config(sequence_len=256, vocab_size=65, n_layer=4, n_head=4, n_kv_head=4, n_embd=128,
                           window_pattern="L"),
    "nano": nc.Config(sequence_len=256, vocab_size=4096, n_layer=4, n_head=4, n_kv_head=4, n_embd=128,
                      window_pattern="L"),
    "d6": nc.Config(sequence_len=512, vocab_size=8192, n_layer=6, n_head=6, n_kv_head=6, n_embd=384,
                    window_pattern="L"),
}


def bench_tokenizer(args):
    """Train the BPE on `--mb` MB of default-corpus text (repeated if shorter); median times of training, encoding."""
    text = "\n\n".join(data.default_corpus())
    n = int(args.mb * 1e6)
    text = (text * (n // len(text) + 1))[:n]
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


def bench_decode(args):
    """nanochat's Engine benchmark: a 16-token prompt, 200 sampled tokens (temperature 1), batch 1 and 8."""
    for name in args.configs:
        cfg = CONFIGS[name]
        params = nc.init_params(cfg, jax.random.key(0))
        prompt = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 16))
        tokens = np.array([prompt], np.int32)
        for batch in (1, 8):
            run = lambda: sum(1 for _ in nc.generate(params, cfg, prompt, max_tokens=200, key=jax.random.key(1),
                                                     num_samples=batch))
            run()  # compile
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                steps = run()
                times.append(time.perf_counter() - t0)
            pre = lambda: jax.block_until_ready(nc.prefill(nc.per_layer(params), tokens, 16, jax.random.key(1), 1.0,
                                                           cfg, 256, batch))  # as generate calls it
            pre()
            t0 = time.perf_counter()
            for _ in range(10):
                pre()
            prefill_s = (time.perf_counter() - t0) / 10
            print(json.dumps({"bench": "decode", "config": name, "params": nc.num_scaling_params(cfg)["total"],
                              "batch": batch, "new_tokens": steps, "decode_tok_per_s": round(
                                  batch * steps / statistics.median(times)), "prefill_ms": round(prefill_s * 1e3, 2),
                              "prefill_tok_per_s": round(16 / prefill_s)}), flush=True)


MODES = {"tokenizer": bench_tokenizer, "decode": bench_decode}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--mb", type=float, default=5.0, help="tokenizer: MB of text to train on")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer: vocab size, specials included")
    p.add_argument("--repeats", type=int, default=3, help="runs; the median time is reported")
    p.add_argument("--configs", nargs="*", default=["nano", "d6"], choices=sorted(CONFIGS), help="decode: models")
    args = p.parse_args()
    MODES[args.mode](args)


if __name__ == "__main__":
    main()
