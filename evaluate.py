"""nanochat's evaluations in JAX: bits per byte, our chat tasks, CORE, ChatCORE, and the run's report card.

    python evaluate.py --eval-bundle ~/eval_bundle --checkpoint checkpoints/base          # CORE
    python evaluate.py --chat-data ~/chat_eval --checkpoint checkpoints/sft --max-problems 100   # ChatCORE
    python evaluate.py --eval-bundle ~/eval_bundle --nanochat-checkpoint ~/.cache/nanochat   # a PyTorch nanochat run

- CORE (DCLM, arXiv 2406.11794), nanochat's base_eval + core_eval: each task of the bundle's core.yaml is shuffled
  with Random(1337), each example takes its few-shot examples with Random(1234 + index) and is scored by its type:
  multiple choice and schema pick the option with the lowest mean loss over the part of the prompts that differs
  (the common token prefix or suffix), language modeling needs every continuation token to be the argmax. Accuracy
  is centred on the task's random baseline, CORE is the mean. No prompt is cropped, as in nanochat.
- ChatCORE, nanochat's chat_eval: ARC-Easy, ARC-Challenge and MMLU are categorical (the question rendered with
  lettered choices; the argmax over the letters' logits after <|assistant_start|>), GSM8K and HumanEval generative
  (greedy through the KV-cache engine with the calculator, pass@n: GSM8K compares the number after "####", HumanEval
  runs the program against the task's tests in `run_program`'s sandbox). ChatCORE = the mean of the five accuracies
  centred on nanochat's baselines (0.25 for 4-way choice, 0 for generation).
- Every forward is batched and jitted (`map_rows`): the rows of many examples, sorted by length, padded to powers of
  two and split over the devices of a `jax.sharding` mesh when one is given (train.py passes its training mesh).
- Nothing is downloaded: the bundle and the datasets are local paths (README, Evaluations: where to get them).
- `save_section` / `write_report`: each stage's report.json, and report.md beside the checkpoints built from them
  (nanochat's report card).
"""

import argparse
import contextlib
import csv
import functools
import glob
import itertools
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import chat
import data
import nanochat as nc

# ------------------------------------------------------------------------------------------------ scoring rows


@functools.partial(jax.jit, static_argnames="cfg")
def next_token_scores(params, ids, lengths, cfg):
    """nanochat's forward_model: at every position of ids (B, T) the loss of the next token and the argmax
    prediction, (B, T) each (the last column scores whatever follows; no span reads it)."""
    logits = nc.forward(params, ids, cfg)  # (B, T, V) fp32
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.roll(ids, -1, axis=1)[..., None], -1)[..., 0]
    return nll, jnp.argmax(logits, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="cfg")
def last_logits(params, ids, lengths, cfg):
    """The logits (B, vocab_size) at the last token of each row of ids (B, T): only those positions meet the head."""
    x = nc.hidden(params, ids, cfg)
    return (nc.logits_from_hidden(params, x[jnp.arange(ids.shape[0]), lengths - 1], cfg),)


def _host(x):
    """A device array as numpy on every process (a multi-host array is gathered first)."""
    return multihost_utils.process_allgather(x, tiled=True) if jax.process_count() > 1 else np.asarray(x)


def map_rows(fn, rows, pad, split=None, batch_tokens=1 << 14):
    """fn(ids (B, T), lengths (B,)) -> arrays with a leading B, over token rows of any lengths: rows sorted by length
    into batches of at most batch_tokens tokens, right-padded with `pad` to powers of two in B and T (few shapes, few
    compiles), split over the devices of `split` (a NamedSharding of the rows); returns each row's outputs."""
    order, out = sorted(range(len(rows)), key=lambda i: len(rows[i])), [None] * len(rows)
    devices = split.mesh.size if split is not None else 1
    put = (lambda x: x) if split is None else lambda x: jax.make_array_from_callback(x.shape, split, lambda i: x[i])
    while order:
        T = 1 << (len(rows[order[-1]]) - 1).bit_length()
        n = max(1, batch_tokens // T)
        take, order = order[-n:], order[:-n]  # the longest rows left
        B = -(-(1 << (len(take) - 1).bit_length()) // devices) * devices
        x, lengths = np.full((B, T), pad, np.int32), np.ones(B, np.int32)
        for j, i in enumerate(take):
            x[j, :len(rows[i])], lengths[j] = rows[i], len(rows[i])
        with jax.set_mesh(split.mesh) if split is not None else contextlib.nullcontext():  # for splash's shard_map
            results = [_host(a) for a in fn(put(x), put(lengths))]
        for j, i in enumerate(take):
            out[i] = tuple(a[j] for a in results)
    return out

# ------------------------------------------------------------------------------------------ bits per byte, our tasks


@functools.partial(jax.jit, static_argnames="cfg")
def _bpb_sums(params, inputs, targets, token_bytes, cfg):
    nats = nc.loss_fn(params, inputs, targets, cfg, reduction="none")
    nbytes = jnp.where(targets >= 0, token_bytes[jnp.maximum(targets, 0)], 0)
    return jnp.sum(nats * (nbytes > 0)), jnp.sum(nbytes)


def evaluate_bpb(params, cfg, batches, token_bytes, steps):
    """nanochat's bits per byte: summed nats over summed bytes of the targets; specials count 0 bytes. Each process
    evaluates its own batches with its own copy of the params; the sums are added up over the processes."""
    sums = np.zeros(2)
    for inputs, targets, _ in itertools.islice(batches, steps):
        sums += [float(x) for x in _bpb_sums(params, inputs, targets, token_bytes, cfg)]
    if jax.process_count() > 1:
        sums = multihost_utils.process_allgather(sums).sum(0)
    return sums[0] / (math.log(2) * max(sums[1], 1))


def evaluate_tasks(params, cfg, tok, n=50, questions=(), seed=0, max_tokens=160):
    """Exact-match accuracy per synthetic task on n conversations of its held-out split, and per skill on
    hand-written questions (data.load_questions), greedy: ({task: accuracy}, {skill: accuracy})."""
    reply = lambda c: tok.decode(completions(params, cfg, tok, data.render_for_completion(tok, c), 1, max_tokens)[0])
    tasks = {task: float(np.mean([data.check(c, reply(c)) for c in itertools.islice(
        data.task_conversations(task, "test", seed=seed), n)])) for task in data.TASKS}
    graded = [(q["skill"], data.grade(q["skill"], q["answer"], reply([{"role": "user", "content": q["question"]},
                                                                        {"role": "assistant", "content": "?"}])))
              for q in questions]
    return tasks, {s: float(np.mean([ok for k, ok in graded if k == s])) for s in dict(graded)}

# ------------------------------------------------------------------------------------------------ CORE


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


def read_icl_tasks(path):
    """The icl_tasks list of a core.yaml, read without PyYAML: flat mappings of scalars and lists ([0] or '- 0'
    lines), each task opened by '-' (alone or before its first key), comments after '#'."""
    tasks, key = None, None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = re.sub(r"""(^|\s)#(?=(?:[^"']|"[^"]*"|'[^']*')*$).*""", "", line.rstrip("\n")).rstrip()
            s = line.strip()
            if not s:
                continue
            if not line[0].isspace() and not s.startswith("-"):  # a top-level key: icl_tasks starts, others end it
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
                raise ValueError(f"{path}:{n}: cannot read {s!r}; core.yaml holds nanochat's icl_tasks list")
            key, value = (t.strip() for t in s.split(":", 1))
            tasks[-1][key] = _scalar(value) if value else []
    if not tasks:
        raise ValueError(f"{path}: no icl_tasks list; pass nanochat's eval_bundle directory (README: Evaluations)")
    return tasks


CORE_TYPES = {"multiple_choice": ("query", "choices", "gold"), "schema": ("context_options", "continuation", "gold"),
              "language_modeling": ("context", "continuation")}


def load_bundle(bundle, max_per_task=-1):
    """nanochat's eval_bundle (core.yaml, eval_meta_data.csv, eval_data/*.jsonl) as a list of tasks: {label, type,
    num_fewshot, delimiter, baseline (percent), data (shuffled with Random(1337), at most max_per_task)}."""
    where = "; get eval_bundle.zip from nanochat's base_eval.py (EVAL_BUNDLE_URL) and unzip it (README: Evaluations)"
    for f in ("core.yaml", "eval_meta_data.csv", "eval_data"):
        if not os.path.exists(os.path.join(bundle, f)):
            raise FileNotFoundError(f"{bundle}: no {f} here, not an eval_bundle directory{where}")
    with open(os.path.join(bundle, "eval_meta_data.csv"), encoding="utf-8") as f:
        try:
            baselines = {r["Eval Task"]: float(r["Random baseline"]) for r in csv.DictReader(f)}
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{bundle}/eval_meta_data.csv: want 'Eval Task' and 'Random baseline' columns{where}")
    tasks = []
    for t in read_icl_tasks(os.path.join(bundle, "core.yaml")):
        label, kind, uri, shots = (t.get(k) for k in ("label", "icl_task_type", "dataset_uri", "num_fewshot"))
        if kind not in CORE_TYPES or not isinstance(uri, str) or not isinstance(shots, list) or not shots:
            raise ValueError(f"{bundle}/core.yaml: task {label!r} needs icl_task_type (one of {list(CORE_TYPES)}), "
                             "dataset_uri and a num_fewshot list")
        if label not in baselines:
            raise ValueError(f"{bundle}/eval_meta_data.csv: no 'Random baseline' for task {label!r}{where}")
        path = os.path.join(bundle, "eval_data", uri)
        items = [row for _, row in data._json_lines(path, f"a {kind} example")]
        if bad := [i for i, r in enumerate(items) if not isinstance(r, dict) or not all(k in r for k in
                                                                                         CORE_TYPES[kind])]:
            raise ValueError(f"{path}: example {bad[0]} lacks one of {CORE_TYPES[kind]}, the fields of a {kind} task")
        random.Random(1337).shuffle(items)
        items = items[:max_per_task] if max_per_task > 0 else items
        if len(items) <= int(shots[0]):
            raise ValueError(f"task {label!r} takes {shots[0]}-shot examples from the others of its {len(items)}; "
                             "evaluate more examples per task")
        tasks.append(dict(label=label, type=kind, num_fewshot=int(shots[0]), baseline=baselines[label],
                          delimiter=t.get("continuation_delimiter", " "),
                          data=items))
    return tasks


def core_prompts(item, kind, delimiter, fewshot):
    """nanochat's CORE prompts (core_eval.render_prompts_*): each few-shot example and a blank line, then the item
    once per choice (multiple choice), per context option (schema), or without and with its continuation (LM)."""
    if kind == "multiple_choice":
        shots = "".join(f"{e['query']}{delimiter}{e['choices'][e['gold']]}\n\n" for e in fewshot)
        return [f"{shots}{item['query']}{delimiter}{c}" for c in item["choices"]]
    if kind == "schema":
        shots = "".join(f"{e['context_options'][e['gold']]}{delimiter}{e['continuation']}\n\n" for e in fewshot)
        return [f"{shots}{c}{delimiter}{item['continuation']}" for c in item["context_options"]]
    shots = "".join(f"{str(e['context']).strip()}{delimiter}{e['continuation']}\n\n" for e in fewshot)
    prompt = f"{shots}{str(item['context']).strip()}{delimiter}"
    return [prompt.strip(), prompt + str(item["continuation"])]  # the LM prompt without is stripped, as nanochat's


def _common(rows, reverse=False):
    """Length of the token prefix (suffix) all rows share."""
    rows = [r[::-1] if reverse else r for r in rows]
    return next((i for i, column in enumerate(zip(*rows)) if len(set(column)) > 1), min(map(len, rows)))


def core_example(tok, task, idx):
    """(token rows, span starts, span ends) of example idx of a task, as nanochat's evaluate_example builds them:
    rows start with BOS; multiple choice scores each row after the prefix they share, schema the suffix they share,
    language modeling the continuation after the prompt without it."""
    items, kind, k = task["data"], task["type"], task["num_fewshot"]
    fewshot = [items[i] for i in random.Random(1234 + idx).sample([i for i in range(len(items)) if i != idx], k)] \
        if k > 0 else []
    rows = [[tok.bos] + tok.encode(p) for p in core_prompts(items[idx], kind, task["delimiter"], fewshot)]
    ends = [len(r) for r in rows]
    if kind == "multiple_choice":
        return rows, [_common(rows)] * len(rows), ends
    if kind == "schema":
        return rows, [e - _common(rows, reverse=True) for e in ends], ends
    without, with_ = rows
    if with_[:len(without)] != without or len(without) >= len(with_):
        raise ValueError(f"task {task['label']} example {idx}: the prompt without its continuation does not tokenize "
                         "to a prefix of the prompt with it (nanochat asserts the same)")
    return [with_], [len(without)], [len(with_)]


def evaluate_core(params, cfg, tok, tasks, split=None, batch_tokens=1 << 14, details=False, log=print):
    """CORE as nanochat's evaluate_core: {results, centered_results, core_metric}; with details also per_example:
    {label: each example's correctness and its rows' mean span losses}."""
    out = {"results": {}, "centered_results": {}, "per_example": {}}
    score = functools.partial(next_token_scores, params, cfg=cfg)
    for task in tasks:
        t = time.perf_counter()
        examples = [core_example(tok, task, i) for i in range(len(task["data"]))]
        scores = iter(map_rows(score, [r for ex in examples for r in ex[0]], tok.bos, split, batch_tokens))
        correct, losses = [], []
        for (rows, starts, ends), item in zip(examples, task["data"]):
            spans = [(nll[s - 1:e - 1], pred[s - 1:e - 1], row[s:e])
                     for row, s, e, (nll, pred) in zip(rows, starts, ends, scores)]
            losses.append([float(nll.mean()) for nll, _, _ in spans])
            if task["type"] == "language_modeling":
                correct.append(bool(np.array_equal(spans[0][1], spans[0][2])))
            else:  # the first option of the lowest mean loss, as list.index(min(...)) picks it
                correct.append(losses[-1].index(min(losses[-1])) == item["gold"])
        acc = float(np.mean(np.array(correct, np.float32)))  # a float32 mean, as nanochat's torch tensor
        rb = 0.01 * task["baseline"]
        out["results"][task["label"]], out["centered_results"][task["label"]] = acc, (acc - rb) / (1 - rb)
        out["per_example"][task["label"]] = {"correct": correct, "mean_losses": losses}
        log(f"CORE {task['label']} ({task['num_fewshot']}-shot {task['type']}): accuracy {acc:.4f} | centered "
            f"{(acc - rb) / (1 - rb):.4f} | {len(correct)} examples in {time.perf_counter() - t:.1f} s")
    out["core_metric"] = sum(out["centered_results"].values()) / max(len(tasks), 1)
    if not details:
        del out["per_example"]
    log(f"CORE metric: {out['core_metric']:.4f}")
    return out

# ------------------------------------------------------------------------------------------------ chat tasks


CHAT_TASKS = {  # nanochat's chat_eval tasks: (Hugging Face dataset, its subset directory, centring baseline)
    "ARC-Easy": ("allenai/ai2_arc", "ARC-Easy", 0.25), "ARC-Challenge": ("allenai/ai2_arc", "ARC-Challenge", 0.25),
    "MMLU": ("cais/mmlu", "all", 0.25), "GSM8K": ("openai/gsm8k", "main", 0.0),
    "HumanEval": ("openai/openai_humaneval", "openai_humaneval", 0.0)}


def render_mc(question, letters, choices):
    """nanochat's multiple-choice prompt: each choice followed by =letter (no space: the reply is the bare letter)."""
    return (f"Multiple Choice question: {question}\n" + "".join(f"- {c}={l}\n" for l, c in zip(letters, choices))
            + "\nRespond only with the letter of the correct answer.")


def gsm8k_parts(answer):
    """A GSM8K solution as assistant parts: each <<expr=result>> becomes a calculator call and its output."""
    parts = []
    for piece in re.split(r"(<<[^>]+>>)", answer):
        if piece.startswith("<<") and piece.endswith(">>"):
            expr, _, result = piece[2:-2].rpartition("=") if "=" in piece else (piece[2:-2], "", "")
            parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
        else:
            parts.append({"type": "text", "text": piece})
    return parts


def chat_conversation(name, row):
    """A dataset row (Hugging Face's fields) as nanochat's task conversation: {"messages": the user's question and the
    reference answer, "letters": the choices' letters of a categorical task}, plus HumanEval's test and entry point."""
    letters, extra = None, {}
    if name.startswith("ARC"):
        if isinstance(row["question"], dict):  # AI2's own .jsonl: the choices sit inside the question
            row = {"question": row["question"]["stem"], "answerKey": row["answerKey"],
                   "choices": {k: [c[k] for c in row["question"]["choices"]] for k in ("text", "label")}}
        letters = row["choices"]["label"]
        question, answer = render_mc(row["question"], letters, row["choices"]["text"]), row["answerKey"]
    elif name == "MMLU":
        letters = ("A", "B", "C", "D")
        question, answer = render_mc(row["question"], letters, row["choices"]), letters[row["answer"]]
    elif name == "GSM8K":
        question, answer = row["question"], gsm8k_parts(row["answer"])
    else:
        question, answer = row["prompt"], f"{row['prompt']}\n{row['canonical_solution']}"
        extra = {"test": row["test"], "entry_point": row["entry_point"]}
    if letters is not None and answer not in letters:
        raise ValueError(f"the answer {answer!r} is not one of the letters {list(letters)}")
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "letters": letters, **extra}


def _rows(path):
    """The rows of a .parquet (needs pyarrow) or .jsonl file, as dicts."""
    if not path.endswith(".parquet"):
        return [row for _, row in data._json_lines(path, "a JSON object")]
    try:
        import pyarrow.parquet as pq  # optional, as for nanochat's pretraining shards
    except ImportError:
        raise ImportError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow (or pass .jsonl)") from None
    return pq.read_table(path).to_pylist()


def load_chat_task(root, name, split="test"):
    """Task `name`'s conversations from the split's .parquet or .jsonl files under root/<dataset>/<subset>/ (a
    Hugging Face snapshot's layout), in nanochat's order (shuffled by numpy's default_rng(42))."""
    repo, subset, _ = CHAT_TASKS[name]
    folder = os.path.join(root, repo.split("/")[1], subset)
    files = sorted(f for ext in ("parquet", "jsonl") for f in glob.glob(os.path.join(folder, f"{split}*.{ext}")))
    if not files:
        raise FileNotFoundError(f"{folder}: no {split}*.parquet or {split}*.jsonl; get them with `huggingface-cli "
                                f"download {repo} --repo-type dataset --local-dir {os.path.dirname(folder)}`")
    rows, convs = [r for f in files for r in _rows(f)], []
    for i in np.random.default_rng(42).permutation(len(rows)):
        try:
            convs.append(chat_conversation(name, rows[i]))
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
            what = f"no field {e}" if isinstance(e, KeyError) else str(e) or type(e).__name__
            raise ValueError(f"{folder}: row {i}: {what}; want the layout of Hugging Face's {repo}") from None
    return convs


def load_chat_tasks(root, max_problems=-1, names=tuple(CHAT_TASKS), log=print):
    """{name: its first max_problems test conversations} of the ChatCORE tasks found under root; one line names the
    missing ones and how to get them."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such directory; it should hold the ChatCORE datasets (README)")
    tasks, missing = {}, []
    for name in names:
        try:
            tasks[name] = load_chat_task(root, name)[:max_problems if max_problems > 0 else None]
        except FileNotFoundError as e:
            missing.append(str(e).split("; ", 1)[1])
    if not tasks:
        raise FileNotFoundError(f"{root}: none of the ChatCORE datasets; " + "; ".join(missing))
    if missing:
        log(f"ChatCORE needs all 5 tasks; {len(missing)} missing: " + "; ".join(missing))
    return tasks


GSM_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_answer(text):
    """The number after '####' (GSM8K's answer line), commas dropped, or None."""
    m = GSM_RE.search(text)
    return m.group(1).strip().replace(",", "") if m else None


def humaneval_program(conversation, completion):
    """HumanEval's test program: the prompt's imports, the completion's code (its first ``` block, if any), the
    task's tests and check(entry_point)."""
    imports = []
    for line in conversation["messages"][0]["content"].split("\n"):
        if line.strip().startswith(("import ", "from ")):
            imports.append(line.strip())
        elif line.strip() and not line.strip().startswith("#"):
            break
    blocks = re.findall(r"```(?:python)?\s*\n(.*?)\n```", completion, re.DOTALL)
    code = blocks[0].strip() if blocks else completion.strip()
    return "\n".join(imports) + f"\n\n{code}\n\n{conversation['test']}\ncheck({conversation['entry_point']})"


def gsm8k_correct(messages, completion):
    """GSM8K's check (and RL reward): the completion's '####' number equals the reference's (its last text part)."""
    return gsm8k_answer(completion) == gsm8k_answer(messages[-1]["content"][-1]["text"])


def chat_check(name, conversation, completion):
    """nanochat's task.evaluate: whether a decoded completion solves the task."""
    if name == "GSM8K":
        return gsm8k_correct(conversation["messages"], completion)
    if name == "HumanEval":
        return run_program(humaneval_program(conversation, completion))[0]
    return completion == conversation["messages"][-1]["content"]


def sample(params, cfg, tok, prompt, n=1, max_tokens=512, temperature=0.0, top_k=50, key=None):
    """n continuations of a prompt through the KV-cache engine with the calculator tool: (token lists, each ending
    with its stop token if it stopped; masks: 1 where the model chose the token, 0 where the tool forced it). Empty
    ones if the prompt leaves no room in the context."""
    rows, masks, stop = [[] for _ in range(n)], [[] for _ in range(n)], (tok.special["<|assistant_end|>"], tok.bos)
    if len(prompt) >= cfg.sequence_len:
        return rows, masks
    key = jax.random.key(0) if key is None else key
    for column, mask in nc.generate(params, cfg, prompt, max_tokens=max_tokens, key=key, temperature=temperature,
                                    top_k=top_k, num_samples=n, stop_ids=stop, tool=data.calculator_tool(tok)):
        for row, m, t, k in zip(rows, masks, column, mask):
            if not (row and row[-1] in stop):  # a finished row takes no more tokens
                row.append(t)
                m.append(k)
    return rows, masks


def completions(params, cfg, tok, prompt, n=1, max_tokens=512, temperature=0.0, top_k=50, key=None):
    """`sample`'s continuations without their stop tokens."""
    stop = (tok.special["<|assistant_end|>"], tok.bos)
    return [r[:-1] if r and r[-1] in stop else r
            for r in sample(params, cfg, tok, prompt, n, max_tokens, temperature, top_k, key)[0]]


def evaluate_chat(params, cfg, tok, tasks, split=None, num_samples=1, max_tokens=512, temperature=0.0, top_k=50,
                  batch_tokens=1 << 14, log=print):
    """nanochat's chat_eval on {name: conversations}: {"results": {name: accuracy}, "chatcore": the mean centred
    accuracy when all five tasks ran, else None}. `params` may be sharded (categorical) - generation runs on the
    first device's copy."""
    results = {}
    for name, convs in tasks.items():
        t = time.perf_counter()
        if CHAT_TASKS[name][2] > 0:  # categorical: the letter of the largest logit among the choices' letters
            prompts = [data.render_for_completion(tok, c["messages"]) for c in convs]
            logits = map_rows(functools.partial(last_logits, params, cfg=cfg), prompts, tok.bos, split, batch_tokens)
            letter = {}
            for c in convs:
                for l in c["letters"]:
                    if len(ids := tok.encode(l)) != 1:
                        raise ValueError(f"{name}: the letter {l!r} is {len(ids)} tokens in this tokenizer; "
                                         "categorical evaluation needs one token per letter")
                    letter[l] = ids[0]
            passed = [c["letters"][int(np.argmax(z[[letter[l] for l in c["letters"]]]))] ==
                      c["messages"][-1]["content"] for c, (z,) in zip(convs, logits)]
        else:  # generative: pass@num_samples
            p = jax.tree.map(lambda x: x.addressable_data(0), params) if split is not None else params
            passed = []
            for i, c in enumerate(convs):
                outs = completions(p, cfg, tok, data.render_for_completion(tok, c["messages"]), num_samples,
                                   max_tokens, temperature, top_k, jax.random.key(i))
                passed.append(any(chat_check(name, c, tok.decode(o)) for o in outs))
        results[name] = float(np.mean(passed)) if passed else 0.0
        log(f"{name}: {sum(passed)}/{len(passed)} ({100 * results[name]:.2f}%) in {time.perf_counter() - t:.1f} s")
    chatcore = None
    if set(results) == set(CHAT_TASKS):
        chatcore = float(np.mean([(results[n] - CHAT_TASKS[n][2]) / (1 - CHAT_TASKS[n][2]) for n in CHAT_TASKS]))
        log(f"ChatCORE metric: {chatcore:.4f}")
    return {"results": results, "chatcore": chatcore}

# ------------------------------------------------------------------------------------------------ the sandbox
# run_program runs a program written by the model (HumanEval) in a child process: a wall-clock timeout that kills its
# process group, RLIMIT_AS/DATA (runaway allocation is a MemoryError), RLIMIT_FSIZE (16 MB per file, captured output
# included), a fresh temp dir as cwd, and a new empty network namespace where the kernel allows one. An audit hook
# (PEP 578; it cannot be removed once installed) refuses sockets, new processes, signals, ctypes, and every write,
# create, delete, rename, link or chmod of a path outside the temp dir; reads stay allowed (imports need them).
# It stops what LLM-written code does by accident or naively on purpose; it is not a security boundary against
# adversarial code (unaudited paths: os.mkfifo, pidfd signals, importlib internals, patching os.path): use a container.

SANDBOX = r'''  # runs in the child before the program; argv: memory_mb, cpu_seconds; cwd: the temp dir
def _sandbox(mem, cpu):
    import os, sys, resource, shutil, _posixsubprocess, _thread
    try:  # new user + network namespaces: no network interface but a loopback that is down
        import ctypes  # (unprivileged users, containers or old kernels may refuse: then only the hook guards the net)
        netns = ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0  # CLONE_NEWUSER|CLONE_NEWNET
    except Exception:
        netns = False
    for m in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[m]  # so that the program's own `import ctypes` is audited, and refused
    def fork_exec(*args):  # subprocess and multiprocessing's spawn call it directly, without an audit event
        raise PermissionError("sandbox: _posixsubprocess.fork_exec is not allowed")
    _posixsubprocess.fork_exec = fork_exec
    shutil._use_fd_functions = False  # rmtree by path, as directory fds are refused below
    _thread.stack_size(2 << 20)  # not the 8 MB default, which RLIMIT_AS would count against ~10 threads
    limits = [(resource.RLIMIT_AS, mem << 20), (resource.RLIMIT_DATA, mem << 20), (resource.RLIMIT_FSIZE, 16 << 20),
              (resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, cpu)]
    if netns:  # counted per user namespace (Linux >= 5.14), so it caps the program's own processes; root is exempt
        limits.append((resource.RLIMIT_NPROC, 64))
    for r, v in limits:
        hard = resource.getrlimit(r)[1]
        v = v if hard == resource.RLIM_INFINITY else min(v, hard)
        resource.setrlimit(r, (v, v))  # hard = soft, so the program cannot raise them again

    tmp = os.getcwd()  # the parent made it a realpath
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    BANNED = ("socket.", "ctypes.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
              "pty.spawn", "os.kill", "resource.setrlimit", "resource.prlimit")  # prefixes, e.g. os.kill -> os.killpg
    PATHS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
             "os.chflags": (0,), "os.truncate": (0,), "os.utime": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
             "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,)}  # event -> which args are changed paths

    def outside(path):
        if isinstance(path, int):  # an fd: check the file it is open on (pipes and the like are not paths)
            path = os.readlink(f"/proc/self/fd/{path}")
            if not path.startswith("/"):
                return False
        path = os.path.realpath(os.fsdecode(os.fspath(path)))  # relative to the cwd, symlinks followed
        return not (path == tmp or path.startswith(tmp + "/") or path == "/dev/null")

    def hook(event, args):
        if event.startswith(BANNED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].split(".")[0] in ("ctypes", "_ctypes", "_posixsubprocess"):
            raise ImportError(f"sandbox: import {args[0]} is not allowed")  # ImportError: "optional dependency"
        if event == "open":
            path, mode, flags = args
            if (flags & WRITE or any(c in (mode or "") for c in "wax+")) and outside(path):
                raise PermissionError(f"sandbox: write outside its temp dir: {path}")
            if mode is None and os.path.isdir(path):  # os.open: its event hides dir_fd, so allow no directory fds
                raise PermissionError(f"sandbox: os.open of a directory is not allowed: {path}")
        for i in PATHS.get(event, ()):
            if outside(args[i]):
                raise PermissionError(f"sandbox: {event} outside its temp dir: {args[i]}")
    sys.addaudithook(hook)  # only now: the imports above must not be audited

import sys
_sandbox(int(sys.argv[1]), int(sys.argv[2]))
del _sandbox
sys.argv, sys.dont_write_bytecode = ["program.py"], True
exec(compile(open("program.py").read(), "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


def _tail(f, n=10_000):
    # the last n bytes of a captured output file, so a program printing forever cannot flood the parent
    f.seek(max(0, f.seek(0, os.SEEK_END) - n))
    return f.read().decode(errors="replace")


def run_program(code, timeout=5.0, memory_mb=256):
    """Run a Python program in the sandbox: (passed: it exited 0 in time, a one-line error or None, its stdout's last
    10 KB)."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:
        tmp = os.path.realpath(tmp)
        with open(os.path.join(tmp, "program.py"), "w") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        cmd = [sys.executable, "-I", "-c", SANDBOX, str(memory_mb), str(math.ceil(timeout) + 1)]
        # outputs go to files (capped by RLIMIT_FSIZE), not pipes: no reader threads, no unbounded buffers
        with open(os.path.join(tmp, "stdout.txt"), "w+b") as out, open(os.path.join(tmp, "stderr.txt"), "w+b") as err:
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                try:  # kill the whole process group, also whatever the program left behind
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                proc.wait()
            stdout, stderr = _tail(out), _tail(err)
    if rc is None:
        return False, f"timed out after {timeout:g} s", stdout
    if rc == 0:
        return True, None, stdout
    if rc < 0:
        return False, f"killed by signal {-rc}", stdout
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return False, lines[-1] if lines else f"exit status {rc}", stdout


# ------------------------------------------------------------------------------------------------ the report card


BASE_PROMPTS = ("The capital of France is", "The chemical symbol of gold is", "If yesterday was Friday, then tomorrow "
                "will be", "The opposite of hot is", "The planets of the solar system are:", "My favorite color is",
                "If 5*x + 3 = 13, then x is")  # nanochat's base_eval samples
CHAT_PROMPTS = ("Who are you?", "What is 17 times 23?", "Spell the word garden.", "How many r are in strawberry?")
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12, "L4": 121e12,
             "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5": 459e12, "TPU v6 lite": 918e12}  # dense, per chip;
# matched in this order against jax's device_kind ("TPU v5 lite" is v5e, "TPU v5" v5p, "TPU v6 lite" v6e)


def report_samples(params, cfg, tok, stage):
    """A few greedy samples: nanochat's base prompts continued, or a chat model's replies to a few questions."""
    if stage == "base":
        return {p: tok.decode(completions(params, cfg, tok, [tok.bos] + tok.encode(p), 1, 16)[0]) for p in BASE_PROMPTS}
    chat = lambda q: [{"role": "user", "content": q}, {"role": "assistant", "content": "?"}]
    return {q: tok.decode(completions(params, cfg, tok, data.render_for_completion(tok, chat(q)), 1, 64)[0])
            for q in CHAT_PROMPTS}


@functools.cache
def peak_flops():
    """(FLOP/s per device that MFU divides by, how it was found): a known accelerator's dense bf16 peak, or on a CPU
    the measured rate of a 1024 x 1024 fp32 matmul."""
    kind = jax.devices()[0].device_kind
    if name := next((n for n in PEAK_BF16 if n.lower() in kind.lower()), None):
        return PEAK_BF16[name], f"{name} bf16 peak"
    if jax.default_backend() != "cpu":
        return None, f"unknown for {kind}"
    x, matmul = jnp.ones((1024, 1024)), jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(20):
        matmul(x).block_until_ready()
    return 20 * 2 * 1024**3 / (time.perf_counter() - t), "measured: 1024^2 fp32 matmul"


def _write(path, text):
    """Write a text file atomically: a temporary file renamed over it."""
    with open(f"{path}.tmp{os.getpid()}", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp{os.getpid()}", path)


def save_section(out, stage, section):
    """A stage's part of the report card, out/<stage>/report.json, with the machine it ran on."""
    peak, how = peak_flops()
    machine = dict(platform=platform.platform(), cpu=_cpu_name(), cores=os.cpu_count(), python=sys.version.split()[0],
                   jax=jax.__version__, backend=jax.default_backend(), devices=jax.device_count(),
                   device_kind=jax.devices()[0].device_kind, peak_flops=peak, peak_from=how)
    os.makedirs(os.path.join(out, stage), exist_ok=True)
    _write(os.path.join(out, stage, "report.json"), json.dumps(dict(section, machine=machine), indent=1))


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def _duration(seconds):
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def _pct(x):
    return "" if x is None else f"{100 * x:.1f}%"


def _num(x):
    return "" if x is None else f"{x:.4f}"


def _stage_lines(stage, r):
    """A stage's section of report.md: the command, its evaluations' tables, pass@k, samples."""
    lines = [f"\n## {stage}\n", f"`python train.py {' '.join(r['argv'])}`: {_duration(60 * r['minutes'])} in all"
             + ("" if r.get("final_loss") is None else f", final loss {r['final_loss']:.4f}")]
    if "core" in r:
        lines += [f"\nCORE on `{r['core']['data']}`:\n", "| task | accuracy | centred |", "|---|---|---|"]
        lines += [f"| {k} | {v:.4f} | {c:.4f} |" for (k, v), c in zip(r["core"]["results"].items(),
                                                                     r["core"]["centered_results"].values())]
    if "chatcore" in r:
        lines += [f"\nChatCORE tasks on `{r['chatcore']['data']}`:\n", "| task | accuracy |", "|---|---|"]
        lines += [f"| {k} | {_pct(v)} |" for k, v in r["chatcore"]["results"].items()]
    for key, title in (("tasks", "our tasks (template split)"), ("questions", "hand-written questions")):
        if r.get(key):
            lines += [f"\n| {title} | " + " | ".join(r[key]) + " |", "|---" * (len(r[key]) + 1) + "|",
                      "| exact match | " + " | ".join(_pct(v) for v in r[key].values()) + " |"]
    for k in [k for k in r if k.startswith("pass@k")]:
        lines.append(f"\n{k}: " + "; ".join(f"{t} " + ", ".join(f"{n} {v:.3f}" for n, v in d.items())
                                             for t, d in r[k].items()))
    if r.get("recall_bpb"):
        lines.append(f"\ndocstring recall bits/byte: {r['recall_bpb']:.3f}")
    return lines + ["\nSamples (greedy):\n"] + [f"- `{p!r}` -> `{c!r}`" for p, c in r["samples"].items()]


def write_report(out, stages=("base", "sft", "rl")):
    """report.md in out/, nanochat's report card, from the stages' report.json: machine, model, tokens, time and
    MFU per stage, bits per byte, CORE, ChatCORE, our tasks and the hand-written questions, samples."""
    sections = {}
    for s in stages:
        if os.path.isfile(path := os.path.join(out, s, "report.json")):
            with open(path) as f:
                sections[s] = json.load(f)
    if not sections:
        raise FileNotFoundError(f"{out}: no <stage>/report.json yet; run python train.py first")
    m = next(iter(sections.values()))["machine"]
    peak = "?" if m["peak_flops"] is None else f"{m['peak_flops'] / 1e9:,.0f} GFLOP/s"
    lines = ["# nanochat-jax report card\n", f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n",
             "| machine | Python, JAX | devices | MFU against |", "|---|---|---|---|",
             f"| {m['cpu']}, {m['cores']} cores ({m['platform']}) | {m['python']}, jax {m['jax']} ({m['backend']}) | "
             f"{m['devices']} x {m['device_kind']} | {peak} per device ({m['peak_from']}) |\n",
             "| stage | params | FLOPs/token | steps | tokens | train time | MFU | val bits/byte | CORE | ChatCORE |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in sections.items():
        cfg, peak = nc.Config(**r["config"]), r["machine"]["peak_flops"]
        flops = nc.estimate_flops(cfg)  # per token
        mfu = r["tokens"] * flops / (r["train_time"] * peak * r["machine"]["devices"]) if peak and r["train_time"] \
            else None
        lines.append(f"| {s} | {nc.num_scaling_params(cfg)['total']:,} | {flops:,.0f} | {r['steps']} | "
                     f"{r['tokens']:,} | {_duration(r['train_time'])} | {_pct(mfu)} | {_num(r['val_bpb'])} | "
                     f"{_num(r.get('core', {}).get('core_metric'))} | {_num(r.get('chatcore', {}).get('chatcore'))} |")
    for s, r in sections.items():
        lines += _stage_lines(s, r)
    _write(path := os.path.join(out, "report.md"), "\n".join(lines) + "\n")
    return path

# ------------------------------------------------------------------------------------------------ command line


class Parser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag: one line, not the whole usage
        self.exit(2, f"error: {message} (python evaluate.py --help lists every flag)\n")


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="checkpoints", help="a train.py checkpoint: a step dir, or a root whose "
                   "newest rl, sft or base checkpoint is taken (default: checkpoints)")
    p.add_argument("--nanochat-checkpoint", help="a PyTorch nanochat run: a dir of model_<step>.pt, or its base dir")
    p.add_argument("--eval-bundle", help="nanochat's eval_bundle directory: CORE")
    p.add_argument("--chat-data", help="directory of the ChatCORE datasets (README): ChatCORE")
    p.add_argument("--tasks", nargs="+", choices=list(CHAT_TASKS), default=list(CHAT_TASKS), help="ChatCORE tasks")
    p.add_argument("--max-problems", type=int, default=-1, help="at most N examples per task (default -1: all)")
    p.add_argument("--num-samples", type=int, default=1, help="samples per generative problem: pass@N (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="most tokens generated per answer (default 512)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=50, help="top-k sampling (default 50)")
    p.add_argument("--batch-tokens", type=int, default=1 << 14, help="tokens per scoring batch (default 16384)")
    p.add_argument("--distributed", action="store_true", help="jax.distributed.initialize() first (TPU pods, SLURM)")
    args = p.parse_args(argv)
    if not (args.eval_bundle or args.chat_data):
        p.error("give --eval-bundle DIR (CORE) and/or --chat-data DIR (ChatCORE); README: Evaluations")
    if args.distributed:
        jax.distributed.initialize()
    bundle = load_bundle(args.eval_bundle, args.max_problems) if args.eval_bundle else None  # bad input fails first
    tasks = load_chat_tasks(args.chat_data, args.max_problems, args.tasks) if args.chat_data else {}
    params, cfg, tok = (chat.load_nanochat_checkpoint(args.nanochat_checkpoint) if args.nanochat_checkpoint
                        else chat.load_checkpoint(args.checkpoint))
    if tok.n_vocab != cfg.vocab_size:
        raise ValueError(f"the checkpoint's tokenizer has {tok.n_vocab} tokens but its model {cfg.vocab_size}")
    mesh = Mesh(np.array(jax.devices()), ("data",))  # params replicated, the rows of each batch split
    params, rows = jax.device_put(params, NamedSharding(mesh, P())), NamedSharding(mesh, P("data"))
    print(f"{cfg}, {jax.device_count()} devices")
    results = {}
    if bundle:
        results["core"] = evaluate_core(params, cfg, tok, bundle, rows, args.batch_tokens)
    if tasks:
        results["chatcore"] = evaluate_chat(params, cfg, tok, tasks, rows, args.num_samples, args.max_new_tokens,
                                            args.temperature, args.top_k, args.batch_tokens)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:  # bad input: one line, no traceback
        sys.exit(f"error: {e}")
