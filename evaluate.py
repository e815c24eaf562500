"""nanochat's evaluations in JAX: bits per byte, our chat tasks, CORE and ChatCORE.

    python evaluate.py --eval-bundle eval_bundle --checkpoint checkpoints/base  # CORE
    python evaluate.py --chat-data chat_eval --max-problems 100           # ChatCORE
    python evaluate.py --eval-bundle eval_bundle --nanochat-checkpoint ~/.cache/nanochat

- CORE (DCLM, arXiv 2406.11794), nanochat's base_eval and core_eval: each example scored
  by its task's type, the accuracy centred on the task's random baseline, CORE the mean.
- ChatCORE, nanochat's chat_eval: ARC-Easy, ARC-Challenge and MMLU categorical (the
  letters' logits), GSM8K and HumanEval generative (greedy through the slot engine with
  the calculator), the mean of the accuracies centred on nanochat's baselines.
- Every forward is batched and jitted (`map_rows`), rows sorted by length and padded to
  powers of two, split over the devices of a `jax.sharding` mesh when one is given.
Nothing is downloaded: the bundle and the datasets are local paths (docs/evaluations.md
says where to get them and how each evaluation is scored).
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

# ------------------------------------------------------------------------- scoring rows


@functools.partial(jax.jit, static_argnames="cfg")
def next_token_scores(params, ids, lengths, cfg):
    """nanochat's forward_model: at every position of ids (B, T) the loss of the next
    token and the argmax prediction, (B, T) each (the last column scores whatever
    follows; no span reads it)."""
    logits = nc.forward(params, ids, cfg, kernels.attention_fn())  # (B, T, V) fp32
    targets = jnp.roll(ids, -1, axis=1)[..., None]
    log_probs = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_probs, targets, -1)[..., 0]
    return nll, jnp.argmax(logits, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="cfg")
def last_logits(params, ids, lengths, cfg):
    """The logits (B, vocab_size) at the last token of each row of ids (B, T): only those
    positions meet the head."""
    x = nc.hidden(params, ids, cfg, kernels.attention_fn())
    last = x[jnp.arange(ids.shape[0]), lengths - 1]
    return (nc.logits_from_hidden(params, last, cfg),)


def map_rows(fn, rows, pad, row_sharding=None, batch_tokens=1 << 14):
    """fn(ids (B, T), lengths (B,)) -> arrays with a leading B, over token rows of any
    lengths: rows sorted by length into batches of at most batch_tokens tokens,
    right-padded with `pad` to powers of two in B and T (few shapes, few compiles), split
    over the devices by `row_sharding` (a NamedSharding of the rows). Returns each row's
    outputs."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out = [None] * len(rows)
    devices = row_sharding.mesh.size if row_sharding is not None else 1

    def put(x):
        if row_sharding is None:
            return x
        return jax.make_array_from_callback(x.shape, row_sharding, lambda i: x[i])
    while order:
        # 1. the longest rows left, as many as batch_tokens holds at their bucket's T
        T = 1 << (len(rows[order[-1]]) - 1).bit_length()
        n = max(1, batch_tokens // T)
        take = order[-n:]
        order = order[:-n]
        # 2. B a power of two, then a multiple of the devices
        B = 1 << (len(take) - 1).bit_length()
        B = -(-B // devices) * devices
        x = np.full((B, T), pad, np.int32)
        lengths = np.ones(B, np.int32)
        for j, i in enumerate(take):
            x[j, :len(rows[i])] = rows[i]
            lengths[j] = len(rows[i])
        # 3. the batch through fn (a kernel that needs shard_map finds the mesh here)
        mesh = contextlib.nullcontext()
        if row_sharding is not None:
            mesh = jax.set_mesh(row_sharding.mesh)
        with mesh:
            results = [sharding.to_host(a) for a in fn(put(x), put(lengths))]
        for j, i in enumerate(take):
            out[i] = tuple(a[j] for a in results)
    return out


def fit_slots(cfg, wanted, most=64, cache_bytes=2**32):
    """Slots for `wanted` choices at once: a power of 4 (few sizes: few programs to
    compile), at most `most`, whose KV cache fits in cache_bytes (d20 at T 2048 in bf16:
    210 MB a slot)."""
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    per_slot = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * cfg.sequence_len
    per_slot *= itemsize
    limit = max(1, min(most, cache_bytes // per_slot))
    slots = 1
    while slots < wanted and slots * 4 <= limit:
        slots *= 4
    return slots


def generate_batch(params, cfg, tok, prompts, sampling, n=1):
    """Every prompt's n choices, generated together through the slot engine with the
    calculator (prompt i samples with sampling.seed + i): an engine.Request per prompt,
    done, or None where the prompt leaves no room in the context. What the evaluations
    and RL sample with."""
    room = [len(prompt) < cfg.sequence_len for prompt in prompts]
    special = tok.special
    python_ids = (special["<|python_start|>"], special["<|python_end|>"])
    slots = fit_slots(cfg, sum(room) * n)
    eng = engine.Engine(params, cfg, slots=slots, kmax=32, attn=kernels.attention_fn(),
                        python_ids=python_ids)
    # every chunk on all the slots: one program to compile, where a batch's tail is short
    eng.row_buckets = [slots]
    requests = []
    for i, prompt in enumerate(prompts):
        seeded = dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**32)
        fits = room[i]
        tool = data.calculator_tool(tok)
        requests.append(eng.submit(prompt, seeded, n=n, tool=tool) if fits else None)
    eng.drain()
    return requests


def complete(params, cfg, tok, prompts, n=1, max_tokens=512, temperature=0.0, top_k=50,
             seed=0):
    """Each prompt's n replies (generate_batch's, greedy by default), each reply's ids
    without its stop token; empty ones where a prompt leaves no room in the context."""
    stops = data.reply_stops(tok)
    sampling = engine.Sampling(max_tokens=max_tokens, temperature=temperature,
                               top_k=top_k, seed=seed, stop_ids=stops)
    replies = []
    for request in generate_batch(params, cfg, tok, prompts, sampling, n):
        choices = request.tokens if request is not None else [[]] * n
        replies.append([[t for t in choice if t not in stops] for choice in choices])
    return replies

# ---------------------------------------------------------- bits per byte, our tasks


@functools.partial(jax.jit, static_argnames="cfg")
def _bpb_sums(params, inputs, targets, token_bytes, cfg):
    nats = nc.loss_fn(params, inputs, targets, cfg, "none", kernels.attention_fn())
    nbytes = jnp.where(targets >= 0, token_bytes[jnp.maximum(targets, 0)], 0)
    return jnp.sum(nats * (nbytes > 0)), jnp.sum(nbytes)


def evaluate_bpb(params, cfg, batches, token_bytes, steps):
    """nanochat's bits per byte: summed nats over summed bytes of the targets; specials
    count 0 bytes. Each process evaluates its own batches with its own copy of the
    params; the sums are added up over the processes."""
    sums = np.zeros(2)  # nats, bytes
    for inputs, targets, _ in itertools.islice(batches, steps):
        batch_sums = _bpb_sums(params, inputs, targets, token_bytes, cfg)
        sums += [float(x) for x in batch_sums]
    if jax.process_count() > 1:
        sums = multihost_utils.process_allgather(sums).sum(0)
    return float(sums[0] / (math.log(2) * max(sums[1], 1)))


def evaluate_tasks(params, cfg, tok, n=50, questions=(), seed=0, max_tokens=160):
    """Exact-match accuracy per synthetic task on n conversations of its held-out split,
    and per skill on hand-written questions (tasks.load_questions), greedy: ({task: acc},
    {skill: acc})."""
    # 1. the tasks' conversations and the questions, as chats to complete
    convs = {}
    for task in tk.TASKS:
        held_out = tk.task_conversations(task, "test", seed=seed)
        convs[task] = list(itertools.islice(held_out, n))
    asked = [[{"role": "user", "content": q["question"]},
              {"role": "assistant", "content": "?"}]
             for q in questions]
    # 2. every conversation's reply in one batch through the engine
    everything = [c for task in tk.TASKS for c in convs[task]] + asked
    prompts = [data.render_for_completion(tok, c) for c in everything]
    completions = complete(params, cfg, tok, prompts, 1, max_tokens)
    replies = iter(tok.decode(r[0]) for r in completions)
    # 3. each reply checked, in the order asked
    accuracy = {}
    for task in tk.TASKS:
        checks = [tk.check(c, next(replies)) for c in convs[task]]
        accuracy[task] = float(np.mean(checks))
    graded = []
    for q in questions:
        graded.append((q["skill"], tk.grade(q["skill"], q["answer"], next(replies))))
    skills = {}
    for skill in dict(graded):
        oks = [ok for graded_skill, ok in graded if graded_skill == skill]
        skills[skill] = float(np.mean(oks))
    return accuracy, skills


@dataclasses.dataclass(frozen=True)
class Periodic:
    """What training evaluates as it goes (during_training): val bits per byte of
    val_docs (None: the default corpus's val split) every eval_every steps (0: never),
    over eval_steps batches, and a sample every sample_every steps (0: never)."""
    val_docs: object = None  # epoch -> texts (data.corpus)
    eval_every: int = 100
    eval_steps: int = 8
    sample_every: int = 100


def during_training(name, tok, cfg, results, log, device_batch_size, periodic=Periodic(),
                    stage_eval=None):
    """train.train_loop's before_step for stage `name`: periodic's val bits per byte and
    samples, and the stage's own evaluation, stage_eval(params, step, last, results, log)
    (RL's pass@k), given the params as training holds them (sharded under --shard
    full)."""
    token_bytes = jnp.asarray(tok.token_bytes())
    val_docs = periodic.val_docs or data.corpus(None, "val")
    every = periodic.eval_every
    # the sample's prompt: a base model continues text, a chat model answers
    text = "The " if name == "base" else "Who are you?"
    chat = [{"role": "user", "content": text}, {"role": "assistant", "content": "?"}]
    if name == "base":
        prompt = [tok.bos] + tok.encode(text)
    else:
        prompt = data.render_for_completion(tok, chat)

    def before_step(params, step, last):
        if stage_eval is not None:
            stage_eval(params, step, last, results, log)
        val_due = every > 0 and (step % every == 0 or last)
        sample_every = periodic.sample_every
        sample_due = sample_every > 0 and step > 0 and (step % sample_every == 0 or last)
        # gathered only then: sharded, they are the whole model
        if val_due or sample_due:
            own = sharding.local(params)
        if val_due:
            shard = data.every_nth(val_docs, jax.process_index(), jax.process_count())
            val = data.pretrain_batches(tok, shard, device_batch_size, cfg.sequence_len)
            results["val_bpb"] = evaluate_bpb(own, cfg, val, token_bytes,
                                              periodic.eval_steps)
            print(f"step {step:5d} | val bpb {results['val_bpb']:.4f}")
            log({"step": step, "val_bpb": results["val_bpb"]})
            # docstring recall: held-out first sentences, no docstring
            if last and name != "base":
                recall = data.sft_batches(tok, lambda _: tk.recall_conversations("test"),
                                          device_batch_size, cfg.sequence_len)
                results["recall_bpb"] = evaluate_bpb(own, cfg, recall, token_bytes,
                                                     periodic.eval_steps)
        if sample_due:
            sample = complete(own, cfg, tok, [prompt], 1, 24)[0][0]
            print(f"  sample: {text!r} -> {tok.decode(sample)!r}")
    return before_step

# ------------------------------------------------------------------------------- CORE


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


# a '#' outside quotes, and what follows it
COMMENT = re.compile(r"""(^|\s)#(?=(?:[^"']|"[^"]*"|'[^']*')*$).*""")


def read_icl_tasks(path):
    """The icl_tasks list of a core.yaml, read without PyYAML: flat mappings of scalars
    and lists ([0] or '- 0' lines), each task opened by '-' (alone or before its first
    key), comments after '#'."""
    tasks = None  # None until icl_tasks: opens the list
    key = None  # the last key read ("done": past the list)
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = COMMENT.sub("", line.rstrip("\n")).rstrip()
            content = line.strip()
            if not content:
                continue
            # 1. a top-level key opens the list or, after it, closes it
            if not line[0].isspace() and not content.startswith("-"):
                if content == "icl_tasks:":
                    tasks = []
                    key = None
                else:
                    key = "done"
                continue
            if tasks is None or key == "done":
                continue
            # 2. a '-' line: an element of a '- x' list, or a new task
            if content.startswith("-"):
                in_list = key is not None and isinstance(tasks[-1][key], list)
                if ":" not in content and in_list:
                    tasks[-1][key].append(_scalar(content[1:]))
                    continue
                tasks.append({})
                content = content[1:].strip()
                key = None
                if not content:
                    continue
            # 3. a key of the task and its value
            if ":" not in content or not tasks:
                raise ValueError(f"{path}:{n}: cannot read {content!r}; core.yaml holds "
                                 "nanochat's icl_tasks list")
            key, value = (part.strip() for part in content.split(":", 1))
            tasks[-1][key] = _scalar(value) if value else []
    if not tasks:
        raise ValueError(f"{path}: no icl_tasks list; pass nanochat's eval_bundle "
                         "directory (docs/evaluations.md)")
    return tasks


CORE_TYPES = {"multiple_choice": ("query", "choices", "gold"),
              "schema": ("context_options", "continuation", "gold"),
              "language_modeling": ("context", "continuation")}
BUNDLE_HELP = ("; get eval_bundle.zip from nanochat's base_eval.py (EVAL_BUNDLE_URL) "
               "and unzip it (docs/evaluations.md)")


def _bundle_task(bundle, entry, baselines, max_per_task):
    """One task of core.yaml (its entry) with its examples, shuffled with Random(1337) as
    nanochat's are."""
    # 1. the entry's fields, and the task's random baseline
    label = entry.get("label")
    kind = entry.get("icl_task_type")
    uri = entry.get("dataset_uri")
    shots = entry.get("num_fewshot")
    shots_ok = isinstance(shots, list) and shots
    if kind not in CORE_TYPES or not isinstance(uri, str) or not shots_ok:
        raise ValueError(f"{bundle}/core.yaml: task {label!r} needs icl_task_type (one "
                         f"of {list(CORE_TYPES)}), dataset_uri and a num_fewshot list")
    if label not in baselines:
        raise ValueError(f"{bundle}/eval_meta_data.csv: no 'Random baseline' for task "
                         f"{label!r}{BUNDLE_HELP}")
    # 2. its examples, each with the fields of its type
    path = os.path.join(bundle, "eval_data", uri)
    items = [row for _, row in data.json_lines(path, f"a {kind} example")]
    fields = CORE_TYPES[kind]
    bad = [i for i, row in enumerate(items)
           if not isinstance(row, dict) or not all(k in row for k in fields)]
    if bad:
        raise ValueError(f"{path}: example {bad[0]} lacks one of {fields}, the fields "
                         f"of a {kind} task")
    # 3. shuffled, cut, with room for the few-shot examples
    random.Random(1337).shuffle(items)
    items = items[:max_per_task] if max_per_task > 0 else items
    if len(items) <= int(shots[0]):
        raise ValueError(f"task {label!r} takes {shots[0]}-shot examples from the "
                         f"others of its {len(items)}; evaluate more examples per task")
    return dict(label=label,
                type=kind,
                num_fewshot=int(shots[0]),
                baseline=baselines[label],
                delimiter=entry.get("continuation_delimiter", " "),
                data=items)


def load_bundle(bundle, max_per_task=-1):
    """nanochat's eval_bundle (core.yaml, eval_meta_data.csv, eval_data/*.jsonl) as a
    list of tasks: {label, type, num_fewshot, delimiter, baseline (percent), data (at
    most max_per_task)}."""
    for f in ("core.yaml", "eval_meta_data.csv", "eval_data"):
        if not os.path.exists(os.path.join(bundle, f)):
            raise FileNotFoundError(f"{bundle}: no {f} here, not an eval_bundle "
                                    f"directory{BUNDLE_HELP}")
    # each task's random baseline, in percent
    with open(os.path.join(bundle, "eval_meta_data.csv"), encoding="utf-8") as f:
        try:
            baselines = {row["Eval Task"]: float(row["Random baseline"])
                         for row in csv.DictReader(f)}
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{bundle}/eval_meta_data.csv: want 'Eval Task' and "
                             f"'Random baseline' columns{BUNDLE_HELP}") from None
    entries = read_icl_tasks(os.path.join(bundle, "core.yaml"))
    return [_bundle_task(bundle, entry, baselines, max_per_task) for entry in entries]


def core_prompts(item, kind, delimiter, fewshot):
    """nanochat's CORE prompts (core_eval.render_prompts_*): each few-shot example and a
    blank line, then the item once per choice (multiple choice), per context option
    (schema), or without and with its continuation (language modeling)."""
    if kind == "multiple_choice":
        shots = "".join(f"{e['query']}{delimiter}{e['choices'][e['gold']]}\n\n"
                        for e in fewshot)
        return [f"{shots}{item['query']}{delimiter}{c}" for c in item["choices"]]
    if kind == "schema":
        shots = "".join(f"{e['context_options'][e['gold']]}{delimiter}"
                        f"{e['continuation']}\n\n" for e in fewshot)
        ending = f"{delimiter}{item['continuation']}"
        return [f"{shots}{c}{ending}" for c in item["context_options"]]
    shots = "".join(f"{str(e['context']).strip()}{delimiter}{e['continuation']}\n\n"
                    for e in fewshot)
    prompt = f"{shots}{str(item['context']).strip()}{delimiter}"
    # without: stripped, as nanochat's
    return [prompt.strip(), prompt + str(item["continuation"])]


def _common(rows, reverse=False):
    """The length of the token prefix (suffix) all rows share."""
    rows = [r[::-1] if reverse else r for r in rows]
    differ = (i for i, column in enumerate(zip(*rows)) if len(set(column)) > 1)
    return next(differ, min(map(len, rows)))


def core_example(tok, task, idx):
    """(token rows, span starts, span ends) of example idx of a task, as nanochat's
    evaluate_example builds them: rows start with BOS; multiple choice scores each row
    after the prefix they share, schema the suffix they share, language modeling the
    continuation."""
    items = task["data"]
    kind = task["type"]
    # 1. the few-shot examples: k others, drawn with Random(1234 + idx)
    k = task["num_fewshot"]
    fewshot = []
    if k > 0:
        others = [i for i in range(len(items)) if i != idx]
        fewshot = [items[i] for i in random.Random(1234 + idx).sample(others, k)]
    # 2. the prompts' rows, and the span each is scored on
    prompts = core_prompts(items[idx], kind, task["delimiter"], fewshot)
    rows = [[tok.bos] + tok.encode(p) for p in prompts]
    ends = [len(r) for r in rows]
    if kind == "multiple_choice":
        return rows, [_common(rows)] * len(rows), ends
    if kind == "schema":
        return rows, [end - _common(rows, reverse=True) for end in ends], ends
    without, with_ = rows
    if with_[:len(without)] != without or len(without) >= len(with_):
        raise ValueError(f"task {task['label']} example {idx}: the prompt without its "
                         "continuation does not tokenize to a prefix of the prompt with "
                         "it (nanochat asserts the same)")
    return [with_], [len(without)], [len(with_)]


def core_decisions(task, examples, scores):
    """Each example's correctness and its rows' mean span losses: examples as
    core_example gives them, scores an iterator of each row's (nll, argmax) in order."""
    correct = []
    losses = []
    for (rows, starts, ends), item in zip(examples, task["data"]):
        # each row's span: the targets at positions start..end-1, predicted one before
        spans = [(nll[start - 1:end - 1], pred[start - 1:end - 1], row[start:end])
                 for row, start, end, (nll, pred) in zip(rows, starts, ends, scores)]
        losses.append([float(nll.mean()) for nll, _, _ in spans])
        if task["type"] == "language_modeling":
            _, predicted, wanted = spans[0]
            correct.append(bool(np.array_equal(predicted, wanted)))
        else:
            # the first option of the lowest mean loss, as list.index(min(...)) picks it
            correct.append(losses[-1].index(min(losses[-1])) == item["gold"])
    return correct, losses


def evaluate_core(params, cfg, tok, tasks, row_sharding=None, batch_tokens=1 << 14,
                  details=False, log=print):
    """CORE as nanochat's evaluate_core: {results, centered_results, core_metric}; with
    details also per_example: {label: each example's correctness and its rows' mean span
    losses}."""
    out = {"results": {}, "centered_results": {}, "per_example": {}}
    score = functools.partial(next_token_scores, params, cfg=cfg)
    for task in tasks:
        t = time.perf_counter()
        label = task["label"]
        # 1. every row of every example, scored in batches
        examples = [core_example(tok, task, i) for i in range(len(task["data"]))]
        every_row = [row for rows, _, _ in examples for row in rows]
        scored = map_rows(score, every_row, tok.bos, row_sharding, batch_tokens)
        # 2. each example's decision
        correct, losses = core_decisions(task, examples, iter(scored))
        # 3. the accuracy (a float32 mean, as torch's), centred on the random baseline
        acc = float(np.mean(np.array(correct, np.float32)))
        baseline = 0.01 * task["baseline"]
        centred = (acc - baseline) / (1 - baseline)
        out["results"][label] = acc
        out["centered_results"][label] = centred
        out["per_example"][label] = {"correct": correct, "mean_losses": losses}
        seconds = time.perf_counter() - t
        log(f"CORE {label} ({task['num_fewshot']}-shot {task['type']}): accuracy "
            f"{acc:.4f} | centered {centred:.4f} | {len(correct)} examples in "
            f"{seconds:.1f} s")
    # 4. CORE: the mean centred accuracy
    out["core_metric"] = sum(out["centered_results"].values()) / max(len(tasks), 1)
    if not details:
        del out["per_example"]
    log(f"CORE metric: {out['core_metric']:.4f}")
    return out

# --------------------------------------------------------------------------- ChatCORE


def letter_ids(tok, name, convs):
    """{letter: its token id} of a categorical task; each letter must be one token."""
    letter = {}
    for c in convs:
        for choice in c["letters"]:
            if len(ids := tok.encode(choice)) != 1:
                raise ValueError(f"{name}: the letter {choice!r} is {len(ids)} tokens "
                                 "in this tokenizer; categorical evaluation needs one "
                                 "token per letter")
            letter[choice] = ids[0]
    return letter


@dataclasses.dataclass(frozen=True)
class Generation:
    """How ChatCORE's generative tasks sample: pass@num_samples, at most max_tokens a
    reply, greedy by default (nanochat's chat_eval's)."""
    num_samples: int = 1
    max_tokens: int = 512
    temperature: float = 0.0
    top_k: int = 50


def evaluate_chat(params, cfg, tok, tasks, row_sharding=None, generation=Generation(),
                  batch_tokens=1 << 14, log=print):
    """nanochat's chat_eval on {name: conversations}: {"results": {name: accuracy},
    "chatcore": the mean centred accuracy when all five tasks ran, else None}. `params`
    may be sharded (categorical); generation runs on the first device's copy."""
    results = {}
    for name, convs in tasks.items():
        t = time.perf_counter()
        prompts = [data.render_for_completion(tok, c["messages"]) for c in convs]
        # 1. categorical: the largest logit among the choices' letters
        if tk.CHAT_TASKS[name][2] > 0:
            scores = functools.partial(last_logits, params, cfg=cfg)
            logits = map_rows(scores, prompts, tok.bos, row_sharding, batch_tokens)
            letter = letter_ids(tok, name, convs)
            passed = []
            for c, (z,) in zip(convs, logits):
                picked = int(np.argmax(z[[letter[x] for x in c["letters"]]]))
                passed.append(c["letters"][picked] == c["messages"][-1]["content"])
        # 2. generative: pass@num_samples, every problem's samples in one batch
        else:
            own = params if row_sharding is None else sharding.local(params)
            outs = complete(own, cfg, tok, prompts,
                            n=generation.num_samples,
                            max_tokens=generation.max_tokens,
                            temperature=generation.temperature,
                            top_k=generation.top_k)
            passed = [any(tk.chat_check(name, c, tok.decode(o)) for o in samples)
                      for c, samples in zip(convs, outs)]
        results[name] = float(np.mean(passed)) if passed else 0.0
        seconds = time.perf_counter() - t
        log(f"{name}: {sum(passed)}/{len(passed)} ({100 * results[name]:.2f}%) in "
            f"{seconds:.1f} s")
    # 3. ChatCORE, when all five ran: the mean accuracy centred on nanochat's baselines
    chatcore = None
    if set(results) == set(tk.CHAT_TASKS):
        base = {n: baseline for n, (_, _, baseline) in tk.CHAT_TASKS.items()}
        centred = [(results[n] - base[n]) / (1 - base[n]) for n in base]
        chatcore = float(np.mean(centred))
        log(f"ChatCORE metric: {chatcore:.4f}")
    return {"results": results, "chatcore": chatcore}

# ----------------------------------------------------------------------- command line


class Parser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag: one line, not the whole usage
        self.exit(2, f"error: {message} (python evaluate.py --help lists every flag)\n")


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--checkpoint", default="checkpoints",
      help="ours: a step directory, a stage folder (checkpoints/base) or a root, whose "
           "newest rl, sft or base step is taken (default: checkpoints)")
    a("--nanochat-checkpoint",
      help="a PyTorch nanochat run: a directory of model_<step>.pt, or its base "
           "directory")
    a("--eval-bundle", help="nanochat's eval_bundle directory: CORE")
    a("--chat-data", help="the directory of the ChatCORE datasets: ChatCORE")
    a("--tasks", nargs="+", choices=list(tk.CHAT_TASKS), default=list(tk.CHAT_TASKS),
      help="ChatCORE tasks (default: all five)")
    a("--max-problems", type=int, default=-1,
      help="at most N examples per task (default -1: all)")
    a("--num-samples", type=int, default=1,
      help="samples per generative problem: pass@N (default 1)")
    a("--max-new-tokens", type=int, default=512,
      help="most tokens per answer (default 512)")
    a("--temperature", type=float, default=0.0,
      help="sampling temperature (default 0: greedy)")
    a("--top-k", type=int, default=50, help="top-k sampling (default 50)")
    a("--batch-tokens", type=int, default=1 << 14,
      help="tokens per scoring batch (default 16384)")
    a("--distributed", action="store_true",
      help="jax.distributed.initialize() first (TPU pods, SLURM)")
    args = p.parse_args(argv)
    if not (args.eval_bundle or args.chat_data):
        p.error("give --eval-bundle DIR (CORE) and/or --chat-data DIR (ChatCORE); "
                "docs/evaluations.md says where to get them")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.distributed:
        jax.distributed.initialize()
    # 1. the data first: bad input fails before the checkpoint loads
    bundle = None
    if args.eval_bundle:
        bundle = load_bundle(args.eval_bundle, args.max_problems)
    chat_tasks = {}
    if args.chat_data:
        chat_tasks = tk.load_chat_tasks(args.chat_data, args.max_problems, args.tasks)
    # 2. the model: nanochat's, or ours from a root or stage folder's newest step
    if args.nanochat_checkpoint:
        source = args.nanochat_checkpoint
        params, cfg, tok = checkpoint.load_nanochat(source)
    else:
        source = checkpoint.find_step(args.checkpoint)
        params, cfg, tok = checkpoint.load_model(source)
    if tok.n_vocab != cfg.vocab_size:
        raise ValueError(f"the checkpoint's tokenizer has {tok.n_vocab} tokens but its "
                         f"model {cfg.vocab_size}")
    # 3. the params replicated on every device, each batch's rows split over them
    mesh = sharding.data_mesh()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    row_sharding = NamedSharding(mesh, P("data"))
    print(f"{source}: {cfg}, {jax.device_count()} devices")
    # 4. the evaluations
    results = {}
    if bundle:
        results["core"] = evaluate_core(params, cfg, tok, bundle, row_sharding,
                                        args.batch_tokens)
    if chat_tasks:
        generation = Generation(num_samples=args.num_samples,
                                max_tokens=args.max_new_tokens,
                                temperature=args.temperature,
                                top_k=args.top_k)
        results["chatcore"] = evaluate_chat(params, cfg, tok, chat_tasks, row_sharding,
                                            generation=generation,
                                            batch_tokens=args.batch_tokens)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:  # bad input: one line
        sys.exit(f"error: {e}")
