"""RL, nanochat's chat_rl: on-policy REINFORCE on the chat tasks' checkers.

Each step samples G replies to each of P task questions with the calculator in the loop, all
P x G through the slot engine at once (`rollout`), rewards each reply with its task's checker,
and trains on the sampled tokens with per-token weights: the advantage, a reply's reward minus
the mean of its group (`rl_batch`). No KL penalty, no ratio or clipping, the loss normalized per
token (DAPO, arXiv 2503.14476). The prompts and samples of a step follow from (seed, step), so a
resumed run is exact. `rl_stage` gives train.run_stage the stage's fields; `evaluate_passk` is nanochat's
pass@k.
"""

import argparse
import itertools
import json

import jax
import numpy as np

import checkpoint
import data
import engine
import evaluate
import tasks


def rollout(params, cfg, tok, questions, seed, num_samples, max_tokens, temperature=1.0, top_k=50):
    """num_samples replies to each (conversation, reward) question, all sampled together with the
    calculator in the loop (question i with seed + i): per question (prompt + reply ids; masks, 1
    on the sampled tokens, 0 on the prompt and the tool's output; rewards, reward(conversation,
    decoded reply))."""
    prompts = [data.render_for_completion(tok, conversation) for conversation, _ in questions]
    sampling = engine.Sampling(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                               seed=seed, stop_ids=data.reply_stops(tok))
    requests = evaluate.generate_batch(params, cfg, tok, prompts, sampling, num_samples)
    groups = []
    for (conversation, reward), prompt, request in zip(questions, prompts, requests):
        replies = request.tokens if request is not None else [[]] * num_samples
        masks = request.masks if request is not None else [[]] * num_samples
        rewards = [float(reward(conversation, tok.decode(r))) for r in replies]
        rows = [prompt + r for r in replies]
        groups.append((rows, [[0] * len(prompt) + m for m in masks], rewards))
    return groups


def rl_batch(groups, T):
    """(inputs, targets, weights), (P, G, T) each, of P groups of G rollouts (rows, masks, rewards):
    targets only on sampled tokens, each row weighted by its advantage, its reward minus its
    group's mean (no division by the std)."""
    P, G = len(groups), len(groups[0][0])
    x, y = np.zeros((P, G, T), np.int32), np.full((P, G, T), -1, np.int32)
    w = np.zeros((P, G, T), np.float32)
    for i, (rows, masks, rewards) in enumerate(groups):
        r = np.asarray(rewards, np.float64)
        if not np.isfinite(r).all():
            raise FloatingPointError(f"rewards {rewards} are not all finite: a task's reward "
                                     "must be a number")
        for j, (row, mask) in enumerate(zip(rows, masks)):
            n = len(row) - 1
            x[i, j, :n], w[i, j] = row[:-1], r[j] - r.mean()
            y[i, j, :n] = np.where(np.asarray(mask[1:]) == 1, row[1:], -1)
    return x, y, w


def rl_prompts(rl_tasks, step, n):
    """RL step `step`'s n (conversation, reward) pairs, round-robin over the tasks."""
    names = list(rl_tasks)
    drawn = {t: iter(rl_tasks[t][0](step, len(range(j, n, len(names)))))
             for j, t in enumerate(names)}
    return [(next(drawn[t]), rl_tasks[t][2]) for t in (names[i % len(names)] for i in range(n))]


def evaluate_passk(params, cfg, tok, rl_tasks, n, k, seed, max_tokens):
    """nanochat's pass@k (any of the first k samples at temperature 1 correct) on n test
    conversations per task, every task's samples in one batch: {task: {"pass@1": ...,
    "pass@k": ...}}."""
    questions = {t: [(c, reward) for c in itertools.islice(test(), n)]
                 for t, (_, test, reward, _) in rl_tasks.items()}
    everything = [q for t in rl_tasks for q in questions[t]]
    groups = iter(rollout(params, cfg, tok, everything, seed, num_samples=k, max_tokens=max_tokens))
    out = {}
    for t in rl_tasks:
        hits = [np.cumsum(next(groups)[2]) > 0 for _ in questions[t]]
        out[t] = {f"pass@{j}": float(np.mean([h[j - 1] for h in hits])) for j in sorted({1, k})}
    return out


def rl_stage(out, tok, task_names=("spelling", "counting"), seed=0, chat_data=None,
             prompts=8, samples=8, max_tokens=64, iterations=40, lr_frac=0.02, eval_n=16,
             eval_every=0):
    """RL from the newest SFT checkpoint under out, nanochat's chat_rl: each step samples `samples`
    replies to each of `prompts` questions of the tasks (tasks.rl_tasks: ours, or "gsm8k" from
    chat_data) and takes one REINFORCE step on them; lr_frac of the base lrs, decaying linearly to
    0, no weight decay. iterations <= 0: one epoch of the dataset task. pass@k on eval_n test
    questions per task before, after, and every eval_every steps (0: never). Returns the fields
    of a train.Stage (train.py imports this file, so it builds the Stage)."""
    if jax.process_count() > 1:
        raise ValueError("the RL stage runs in one process (any number of its devices); run it "
                         "without --coordinator")
    if samples % jax.device_count():  # a question's replies are one micro-batch, split by rows
        raise ValueError(f"--rl-samples {samples} must be a multiple of the {jax.device_count()} "
                         "devices (each takes an equal share of a question's replies)")
    params, cfg, path = checkpoint.load_stage(out, "sft", tok)

    def fits(messages):  # room to answer
        return len(data.render_for_completion(tok, messages)) < cfg.sequence_len - 1
    rl_tasks = tasks.rl_tasks(task_names, seed, chat_data, fits)

    def next_batch(params, step, split):
        drawn = rl_prompts(rl_tasks, step, prompts)
        # prompts and samples follow from (seed, step): a resumed run is exact
        step_seed = seed * 1_000_003 + step * prompts
        groups = rollout(evaluate.local(params), cfg, tok, drawn, step_seed,
                         num_samples=samples, max_tokens=max_tokens)
        longest = max(len(r) for g in groups for r in g[0])
        T = min(cfg.sequence_len, engine.bucket(longest))  # few shapes: few compiles
        print(f"step {step + 1:5d} | reward {np.mean([g[2] for g in groups]):.3f}", flush=True)
        return jax.device_put(rl_batch(groups, T), split), []
    epoch = min((size for *_, size in rl_tasks.values() if size), default=0) // prompts
    if iterations <= 0 and not epoch:
        raise ValueError("--rl-iterations -1 (one epoch) needs a dataset task: --rl-tasks gsm8k")

    def passk(params, step, last, results, log):  # nanochat's, on 8 samples (its device batch)
        if eval_n > 0 and (step == 0 or last or eval_every > 0 and step % eval_every == 0):
            r = evaluate_passk(evaluate.local(params), cfg, tok, rl_tasks, n=eval_n,
                               k=min(samples, 8), seed=1, max_tokens=max_tokens)
            results["pass@k" if last else "pass@k before" if step == 0 else f"pass@k {step}"] = r
            print(f"step {step:5d} | {json.dumps(r)}")
            log({"step": step, "pass@k": r})
    sched = dict(warmup_steps=0, warmdown_ratio=1.0, final_lr_frac=0.0, momentum=0.95,
                 momentum_end=0.95, momentum_warmup=1, weight_decay=0.0)
    return dict(name="rl", cfg=cfg, init=lambda: params, sample=next_batch, evaluate=passk,
                iterations=iterations if iterations > 0 else epoch, lr_frac=lr_frac,
                shape=f"{prompts} prompts x {samples} samples", schedule=sched, source=path)

# -------------------------------------------------------------------------------- command line

DEFAULTS = {"rl_iterations": (40, -1), "rl_prompts": (8, 16), "rl_samples": (8, 16),
            "rl_max_tokens": (64, 256), "rl_lr_frac": (0.02, 0.05), "rl_eval": (16, 400),
            "rl_eval_every": (0, 60)}  # ours, and nanochat's chat_rl (on GSM8K)


def add_flags(p):
    """train.py's RL flags; those not given take DEFAULTS' by --rl-tasks."""
    g = p.add_argument_group("RL (nanochat's chat_rl: REINFORCE with group-mean advantages)")

    def rl(flag, kind, what):  # the default depends on --rl-tasks: set after parsing
        ours, theirs = DEFAULTS[flag[2:].replace("-", "_")]
        g.add_argument(flag, type=kind, default=argparse.SUPPRESS,
                       help=f"{what} (default {ours}; gsm8k: nanochat's {theirs})")
    rl("--rl-iterations", int, "RL steps (-1: one epoch of the dataset)")
    rl("--rl-prompts", int, "task questions per step")
    rl("--rl-samples", int, "sampled replies per question (and k of pass@k)")
    rl("--rl-max-tokens", int, "most tokens sampled per reply")
    rl("--rl-lr-frac", float, "RL lrs / base lrs")
    rl("--rl-eval", int, "test questions per task for pass@k before and after")
    rl("--rl-eval-every", int, "pass@k also every N steps (0: never)")
    g.add_argument("--rl-tasks", nargs="+", default=["spelling", "counting"],
                   choices=[*tasks.TASKS, "gsm8k"], help="reward tasks (gsm8k: from --chat-data)")
