"""The run's report card, as nanochat's report.py: each stage of train.py writes its part
to <out>/<stage>/report.json, and report.md beside the checkpoints is rebuilt from all of
them: the machine, Python, JAX and devices; per stage the parameters, FLOPs per token,
steps, tokens, training time and MFU (against the accelerator's dense bf16 peak, or on a
CPU against a 1024^2 fp32 matmul measured then), bits per byte, CORE and ChatCORE (when
their data was given), our tasks and the hand-written questions, pass@k, and a few
greedy samples. docs/report_cpu.md is the card of a default run.
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

# nanochat's base_eval samples
BASE_PROMPTS = ("The capital of France is",
                "The chemical symbol of gold is",
                "If yesterday was Friday, then tomorrow will be",
                "The opposite of hot is",
                "The planets of the solar system are:",
                "My favorite color is",
                "If 5*x + 3 = 13, then x is")
CHAT_PROMPTS = ("Who are you?", "What is 17 times 23?", "Spell the word garden.",
                "How many r are in strawberry?")
# Dense bf16 FLOP/s per chip, matched in this order against jax's device_kind ("TPU v5
# lite" is v5e, "TPU v5" v5p, "TPU v6 lite" v6e).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "B200": 2250e12,
             "A100": 312e12, "L4": 121e12, "TPU v4": 275e12, "TPU v5 lite": 197e12,
             "TPU v5": 459e12, "TPU v6 lite": 918e12}


@dataclasses.dataclass(frozen=True)
class Evaluations:
    """What evaluate_stage scores a stage on beside its losses, and where it runs."""
    eval_tasks: int = 50  # conversations per synthetic task after SFT and RL (0: none)
    questions: tuple = ()  # hand-written questions (tasks.load_questions), after SFT, RL
    # (where it was read, evaluate.load_bundle's tasks or None): CORE after base
    bundle: tuple = (None, None)
    # (where they were read, tasks.load_chat_tasks' or None): ChatCORE after SFT and RL
    chat_tasks: tuple = (None, None)
    row_sharding: object = None  # a NamedSharding of each batch's rows over the devices


def samples(params, cfg, tok, stage):
    """A few greedy samples: nanochat's base prompts continued, or a chat model's
    replies."""
    if stage == "base":
        prompts = [[tok.bos] + tok.encode(text) for text in BASE_PROMPTS]
        replies = evaluate.complete(params, cfg, tok, prompts, 1, 16)
        return {text: tok.decode(r[0]) for text, r in zip(BASE_PROMPTS, replies)}
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": "?"}]
             for q in CHAT_PROMPTS]
    prompts = [data.render_for_completion(tok, chat) for chat in chats]
    replies = evaluate.complete(params, cfg, tok, prompts, 1, 64)
    return {q: tok.decode(r[0]) for q, r in zip(CHAT_PROMPTS, replies)}


@functools.cache
def peak_flops():
    """(the FLOP/s per device that MFU divides by, how it was found): a known
    accelerator's dense bf16 peak, or on a CPU the measured rate of a 1024 x 1024 fp32
    matmul."""
    kind = jax.devices()[0].device_kind
    known = (name for name in PEAK_BF16 if name.lower() in kind.lower())
    if name := next(known, None):
        return PEAK_BF16[name], f"{name} bf16 peak"
    if jax.default_backend() != "cpu":
        return None, f"unknown for {kind}"
    # a CPU: 20 matmuls timed after one that compiles
    x = jnp.ones((1024, 1024))
    matmul = jax.jit(lambda a: a @ a)
    matmul(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(20):
        matmul(x).block_until_ready()
    return 20 * 2 * 1024**3 / (time.perf_counter() - t), "measured: 1024^2 fp32 matmul"


def cpu_name():
    """The CPU's model name, from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name"))
            return next(names)
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def save_section(out, stage, section):
    """A stage's part of the report card, out/<stage>/report.json, with the machine it
    ran on."""
    peak, how = peak_flops()
    machine = dict(platform=platform.platform(),
                   cpu=cpu_name(),
                   cores=os.cpu_count(),
                   python=sys.version.split()[0],
                   jax=jax.__version__,
                   backend=jax.default_backend(),
                   devices=jax.device_count(),
                   device_kind=jax.devices()[0].device_kind,
                   peak_flops=peak,
                   peak_from=how)
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
    """A stage's section of report.md: the command, its evaluations' tables, pass@k,
    samples."""
    # 1. the command, its time and its final loss
    loss = "" if r.get("final_loss") is None else f", final loss {r['final_loss']:.4f}"
    command = " ".join(["python train.py", *r["argv"]])
    lines = [f"\n## {stage}\n",
             f"`{command}`: {_duration(60 * r['minutes'])} in all{loss}"]
    # 2. CORE and ChatCORE, a row per task
    if "core" in r:
        lines += [f"\nCORE on `{r['core']['data']}`:\n",
                  "| task | accuracy | centred |",
                  "|---|---|---|"]
        centred = r["core"]["centered_results"].values()
        lines += [f"| {task} | {accuracy:.4f} | {c:.4f} |"
                  for (task, accuracy), c in zip(r["core"]["results"].items(), centred)]
    if "chatcore" in r:
        lines += [f"\nChatCORE tasks on `{r['chatcore']['data']}`:\n",
                  "| task | accuracy |",
                  "|---|---|"]
        lines += [f"| {task} | {_pct(accuracy)} |"
                  for task, accuracy in r["chatcore"]["results"].items()]
    # 3. our tasks and the hand-written questions, a column per task or skill
    titles = {"tasks": "our tasks (template split)",
              "questions": "hand-written questions"}
    for key, title in titles.items():
        if r.get(key):
            accuracies = " | ".join(_pct(v) for v in r[key].values())
            lines += [f"\n| {title} | " + " | ".join(r[key]) + " |",
                      "|---" * (len(r[key]) + 1) + "|",
                      "| exact match | " + accuracies + " |"]
    # 4. pass@k, the recall bits per byte, the samples
    for key in [key for key in r if key.startswith("pass@k")]:
        passes = "; ".join(f"{task} " + ", ".join(f"{n} {v:.3f}" for n, v in at.items())
                           for task, at in r[key].items())
        lines.append(f"\n{key}: {passes}")
    if r.get("recall_bpb"):
        lines.append(f"\ndocstring recall bits/byte: {r['recall_bpb']:.3f}")
    lines.append("\nSamples (greedy):\n")
    return lines + [f"- `{p!r}` -> `{c!r}`" for p, c in r["samples"].items()]


def _stage_row(stage, r):
    """A stage's row of report.md's table."""
    cfg = nc.Config(**r["config"])
    peak = r["machine"]["peak_flops"]
    flops = nc.estimate_flops(cfg)  # per token
    # the model FLOPs utilization of the timed steps
    mfu = None
    if peak and r["train_time"]:
        mfu = r["tokens"] * flops / (r["train_time"] * peak * r["machine"]["devices"])
    core = r.get("core", {}).get("core_metric")
    chatcore = r.get("chatcore", {}).get("chatcore")
    params = nc.num_scaling_params(cfg)["total"]
    return (f"| {stage} | {params:,} | {flops:,.0f} | {r['steps']} | "
            f"{r['tokens']:,} | {_duration(r['train_time'])} | {_pct(mfu)} | "
            f"{_num(r['val_bpb'])} | {_num(core)} | {_num(chatcore)} |")


def write_report(out, stages=("base", "sft", "rl")):
    """report.md in out/, nanochat's report card, from the stages' report.json files."""
    # 1. the stages' sections written so far
    sections = {}
    for stage in stages:
        if os.path.isfile(path := os.path.join(out, stage, "report.json")):
            with open(path) as f:
                sections[stage] = json.load(f)
    if not sections:
        raise FileNotFoundError(f"{out}: no <stage>/report.json yet; run python "
                                "train.py first")
    # 2. the machine, from the first section
    m = next(iter(sections.values()))["machine"]
    peak = "?" if m["peak_flops"] is None else f"{m['peak_flops'] / 1e9:,.0f} GFLOP/s"
    written = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = ["# nanochat-jax report card\n",
             f"Written {written}.\n",
             "| machine | Python, JAX | devices | MFU against |",
             "|---|---|---|---|",
             f"| {m['cpu']}, {m['cores']} cores ({m['platform']}) | {m['python']}, jax "
             f"{m['jax']} ({m['backend']}) | {m['devices']} x {m['device_kind']} | "
             f"{peak} per device ({m['peak_from']}) |\n",
             "| stage | params | FLOPs/token | steps | tokens | train time | MFU | "
             "val bits/byte | CORE | ChatCORE |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    # 3. a row per stage, then a section per stage
    lines += [_stage_row(stage, r) for stage, r in sections.items()]
    for stage, r in sections.items():
        lines += _stage_lines(stage, r)
    path = os.path.join(out, "report.md")
    data.write_atomic(path, "\n".join(lines) + "\n")
    return path


def evaluate_stage(name, params, cfg, tok, losses, info, out, argv,
                   evaluations=Evaluations()):
    """A stage's results, also written into its section of the report card: its losses
    and time, CORE after base, and our tasks, the hand-written questions and ChatCORE
    after SFT and RL (evaluations says on what). argv: the command, for the card."""
    # 1. the losses and time
    r = dict(final_loss=losses[-1] if losses else None,
             minutes=info["time"] / 60,
             **{k: v for k, v in info.items() if k != "time"})
    bundle_dir, bundle = evaluations.bundle
    chat_dir, chat_tasks = evaluations.chat_tasks
    # sharded params gathered: a collective, so every process joins
    own = sharding.local(params)
    # 2. the evaluations: the scoring ones on the params as trained, generation on own
    if name == "base" and bundle:
        core = evaluate.evaluate_core(params, cfg, tok, bundle,
                                      evaluations.row_sharding)
        r["core"] = dict(core, data=bundle_dir)
    if name != "base" and evaluations.eval_tasks > 0:
        graded = evaluate.evaluate_tasks(own, cfg, tok, evaluations.eval_tasks,
                                         evaluations.questions)
        r["tasks"], r["questions"] = graded
    if name != "base" and chat_tasks:
        chat = evaluate.evaluate_chat(params, cfg, tok, chat_tasks,
                                      evaluations.row_sharding)
        r["chatcore"] = dict(chat, data=chat_dir)
    # 3. the card: process 0 writes this stage's part and rebuilds report.md
    if jax.process_index() == 0:
        section = dict(r, config=dataclasses.asdict(cfg), argv=argv,
                       samples=samples(own, cfg, tok, name))
        save_section(out, name, section)
        print(f"report card: {write_report(out)}")
    return r
