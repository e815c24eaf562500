"""The run's report card, as nanochat's report.py: each stage of train.py writes its part to
<out>/<stage>/report.json, and report.md beside the checkpoints is rebuilt from all of them: the
machine, Python, JAX and devices; per stage the parameters, FLOPs per token, steps, tokens,
training time and MFU (against the accelerator's dense bf16 peak, or on a CPU against a 1024^2
fp32 matmul measured then), bits per byte, CORE and ChatCORE (when their data was given), our tasks
and the hand-written questions, pass@k, and a few greedy samples.
"""

import dataclasses
import functools
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp

import data
import evaluate
import nanochat as nc
import sharding

BASE_PROMPTS = ("The capital of France is", "The chemical symbol of gold is",
                "If yesterday was Friday, then tomorrow will be", "The opposite of hot is",
                "The planets of the solar system are:", "My favorite color is",
                "If 5*x + 3 = 13, then x is")  # nanochat's base_eval samples
CHAT_PROMPTS = ("Who are you?", "What is 17 times 23?", "Spell the word garden.",
                "How many r are in strawberry?")
# Dense bf16 FLOP/s per chip, matched in this order against jax's device_kind ("TPU v5 lite" is
# v5e, "TPU v5" v5p, "TPU v6 lite" v6e).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12, "A100": 312e12,
             "L4": 121e12, "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5": 459e12,
             "TPU v6 lite": 918e12}


def samples(params, cfg, tok, stage):
    """A few greedy samples: nanochat's base prompts continued, or a chat model's replies."""
    if stage == "base":
        prompts = [[tok.bos] + tok.encode(p) for p in BASE_PROMPTS]
        replies = evaluate.complete(params, cfg, tok, prompts, 1, 16)
        return {p: tok.decode(r[0]) for p, r in zip(BASE_PROMPTS, replies)}
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": "?"}]
             for q in CHAT_PROMPTS]
    prompts = [data.render_for_completion(tok, chat) for chat in chats]
    replies = evaluate.complete(params, cfg, tok, prompts, 1, 64)
    return {q: tok.decode(r[0]) for q, r in zip(CHAT_PROMPTS, replies)}


@functools.cache
def peak_flops():
    """(the FLOP/s per device that MFU divides by, how it was found): a known accelerator's dense
    bf16 peak, or on a CPU the measured rate of a 1024 x 1024 fp32 matmul."""
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


def cpu_name():
    """The CPU's model name, from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
            return next(names)
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def save_section(out, stage, section):
    """A stage's part of the report card, out/<stage>/report.json, with the machine it ran on."""
    peak, how = peak_flops()
    machine = dict(platform=platform.platform(), cpu=cpu_name(), cores=os.cpu_count(),
                   python=sys.version.split()[0], jax=jax.__version__,
                   backend=jax.default_backend(), devices=jax.device_count(),
                   device_kind=jax.devices()[0].device_kind, peak_flops=peak, peak_from=how)
    os.makedirs(os.path.join(out, stage), exist_ok=True)
    text = json.dumps(dict(section, machine=machine), indent=1)
    data.write_atomic(os.path.join(out, stage, "report.json"), text)


def _duration(seconds):
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _pct(x):
    return "" if x is None else f"{100 * x:.1f}%"


def _num(x):
    return "" if x is None else f"{x:.4f}"


def _stage_lines(stage, r):
    """A stage's section of report.md: the command, its evaluations' tables, pass@k, samples."""
    loss = "" if r.get("final_loss") is None else f", final loss {r['final_loss']:.4f}"
    lines = [f"\n## {stage}\n",
             f"`{' '.join(['python train.py', *r['argv']])}`: {_duration(60 * r['minutes'])} in "
             f"all{loss}"]
    if "core" in r:
        lines += [f"\nCORE on `{r['core']['data']}`:\n", "| task | accuracy | centred |",
                  "|---|---|---|"]
        centred = r["core"]["centered_results"].values()
        lines += [f"| {k} | {v:.4f} | {c:.4f} |"
                  for (k, v), c in zip(r["core"]["results"].items(), centred)]
    if "chatcore" in r:
        lines += [f"\nChatCORE tasks on `{r['chatcore']['data']}`:\n", "| task | accuracy |",
                  "|---|---|"]
        lines += [f"| {k} | {_pct(v)} |" for k, v in r["chatcore"]["results"].items()]
    titles = {"tasks": "our tasks (template split)", "questions": "hand-written questions"}
    for key, title in titles.items():
        if r.get(key):
            lines += [f"\n| {title} | " + " | ".join(r[key]) + " |",
                      "|---" * (len(r[key]) + 1) + "|",
                      "| exact match | " + " | ".join(_pct(v) for v in r[key].values()) + " |"]
    for k in [k for k in r if k.startswith("pass@k")]:
        tasks = "; ".join(f"{t} " + ", ".join(f"{n} {v:.3f}" for n, v in d.items())
                          for t, d in r[k].items())
        lines.append(f"\n{k}: {tasks}")
    if r.get("recall_bpb"):
        lines.append(f"\ndocstring recall bits/byte: {r['recall_bpb']:.3f}")
    lines.append("\nSamples (greedy):\n")
    return lines + [f"- `{p!r}` -> `{c!r}`" for p, c in r["samples"].items()]


def _stage_row(stage, r):
    """A stage's row of report.md's table."""
    cfg, peak = nc.Config(**r["config"]), r["machine"]["peak_flops"]
    flops = nc.estimate_flops(cfg)  # per token
    mfu = None
    if peak and r["train_time"]:
        mfu = r["tokens"] * flops / (r["train_time"] * peak * r["machine"]["devices"])
    core = r.get("core", {}).get("core_metric")
    chatcore = r.get("chatcore", {}).get("chatcore")
    return (f"| {stage} | {nc.num_scaling_params(cfg)['total']:,} | {flops:,.0f} | {r['steps']} | "
            f"{r['tokens']:,} | {_duration(r['train_time'])} | {_pct(mfu)} | "
            f"{_num(r['val_bpb'])} | {_num(core)} | {_num(chatcore)} |")


def write_report(out, stages=("base", "sft", "rl")):
    """report.md in out/, nanochat's report card, from the stages' report.json files."""
    sections = {}
    for s in stages:
        if os.path.isfile(path := os.path.join(out, s, "report.json")):
            with open(path) as f:
                sections[s] = json.load(f)
    if not sections:
        raise FileNotFoundError(f"{out}: no <stage>/report.json yet; run python train.py first")
    m = next(iter(sections.values()))["machine"]
    peak = "?" if m["peak_flops"] is None else f"{m['peak_flops'] / 1e9:,.0f} GFLOP/s"
    lines = ["# nanochat-jax report card\n",
             f"Written {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n",
             "| machine | Python, JAX | devices | MFU against |", "|---|---|---|---|",
             f"| {m['cpu']}, {m['cores']} cores ({m['platform']}) | {m['python']}, jax {m['jax']} "
             f"({m['backend']}) | {m['devices']} x {m['device_kind']} | {peak} per device "
             f"({m['peak_from']}) |\n",
             "| stage | params | FLOPs/token | steps | tokens | train time | MFU | val bits/byte | "
             "CORE | ChatCORE |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_stage_row(s, r) for s, r in sections.items()]
    for s, r in sections.items():
        lines += _stage_lines(s, r)
    data.write_atomic(path := os.path.join(out, "report.md"), "\n".join(lines) + "\n")
    return path


def evaluate_stage(name, params, cfg, tok, losses, info, out, argv, eval_tasks=50, questions=(),
                   bundle=(None, None), chat_tasks=(None, None), row_sharding=None):
    """A stage's results, also written into its section of the report card: its losses and time,
    CORE after base, and our tasks, the hand-written questions and ChatCORE after SFT and RL.
    bundle, chat_tasks: (where they were read, evaluate.load_bundle's or tasks.load_chat_tasks'
    data, or None); row_sharding: a NamedSharding over the devices for each batch's rows."""
    r = dict(final_loss=losses[-1] if losses else None, minutes=info["time"] / 60,
             **{k: v for k, v in info.items() if k != "time"})
    (bundle_dir, bundle), (chat_dir, chat_tasks) = bundle, chat_tasks
    own = sharding.local(params)  # sharded params gathered: a collective, so every process joins
    if name == "base" and bundle:
        r["core"] = dict(evaluate.evaluate_core(params, cfg, tok, bundle, row_sharding), data=bundle_dir)
    if name != "base" and eval_tasks > 0:
        r["tasks"], r["questions"] = evaluate.evaluate_tasks(own, cfg, tok, eval_tasks, questions)
    if name != "base" and chat_tasks:
        results = evaluate.evaluate_chat(params, cfg, tok, chat_tasks, row_sharding)
        r["chatcore"] = dict(results, data=chat_dir)
    if jax.process_index() == 0:
        section = dict(r, config=dataclasses.asdict(cfg), argv=argv,
                       samples=samples(own, cfg, tok, name))
        save_section(out, name, section)
        print(f"report card: {write_report(out)}")
    return r
