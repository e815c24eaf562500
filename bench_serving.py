"""The serving benchmarks, run by `python bench.py serve` (docs/serving.md); each prints JSON
lines:

    python bench.py serve                       # 1, 4, 16 streams through the slot engine, beside
                                                # generate at batch 1
    python bench.py serve --infer-bench d20     # nanochat's infer_bench protocol, its JSON last
    python bench.py serve --chat-traffic 128    # chat-like requests at once through --model
    python bench.py serve --decode-chunk d20    # one decode chunk program alone (--profile DIR)
    python bench.py serve --http CHECKPOINT     # chat.py --serve: 16 clients in turn, then at once
    python bench.py serve --agreement CHECKPOINT  # greedy replies at once against each alone
"""
import collections
import dataclasses
import gzip
import http.client
import json
import os
import pathlib
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import checkpoint
import data
import engine
import kernels
import kvcache
import nanochat as nc
import report
import tasks
import train

# The small models PyTorch nanochat was measured on beside us (docs/performance.md): serve's,
# and bench.py's training benchmarks'
CONFIGS = {
    "nano-char": nc.Config(sequence_len=256, vocab_size=65, n_layer=4, n_head=4, n_kv_head=4,
                           n_embd=128, window_pattern="L"),
    "nano": nc.Config(sequence_len=256, vocab_size=4096, n_layer=4, n_head=4, n_kv_head=4,
                      n_embd=128, window_pattern="L"),
    "d6": nc.Config(sequence_len=512, vocab_size=8192, n_layer=6, n_head=6, n_kv_head=6,
                    n_embd=384, window_pattern="L"),
}


def peak_rss_gb():
    """The process's peak resident memory, GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def serve(args):
    """`python bench.py serve`: the benchmark its flags name (bench.parse_args)."""
    if args.agreement:
        bench_agreement(args.agreement, slots=args.slots)
    elif args.http:
        bench_serve_http(args.http, slots=args.slots)
    elif args.chat_traffic:
        bench_chat_traffic(args.model, args.chat_traffic, kmax=args.kmax,
                           kv_cache=args.kv_cache)
    elif args.decode_chunk:
        bench_decode_chunk(args.decode_chunk, args.rows, tuple(args.positions), kmax=args.kmax,
                           kv_cache=args.kv_cache, profile=args.profile)
    elif args.infer_bench:
        bench_infer(args.infer_bench, args.batch_sizes, kmax=args.kmax, kv_cache=args.kv_cache)
    else:
        bench_serve(args.configs or ("nano", "d6"), args.slots, args.kmax, args.streams,
                    rounds=args.repeats)


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
    view, the engine's start (start_s: its memory check), the median time a step and tokens/s,
    the first call's seconds beyond a step's (its compile, unless the memory check compiled
    it). profile: a directory for jax's trace of `calls` chunks more, and a second line: the
    ops that took the most time a step (top_ops)."""
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
    started = time.perf_counter()
    try:
        eng = engine.Engine(engine.prepare(serving_params(cfg), cfg), cfg, slots=rows, kmax=kmax,
                            attn=kernels.attention_fn(), kv_cache=kv_cache, pages=pool)
    except ValueError as e:  # the slots' cache does not fit
        print(json.dumps({**head, "skipped": str(e)}), flush=True)
        return
    head["start_s"] = round(time.perf_counter() - started, 1)  # its memory check's compile
    state, control = live_slots(eng, pos, owned)

    def chunk(state):  # one call, timed to its records on the host
        start = time.perf_counter()
        state, records = eng.chunk_call(engine.decode_chunk, state, control, rows, view)
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
    time per decode step, tokens/s, MBU and MFU by nanochat's formulas, peak memory. Prints a
    line a batch (with start_s: its engine's memory check and compiles), then its last line:
    one JSON document of nanochat's schema. kv_cache: the engine's (its bytes counted as
    stored)."""
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
        started = time.perf_counter()
        try:
            eng = engine.Engine(params, cfg, slots=min(batch, slots_most), kmax=kmax, attn=attn,
                                kv_cache=kv_cache)
        except ValueError as e:  # its cache does not fit: that line, and the next batch
            print(json.dumps({"bench": "infer", "config": name, "batch_size": batch,
                              "skipped": str(e)}), flush=True)
            continue
        infer_request(eng, prompt, batch, 8)  # warm-up: compiles
        start_s = time.perf_counter() - started  # the engine's memory check and compiles
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
                          "kv_cache": kv_cache or "exact", "start_s": round(start_s, 2)}),
              flush=True)
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
