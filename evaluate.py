"""nanochat's evaluations in JAX: bits per byte, our chat tasks, CORE and ChatCORE.

    python evaluate.py --eval-bundle eval_bundle --checkpoint checkpoints/base            # CORE
    python evaluate.py --chat-data chat_eval --checkpoint checkpoints/sft --max-problems 100
    python evaluate.py --eval-bundle eval_bundle --nanochat-checkpoint ~/.cache/nanochat

- CORE (DCLM, arXiv 2406.11794), nanochat's base_eval and core_eval: each task of the bundle's
  core.yaml is shuffled with Random(1337), each example takes its few-shot examples with
  Random(1234 + index) and is scored by its type: multiple choice and schema pick the option with
  the lowest mean loss over the part of the prompts that differs (the common token prefix or
  suffix), language modeling needs every continuation token to be the argmax. Accuracy is centred
  on the task's random baseline, and CORE is the mean. No prompt is cropped, as in nanochat.
- ChatCORE, nanochat's chat_eval: ARC-Easy, ARC-Challenge and MMLU are categorical (the argmax over
  the letters' logits after <|assistant_start|>), GSM8K and HumanEval generative (greedy through
  the slot engine with the calculator, all problems at once, pass@n). ChatCORE is the mean of the
  five accuracies centred on nanochat's baselines (0.25 for 4-way choice, 0 for generation).
  tasks.py reads the datasets and checks the answers.
- Every forward is batched and jitted (`map_rows`): the rows of many examples, sorted by length,
  padded to powers of two and split over the devices of a `jax.sharding` mesh when one is given
  (train.py passes its training mesh).
- Nothing is downloaded: the bundle and the datasets are local paths (docs/evaluations.md).
"""

import argparse
import contextlib
import csv
import dataclasses
import functools
import itertools
import json
import math
import os
import random
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

import checkpoint
import data
import engine
import kernels
import nanochat as nc
import sharding
import tasks as tk

# ---------------------------------------------------------------------------------- scoring rows


@functools.partial(jax.jit, static_argnames="cfg")
def next_token_scores(params, ids, lengths, cfg):
    """nanochat's forward_model: at every position of ids (B, T) the loss of the next token and the
    argmax prediction, (B, T) each (the last column scores whatever follows; no span reads it)."""
    logits = nc.forward(params, ids, cfg, kernels.attention_fn())  # (B, T, V) fp32
    targets = jnp.roll(ids, -1, axis=1)[..., None]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets, -1)[..., 0]
    return nll, jnp.argmax(logits, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="cfg")
def last_logits(params, ids, lengths, cfg):
    """The logits (B, vocab_size) at the last token of each row of ids (B, T): only those positions
    meet the head."""
    x = nc.hidden(params, ids, cfg, kernels.attention_fn())
    return (nc.logits_from_hidden(params, x[jnp.arange(ids.shape[0]), lengths - 1], cfg),)


def map_rows(fn, rows, pad, row_sharding=None, batch_tokens=1 << 14):
    """fn(ids (B, T), lengths (B,)) -> arrays with a leading B, over token rows of any lengths: rows
    sorted by length into batches of at most batch_tokens tokens, right-padded with `pad` to powers
    of two in B and T (few shapes, few compiles), split over the devices by `row_sharding` (a
    NamedSharding of the rows). Returns each row's outputs."""
    order, out = sorted(range(len(rows)), key=lambda i: len(rows[i])), [None] * len(rows)
    devices = row_sharding.mesh.size if row_sharding is not None else 1

    def put(x):
        if row_sharding is None:
            return x
        return jax.make_array_from_callback(x.shape, row_sharding, lambda i: x[i])
    while order:
        T = 1 << (len(rows[order[-1]]) - 1).bit_length()
        n = max(1, batch_tokens // T)
        take, order = order[-n:], order[:-n]  # the longest rows left
        B = -(-(1 << (len(take) - 1).bit_length()) // devices) * devices
        x, lengths = np.full((B, T), pad, np.int32), np.ones(B, np.int32)
        for j, i in enumerate(take):
            x[j, :len(rows[i])], lengths[j] = rows[i], len(rows[i])
        mesh = jax.set_mesh(row_sharding.mesh) if row_sharding is not None else contextlib.nullcontext()
        with mesh:  # (a kernel that needs shard_map finds the mesh here)
            results = [sharding.to_host(a) for a in fn(put(x), put(lengths))]
        for j, i in enumerate(take):
            out[i] = tuple(a[j] for a in results)
    return out


def fit_slots(cfg, wanted, most=64, cache_bytes=2**32):
    """Slots for `wanted` choices at once: a power of 4 (few sizes: few programs to compile), at
    most `most`, whose KV cache fits in cache_bytes (d20 at T 2048 in bf16: 210 MB a slot)."""
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    per_slot = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * cfg.sequence_len * itemsize
    limit = max(1, min(most, cache_bytes // per_slot))
    slots = 1
    while slots < wanted and slots * 4 <= limit:
        slots *= 4
    return slots


def generate_batch(params, cfg, tok, prompts, sampling, n=1):
    """Every prompt's n choices, generated together through the slot engine with the calculator
    (prompt i samples with sampling.seed + i): an engine.Request per prompt, done, or None where
    the prompt leaves no room in the context. What the evaluations and RL sample with."""
    room = [len(prompt) < cfg.sequence_len for prompt in prompts]
    sp = tok.special
    slots = fit_slots(cfg, sum(room) * n)
    # every chunk on all the slots: one program to compile, where a batch's tail is short
    eng = engine.Engine(params, cfg, slots=slots, kmax=32, attn=kernels.attention_fn(),
                        python_ids=(sp["<|python_start|>"], sp["<|python_end|>"]), rows=(slots,))
    requests = []
    for i, prompt in enumerate(prompts):
        seeded = dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**32)
        fits = room[i]
        tool = data.calculator_tool(tok)
        requests.append(eng.submit(prompt, seeded, n=n, tool=tool) if fits else None)
    eng.drain()
    return requests


def complete(params, cfg, tok, prompts, n=1, max_tokens=512, temperature=0.0, top_k=50, seed=0):
    """Each prompt's n replies (generate_batch's, greedy by default), each reply's ids without its
    stop token; empty ones where a prompt leaves no room in the context."""
    stops = data.reply_stops(tok)
    sampling = engine.Sampling(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                               seed=seed, stop_ids=stops)
    replies = []
    for request in generate_batch(params, cfg, tok, prompts, sampling, n):
        choices = request.tokens if request is not None else [[]] * n
        replies.append([[t for t in choice if t not in stops] for choice in choices])
    return replies

# ------------------------------------------------------------------- bits per byte, our tasks


@functools.partial(jax.jit, static_argnames="cfg")
def _bpb_sums(params, inputs, targets, token_bytes, cfg):
    nats = nc.loss_fn(params, inputs, targets, cfg, "none", kernels.attention_fn())
    nbytes = jnp.where(targets >= 0, token_bytes[jnp.maximum(targets, 0)], 0)
    return jnp.sum(nats * (nbytes > 0)), jnp.sum(nbytes)


def evaluate_bpb(params, cfg, batches, token_bytes, steps):
    """nanochat's bits per byte: summed nats over summed bytes of the targets; specials count 0
    bytes. Each process evaluates its own batches with its own copy of the params; the sums are
    added up over the processes."""
    sums = np.zeros(2)
    for inputs, targets, _ in itertools.islice(batches, steps):
        sums += [float(x) for x in _bpb_sums(params, inputs, targets, token_bytes, cfg)]
    if jax.process_count() > 1:
        sums = multihost_utils.process_allgather(sums).sum(0)
    return float(sums[0] / (math.log(2) * max(sums[1], 1)))


def evaluate_tasks(params, cfg, tok, n=50, questions=(), seed=0, max_tokens=160):
    """Exact-match accuracy per synthetic task on n conversations of its held-out split, and per
    skill on hand-written questions (tasks.load_questions), greedy: ({task: acc}, {skill: acc})."""
    convs = {task: list(itertools.islice(tk.task_conversations(task, "test", seed=seed), n))
             for task in tk.TASKS}
    asked = [[{"role": "user", "content": q["question"]}, {"role": "assistant", "content": "?"}]
             for q in questions]
    # every conversation's reply in one batch through the engine
    everything = [c for task in tk.TASKS for c in convs[task]] + asked
    prompts = [data.render_for_completion(tok, c) for c in everything]
    replies = iter(tok.decode(r[0]) for r in complete(params, cfg, tok, prompts, 1, max_tokens))
    accuracy = {}
    for task in tk.TASKS:
        accuracy[task] = float(np.mean([tk.check(c, next(replies)) for c in convs[task]]))
    graded = []
    for q in questions:
        graded.append((q["skill"], tk.grade(q["skill"], q["answer"], next(replies))))
    skills = {s: float(np.mean([ok for k, ok in graded if k == s])) for s in dict(graded)}
    return accuracy, skills

def during_training(name, tok, cfg, results, log, device_batch_size, val_docs=None,
                    eval_every=100, eval_steps=8, sample_every=100, stage_eval=None):
    """train.train_loop's before_step for stage `name`: val bits per byte (of val_docs, by default
    the default corpus's val split) every eval_every steps, a sample every sample_every steps, and
    the stage's own evaluation, stage_eval(params, step, last, results, log) (RL's pass@k), given
    the params as training holds them (sharded under --shard full)."""
    token_bytes = jnp.asarray(tok.token_bytes())
    val_docs = val_docs or data.corpus(None, "val")
    text = "The " if name == "base" else "Who are you?"
    chat = [{"role": "user", "content": text}, {"role": "assistant", "content": "?"}]
    if name == "base":
        prompt = [tok.bos] + tok.encode(text)
    else:
        prompt = data.render_for_completion(tok, chat)

    def before_step(params, step, last):
        if stage_eval is not None:
            stage_eval(params, step, last, results, log)
        val_due = eval_every > 0 and (step % eval_every == 0 or last)
        sample_due = sample_every > 0 and step > 0 and (step % sample_every == 0 or last)
        if val_due or sample_due:  # gathered only then: sharded, they are the whole model
            p = sharding.local(params)
        if val_due:
            shard = data.every_nth(val_docs, jax.process_index(), jax.process_count())
            val = data.pretrain_batches(tok, shard, device_batch_size, cfg.sequence_len)
            results["val_bpb"] = evaluate_bpb(p, cfg, val, token_bytes, eval_steps)
            print(f"step {step:5d} | val bpb {results['val_bpb']:.4f}")
            log({"step": step, "val_bpb": results["val_bpb"]})
            if last and name != "base":  # docstring recall: held-out first sentences, no docstring
                recall = data.sft_batches(tok, lambda _: tk.recall_conversations("test"),
                                          device_batch_size, cfg.sequence_len)
                results["recall_bpb"] = evaluate_bpb(p, cfg, recall, token_bytes, eval_steps)
        if sample_due:
            sample = complete(p, cfg, tok, [prompt], 1, 24)[0][0]
            print(f"  sample: {text!r} -> {tok.decode(sample)!r}")
    return before_step

# ------------------------------------------------------------------------------------------ CORE


def _scalar(text):
    """One YAML scalar or [flow, list] of core.yaml."""
    text = text.strip()
    if text.startswith("["):
        return [_scalar(t) for t in text.strip("[]").split(",") if t.strip()]
    if text.startswith('"'):
        return json.loads(text)  # YAML's double-quoted escapes (\n, \", \\) are JSON's
    if text.startswith("'"):
        return text[1:-1].replace("''", "'")
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text, text)


COMMENT = re.compile(r"""(^|\s)#(?=(?:[^"']|"[^"]*"|'[^']*')*$).*""")  # a '#' outside quotes


def read_icl_tasks(path):
    """The icl_tasks list of a core.yaml, read without PyYAML: flat mappings of scalars and lists
    ([0] or '- 0' lines), each task opened by '-' (alone or before its first key), comments after
    '#'."""
    tasks, key = None, None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = COMMENT.sub("", line.rstrip("\n")).rstrip()
            s = line.strip()
            if not s:
                continue
            if not line[0].isspace() and not s.startswith("-"):  # a top-level key
                tasks, key = ([], None) if s == "icl_tasks:" else (tasks, "done")
                continue
            if tasks is None or key == "done":
                continue
            if s.startswith("-"):
                if ":" not in s and key is not None and isinstance(tasks[-1][key], list):
                    tasks[-1][key].append(_scalar(s[1:]))  # an element of a '- x' list
                    continue
                tasks.append({})  # a new task
                s, key = s[1:].strip(), None
                if not s:
                    continue
            if ":" not in s or not tasks:
                raise ValueError(f"{path}:{n}: cannot read {s!r}; core.yaml holds nanochat's "
                                 "icl_tasks list")
            key, value = (t.strip() for t in s.split(":", 1))
            tasks[-1][key] = _scalar(value) if value else []
    if not tasks:
        raise ValueError(f"{path}: no icl_tasks list; pass nanochat's eval_bundle directory "
                         "(docs/evaluations.md)")
    return tasks


CORE_TYPES = {"multiple_choice": ("query", "choices", "gold"),
              "schema": ("context_options", "continuation", "gold"),
              "language_modeling": ("context", "continuation")}
BUNDLE_HELP = ("; get eval_bundle.zip from nanochat's base_eval.py (EVAL_BUNDLE_URL) and unzip it "
               "(docs/evaluations.md)")


def _bundle_task(bundle, t, baselines, max_per_task):
    """One task of core.yaml with its examples, shuffled with Random(1337) as nanochat's are."""
    label, kind, uri, shots = (t.get(k) for k in ("label", "icl_task_type", "dataset_uri",
                                                  "num_fewshot"))
    shots_ok = isinstance(shots, list) and shots
    if kind not in CORE_TYPES or not isinstance(uri, str) or not shots_ok:
        raise ValueError(f"{bundle}/core.yaml: task {label!r} needs icl_task_type (one of "
                         f"{list(CORE_TYPES)}), dataset_uri and a num_fewshot list")
    if label not in baselines:
        raise ValueError(f"{bundle}/eval_meta_data.csv: no 'Random baseline' for task "
                         f"{label!r}{BUNDLE_HELP}")
    path = os.path.join(bundle, "eval_data", uri)
    items = [row for _, row in data.json_lines(path, f"a {kind} example")]
    fields = CORE_TYPES[kind]
    if bad := [i for i, r in enumerate(items)
               if not isinstance(r, dict) or not all(k in r for k in fields)]:
        raise ValueError(f"{path}: example {bad[0]} lacks one of {fields}, the fields of a {kind} "
                         "task")
    random.Random(1337).shuffle(items)
    items = items[:max_per_task] if max_per_task > 0 else items
    if len(items) <= int(shots[0]):
        raise ValueError(f"task {label!r} takes {shots[0]}-shot examples from the others of its "
                         f"{len(items)}; evaluate more examples per task")
    return dict(label=label, type=kind, num_fewshot=int(shots[0]), baseline=baselines[label],
                delimiter=t.get("continuation_delimiter", " "), data=items)


def load_bundle(bundle, max_per_task=-1):
    """nanochat's eval_bundle (core.yaml, eval_meta_data.csv, eval_data/*.jsonl) as a list of tasks:
    {label, type, num_fewshot, delimiter, baseline (percent), data (at most max_per_task)}."""
    for f in ("core.yaml", "eval_meta_data.csv", "eval_data"):
        if not os.path.exists(os.path.join(bundle, f)):
            raise FileNotFoundError(f"{bundle}: no {f} here, not an eval_bundle "
                                    f"directory{BUNDLE_HELP}")
    with open(os.path.join(bundle, "eval_meta_data.csv"), encoding="utf-8") as f:
        try:
            baselines = {r["Eval Task"]: float(r["Random baseline"]) for r in csv.DictReader(f)}
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{bundle}/eval_meta_data.csv: want 'Eval Task' and 'Random "
                             f"baseline' columns{BUNDLE_HELP}") from None
    return [_bundle_task(bundle, t, baselines, max_per_task)
            for t in read_icl_tasks(os.path.join(bundle, "core.yaml"))]


def core_prompts(item, kind, delimiter, fewshot):
    """nanochat's CORE prompts (core_eval.render_prompts_*): each few-shot example and a blank line,
    then the item once per choice (multiple choice), per context option (schema), or without and
    with its continuation (language modeling)."""
    if kind == "multiple_choice":
        shots = "".join(f"{e['query']}{delimiter}{e['choices'][e['gold']]}\n\n" for e in fewshot)
        return [f"{shots}{item['query']}{delimiter}{c}" for c in item["choices"]]
    if kind == "schema":
        shots = "".join(f"{e['context_options'][e['gold']]}{delimiter}{e['continuation']}\n\n"
                        for e in fewshot)
        return [f"{shots}{c}{delimiter}{item['continuation']}" for c in item["context_options"]]
    shots = "".join(f"{str(e['context']).strip()}{delimiter}{e['continuation']}\n\n"
                    for e in fewshot)
    prompt = f"{shots}{str(item['context']).strip()}{delimiter}"
    return [prompt.strip(), prompt + str(item["continuation"])]  # without: stripped, as nanochat's


def _common(rows, reverse=False):
    """The length of the token prefix (suffix) all rows share."""
    rows = [r[::-1] if reverse else r for r in rows]
    differ = (i for i, column in enumerate(zip(*rows)) if len(set(column)) > 1)
    return next(differ, min(map(len, rows)))


def core_example(tok, task, idx):
    """(token rows, span starts, span ends) of example idx of a task, as nanochat's
    evaluate_example builds them: rows start with BOS; multiple choice scores each row after the
    prefix they share, schema the suffix they share, language modeling the continuation."""
    items, kind, k = task["data"], task["type"], task["num_fewshot"]
    fewshot = []
    if k > 0:
        others = [i for i in range(len(items)) if i != idx]
        fewshot = [items[i] for i in random.Random(1234 + idx).sample(others, k)]
    prompts = core_prompts(items[idx], kind, task["delimiter"], fewshot)
    rows = [[tok.bos] + tok.encode(p) for p in prompts]
    ends = [len(r) for r in rows]
    if kind == "multiple_choice":
        return rows, [_common(rows)] * len(rows), ends
    if kind == "schema":
        return rows, [e - _common(rows, reverse=True) for e in ends], ends
    without, with_ = rows
    if with_[:len(without)] != without or len(without) >= len(with_):
        raise ValueError(f"task {task['label']} example {idx}: the prompt without its "
                         "continuation does not tokenize to a prefix of the prompt with it "
                         "(nanochat asserts the same)")
    return [with_], [len(without)], [len(with_)]


def evaluate_core(params, cfg, tok, tasks, row_sharding=None, batch_tokens=1 << 14, details=False,
                  log=print):
    """CORE as nanochat's evaluate_core: {results, centered_results, core_metric}; with details also
    per_example: {label: each example's correctness and its rows' mean span losses}."""
    out = {"results": {}, "centered_results": {}, "per_example": {}}
    score = functools.partial(next_token_scores, params, cfg=cfg)
    for task in tasks:
        t = time.perf_counter()
        examples = [core_example(tok, task, i) for i in range(len(task["data"]))]
        every_row = [r for ex in examples for r in ex[0]]
        scores = iter(map_rows(score, every_row, tok.bos, row_sharding, batch_tokens))
        correct, losses = [], []
        for (rows, starts, ends), item in zip(examples, task["data"]):
            spans = [(nll[s - 1:e - 1], pred[s - 1:e - 1], row[s:e])
                     for row, s, e, (nll, pred) in zip(rows, starts, ends, scores)]
            losses.append([float(nll.mean()) for nll, _, _ in spans])
            if task["type"] == "language_modeling":
                correct.append(bool(np.array_equal(spans[0][1], spans[0][2])))
            else:  # the first option of the lowest mean loss, as list.index(min(...)) picks it
                correct.append(losses[-1].index(min(losses[-1])) == item["gold"])
        acc = float(np.mean(np.array(correct, np.float32)))  # a float32 mean, as torch's
        rb = 0.01 * task["baseline"]
        centred = (acc - rb) / (1 - rb)
        out["results"][task["label"]], out["centered_results"][task["label"]] = acc, centred
        out["per_example"][task["label"]] = {"correct": correct, "mean_losses": losses}
        log(f"CORE {task['label']} ({task['num_fewshot']}-shot {task['type']}): accuracy "
            f"{acc:.4f} | centered {centred:.4f} | {len(correct)} examples in "
            f"{time.perf_counter() - t:.1f} s")
    out["core_metric"] = sum(out["centered_results"].values()) / max(len(tasks), 1)
    if not details:
        del out["per_example"]
    log(f"CORE metric: {out['core_metric']:.4f}")
    return out

# -------------------------------------------------------------------------------------- ChatCORE


def letter_ids(tok, name, convs):
    """{letter: its token id} of a categorical task; each letter must be one token."""
    letter = {}
    for c in convs:
        for choice in c["letters"]:
            if len(ids := tok.encode(choice)) != 1:
                raise ValueError(f"{name}: the letter {choice!r} is {len(ids)} tokens in this "
                                 "tokenizer; categorical evaluation needs one token per letter")
            letter[choice] = ids[0]
    return letter


def evaluate_chat(params, cfg, tok, tasks, row_sharding=None, num_samples=1, max_tokens=512,
                  temperature=0.0, top_k=50, batch_tokens=1 << 14, log=print):
    """nanochat's chat_eval on {name: conversations}: {"results": {name: accuracy}, "chatcore": the
    mean centred accuracy when all five tasks ran, else None}. `params` may be sharded
    (categorical); generation runs on the first device's copy."""
    results = {}
    for name, convs in tasks.items():
        t = time.perf_counter()
        if tk.CHAT_TASKS[name][2] > 0:  # categorical: the largest logit among the choices' letters
            prompts = [data.render_for_completion(tok, c["messages"]) for c in convs]
            scores = functools.partial(last_logits, params, cfg=cfg)
            logits = map_rows(scores, prompts, tok.bos, row_sharding, batch_tokens)
            letter = letter_ids(tok, name, convs)
            passed = [c["letters"][int(np.argmax(z[[letter[x] for x in c["letters"]]]))]
                      == c["messages"][-1]["content"] for c, (z,) in zip(convs, logits)]
        else:  # generative: pass@num_samples, every problem's samples in one batch
            p = params if row_sharding is None else sharding.local(params)
            prompts = [data.render_for_completion(tok, c["messages"]) for c in convs]
            outs = complete(p, cfg, tok, prompts, num_samples, max_tokens, temperature, top_k)
            passed = [any(tk.chat_check(name, c, tok.decode(o)) for o in samples)
                      for c, samples in zip(convs, outs)]
        results[name] = float(np.mean(passed)) if passed else 0.0
        log(f"{name}: {sum(passed)}/{len(passed)} ({100 * results[name]:.2f}%) in "
            f"{time.perf_counter() - t:.1f} s")
    chatcore = None
    if set(results) == set(tk.CHAT_TASKS):
        base = {n: b for n, (_, _, b) in tk.CHAT_TASKS.items()}
        chatcore = float(np.mean([(results[n] - base[n]) / (1 - base[n]) for n in base]))
        log(f"ChatCORE metric: {chatcore:.4f}")
    return {"results": results, "chatcore": chatcore}

# ---------------------------------------------------------------------------------- command line


class Parser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag: one line, not the whole usage
        self.exit(2, f"error: {message} (python evaluate.py --help lists every flag)\n")


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--checkpoint", default="checkpoints", help="ours: a step directory, a stage folder "
      "(checkpoints/base) or a root, whose newest rl, sft or base step is taken (default: "
      "checkpoints)")
    a("--nanochat-checkpoint", help="a PyTorch nanochat run: a directory of model_<step>.pt, or "
      "its base directory")
    a("--eval-bundle", help="nanochat's eval_bundle directory: CORE")
    a("--chat-data", help="the directory of the ChatCORE datasets: ChatCORE")
    a("--tasks", nargs="+", choices=list(tk.CHAT_TASKS), default=list(tk.CHAT_TASKS),
      help="ChatCORE tasks (default: all five)")
    a("--max-problems", type=int, default=-1, help="at most N examples per task (default -1: all)")
    a("--num-samples", type=int, default=1, help="samples per generative problem: pass@N "
      "(default 1)")
    a("--max-new-tokens", type=int, default=512, help="most tokens per answer (default 512)")
    a("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    a("--top-k", type=int, default=50, help="top-k sampling (default 50)")
    a("--batch-tokens", type=int, default=1 << 14, help="tokens per scoring batch (default 16384)")
    a("--distributed", action="store_true", help="jax.distributed.initialize() first (TPU pods, "
      "SLURM)")
    args = p.parse_args(argv)
    if not (args.eval_bundle or args.chat_data):
        p.error("give --eval-bundle DIR (CORE) and/or --chat-data DIR (ChatCORE); "
                "docs/evaluations.md says where to get them")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.distributed:
        jax.distributed.initialize()
    bundle = load_bundle(args.eval_bundle, args.max_problems) if args.eval_bundle else None
    chat_tasks = {}  # bad input fails first, before the checkpoint loads
    if args.chat_data:
        chat_tasks = tk.load_chat_tasks(args.chat_data, args.max_problems, args.tasks)
    if args.nanochat_checkpoint:
        source = args.nanochat_checkpoint
        params, cfg, tok = checkpoint.load_nanochat(source)
    else:
        source = checkpoint.find_step(args.checkpoint)  # a root or stage folder: its newest step
        params, cfg, tok = checkpoint.load_model(source)
    if tok.n_vocab != cfg.vocab_size:
        raise ValueError(f"the checkpoint's tokenizer has {tok.n_vocab} tokens but its model "
                         f"{cfg.vocab_size}")
    mesh = sharding.data_mesh()  # params replicated, each batch's rows split
    params = jax.device_put(params, NamedSharding(mesh, P()))
    row_sharding = NamedSharding(mesh, P("data"))
    print(f"{source}: {cfg}, {jax.device_count()} devices")
    results = {}
    if bundle:
        results["core"] = evaluate_core(params, cfg, tok, bundle, row_sharding, args.batch_tokens)
    if chat_tasks:
        results["chatcore"] = evaluate_chat(params, cfg, tok, chat_tasks, row_sharding, args.num_samples,
                                            args.max_new_tokens, args.temperature, args.top_k,
                                            args.batch_tokens)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {e}")
