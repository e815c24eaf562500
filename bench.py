"""
Benchmarks that print one JSON line each, so numbers can be compared across machines and commits.

    python bench.py tokenizer    # BPE training on ~5 MB of the default corpus to vocab 4096, then encode speed

Speed is measured here, never in a timed unit test.
"""
import argparse
import json
import statistics
import time

import data


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


MODES = {"tokenizer": bench_tokenizer}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--mb", type=float, default=5.0, help="tokenizer: MB of text to train on")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokenizer: vocab size, specials included")
    p.add_argument("--repeats", type=int, default=3, help="runs; the median time is reported")
    args = p.parse_args()
    MODES[args.mode](args)


if __name__ == "__main__":
    main()
