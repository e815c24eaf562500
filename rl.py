"""RL, nanochat's chat_rl: on-policy REINFORCE on the chat tasks' checkers.

Each step samples G replies to each of P task questions with the calculator in the
loop, all P x G through the slot engine at once (`rollout`), rewards each reply with its
task's checker, and trains on the sampled tokens with per-token weights: the advantage,
a reply's reward minus the mean of its group (`rl_batch`). No KL penalty, no ratio or
clipping, the loss normalized per token (DAPO, arXiv 2503.14476). The prompts and
samples of a step follow from (seed, step), so a resumed run is exact. `rl_stage` gives
train.run_stage the stage's fields; `evaluate_passk` is nanochat's pass@k.
"""

import argparse
import dataclasses
import itertools
import json

import jax
import numpy as np

import checkpoint
import data
import engine
import evaluate
import sharding
import tasks


@dataclasses.dataclass(frozen=True)
class Settings:
    """The RL stage's settings: train.py's --rl-* flags, --seed and --chat-data, with
    our defaults (DEFAULTS holds nanochat's, on GSM8K)."""
    task_names: tuple = ("spelling", "counting")  # tasks.rl_tasks': ours, or "gsm8k"
    seed: int = 0
    chat_data: str | None = None  # where GSM8K is read (tasks.load_chat_task)
    prompts: int = 8  # task questions per step
    samples: int = 8  # replies per question (and k of pass@k)
    max_tokens: int = 64  # most tokens sampled per reply
    iterations: int = 40  # steps (<= 0: one epoch of the dataset task)
    lr_frac: float = 0.02  # the lrs: this fraction of the base lrs, decaying to 0
    eval_n: int = 16  # test questions per task for pass@k
    eval_every: int = 0  # pass@k also every N steps (0: only before and after)


def rollout(params, cfg, tok, questions, seed, num_samples, max_tokens, temperature=1.0,
            top_k=50):
    """num_samples replies to each (conversation, reward) question, all sampled together
    with the calculator in the loop (question i with seed + i): per question (prompt +
    reply ids; masks, 1 on the sampled tokens, 0 on the prompt and the tool's output;
    rewards, reward(conversation, decoded reply))."""
    prompts = [data.render_for_completion(tok, conversation)
               for conversation, _ in questions]
    sampling = engine.Sampling(max_tokens=max_tokens, temperature=temperature,
                               top_k=top_k, seed=seed, stop_ids=data.reply_stops(tok))
    requests = evaluate.generate_batch(params, cfg, tok, prompts, sampling, num_samples)
    groups = []
    for (conversation, reward), prompt, request in zip(questions, prompts, requests):
        # a prompt that leaves no room in the context: empty replies
        replies = [[]] * num_samples
        masks = [[]] * num_samples
        if request is not None:
            replies = request.tokens
            masks = request.masks
        # each reply rewarded by its task's checker, and trained on after its prompt
        rewards = [float(reward(conversation, tok.decode(r))) for r in replies]
        rows = [prompt + r for r in replies]
        row_masks = [[0] * len(prompt) + m for m in masks]
        groups.append((rows, row_masks, rewards))
    return groups


def rl_batch(groups, T):
    """(inputs, targets, weights), (P, G, T) each, of P groups of G rollouts (rows,
    masks, rewards): targets only on sampled tokens, each row weighted by its advantage,
    its reward minus its group's mean (no division by the std)."""
    P = len(groups)
    G = len(groups[0][0])
    inputs = np.zeros((P, G, T), np.int32)
    targets = np.full((P, G, T), -1, np.int32)
    weights = np.zeros((P, G, T), np.float32)
    for i, (rows, masks, rewards) in enumerate(groups):
        group_rewards = np.asarray(rewards, np.float64)
        if not np.isfinite(group_rewards).all():
            raise FloatingPointError(f"rewards {rewards} are not all finite: a task's "
                                     "reward must be a number")
        advantages = group_rewards - group_rewards.mean()
        for j, (row, mask) in enumerate(zip(rows, masks)):
            n = len(row) - 1
            inputs[i, j, :n] = row[:-1]
            weights[i, j] = advantages[j]
            # a target only where the next token was sampled
            sampled = np.asarray(mask[1:]) == 1
            targets[i, j, :n] = np.where(sampled, row[1:], -1)
    return inputs, targets, weights


def rl_prompts(rl_tasks, step, n):
    """RL step `step`'s n (conversation, reward) pairs, round-robin over the tasks."""
    names = list(rl_tasks)
    # task j of the round-robin takes every len(names)-th of the n questions from j
    drawn = {}
    for j, name in enumerate(names):
        count = len(range(j, n, len(names)))
        drawn[name] = iter(rl_tasks[name][0](step, count))
    order = (names[i % len(names)] for i in range(n))
    return [(next(drawn[name]), rl_tasks[name][2]) for name in order]


def evaluate_passk(params, cfg, tok, rl_tasks, n, k, seed, max_tokens):
    """nanochat's pass@k (any of the first k samples at temperature 1 correct) on n test
    conversations per task, every task's samples in one batch: {task: {"pass@1": ...,
    "pass@k": ...}}."""
    questions = {name: [(c, reward) for c in itertools.islice(test(), n)]
                 for name, (_, test, reward, _) in rl_tasks.items()}
    everything = [q for name in rl_tasks for q in questions[name]]
    groups = rollout(params, cfg, tok, everything, seed, num_samples=k,
                     max_tokens=max_tokens)
    groups = iter(groups)
    out = {}
    for name in rl_tasks:
        # per question: whether one of its first j samples was right, j = 1..k
        hits = [np.cumsum(next(groups)[2]) > 0 for _ in questions[name]]
        out[name] = {f"pass@{j}": float(np.mean([h[j - 1] for h in hits]))
                     for j in sorted({1, k})}
    return out


def rl_stage(out, tok, settings=Settings()):
    """RL from the newest SFT checkpoint under out, nanochat's chat_rl: each step samples
    `samples` replies to each of `prompts` questions of the tasks (tasks.rl_tasks: ours,
    or "gsm8k" from chat_data) and takes one REINFORCE step on them; lr_frac of the base
    lrs, decaying linearly to 0, no weight decay. iterations <= 0: one epoch of the
    dataset task. pass@k on eval_n test questions per task before, after, and every
    eval_every steps (0: never). Returns the fields of a train.Stage (train.py imports
    this file, so it builds the Stage)."""
    # 1. what the run needs: one process, the replies of a question split evenly
    if jax.process_count() > 1:
        raise ValueError("the RL stage runs in one process (any number of its devices); "
                         "run it without --coordinator")
    # a question's replies are one micro-batch, split by rows
    if settings.samples % jax.device_count():
        raise ValueError(f"--rl-samples {settings.samples} must be a multiple of the "
                         f"{jax.device_count()} devices (each takes an equal share of a "
                         "question's replies)")
    # 2. the model and the tasks, their questions those that leave room to answer
    params, cfg, path = checkpoint.load_stage(out, "sft", tok)

    def fits(messages):
        return len(data.render_for_completion(tok, messages)) < cfg.sequence_len - 1
    rl_tasks = tasks.rl_tasks(settings.task_names, settings.seed, settings.chat_data,
                              fits)
    # 3. a step's batch: rollouts of the step's questions, from the params being trained
    next_batch = batch_sampler(rl_tasks, cfg, tok, settings)
    # one epoch of the smallest dataset task (0: none)
    smallest = min((size for *_, size in rl_tasks.values() if size), default=0)
    epoch = smallest // settings.prompts
    if settings.iterations <= 0 and not epoch:
        raise ValueError("--rl-iterations -1 (one epoch) needs a dataset task: "
                         "--rl-tasks gsm8k")
    # 4. the schedule: the lrs decaying linearly to 0, a flat momentum, no weight decay
    sched = dict(warmup_steps=0, warmdown_ratio=1.0, final_lr_frac=0.0, momentum=0.95,
                 momentum_end=0.95, momentum_warmup=1, weight_decay=0.0)
    return dict(name="rl",
                cfg=cfg,
                init=lambda: params,
                sample=next_batch,
                evaluate=passk_evaluator(rl_tasks, cfg, tok, settings),
                iterations=settings.iterations if settings.iterations > 0 else epoch,
                lr_frac=settings.lr_frac,
                shape=f"{settings.prompts} prompts x {settings.samples} samples",
                schedule=sched,
                source=path)


def batch_sampler(rl_tasks, cfg, tok, settings):
    """train.Stage's sample(params, step, batch_sharding) -> (batch, data states) of RL:
    the step's questions' rollouts on the params, as rl_batch's (inputs, targets,
    weights)."""

    def next_batch(params, step, batch_sharding):
        drawn = rl_prompts(rl_tasks, step, settings.prompts)
        # prompts and samples follow from (seed, step): a resumed run is exact
        step_seed = settings.seed * 1_000_003 + step * settings.prompts
        groups = rollout(sharding.local(params), cfg, tok, drawn, step_seed,
                         num_samples=settings.samples, max_tokens=settings.max_tokens)
        longest = max(len(row) for group in groups for row in group[0])
        T = min(cfg.sequence_len, engine.bucket(longest))  # few shapes: few compiles
        reward = np.mean([group[2] for group in groups])
        print(f"step {step + 1:5d} | reward {reward:.3f}", flush=True)
        return jax.device_put(rl_batch(groups, T), batch_sharding), []
    return next_batch


def passk_evaluator(rl_tasks, cfg, tok, settings):
    """train.Stage's evaluate(params, step, last, results, log) of RL: nanochat's pass@k,
    on 8 samples (its device batch) at most, before and after training and every
    eval_every steps."""

    def passk(params, step, last, results, log):
        periodic = settings.eval_every > 0 and step % settings.eval_every == 0
        if settings.eval_n > 0 and (step == 0 or last or periodic):
            found = evaluate_passk(sharding.local(params), cfg, tok, rl_tasks,
                                   n=settings.eval_n,
                                   k=min(settings.samples, 8),
                                   seed=1,
                                   max_tokens=settings.max_tokens)
            # before the first step, during, and after the last
            key = f"pass@k {step}"
            if step == 0:
                key = "pass@k before"
            if last:
                key = "pass@k"
            results[key] = found
            print(f"step {step:5d} | {json.dumps(found)}")
            log({"step": step, "pass@k": found})
    return passk

# ------------------------------------------------------------------------- command line

DEFAULTS = {  # ours (Settings'), and nanochat's chat_rl (on GSM8K)
    "rl_iterations": (Settings.iterations, -1),
    "rl_prompts": (Settings.prompts, 16),
    "rl_samples": (Settings.samples, 16),
    "rl_max_tokens": (Settings.max_tokens, 256),
    "rl_lr_frac": (Settings.lr_frac, 0.05),
    "rl_eval": (Settings.eval_n, 400),
    "rl_eval_every": (Settings.eval_every, 60)}


def add_flags(p):
    """train.py's RL flags; those not given take DEFAULTS' by --rl-tasks."""
    g = p.add_argument_group("RL (nanochat's chat_rl: REINFORCE with group-mean "
                             "advantages)")

    # the default depends on --rl-tasks: set after parsing
    def rl(flag, kind, what):
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
                   choices=[*tasks.TASKS, "gsm8k"],
                   help="reward tasks (gsm8k: from --chat-data)")
