"""Tests for nanochat-jax, offline, on a CPU (CI) or on an accelerator.

    python -m pytest -q -n 2 -m "not slow" test_nanochat.py    # the quick tier, between changes
    python -m pytest -q -n 2 --dist worksteal test_nanochat.py  # everything, as CI runs it
    python -m pytest -q -m "not slow" test_nanochat.py          # on a TPU: one process holds it

The slow tests (several processes, a browser, the whole pipeline, server soaks, sweeps, and
programs compiled for one test alone) carry the `slow` marker; the `accelerator` tier (the bf16
step, the compiled splash kernel: what only a chip does) runs where the default backend is not a
CPU and is skipped elsewhere. Golden numbers in testdata/ come from the real PyTorch nanochat;
testdata/README.md says how they were made and which tolerances their fp32-vs-fp64 reruns justify.
On a chip the fp32 comparisons run at full matmul precision or on its CPU device, child processes
on the CPU, and tests that need a socket skip where none opens (The machine, below).

The sections follow the product files in import order (IMPORTS below), each test under the file
whose function it exercises; end-to-end runs through train.py sit under train.py; the
accelerator tier comes last.
"""

import ast
import collections
import contextlib
import dataclasses
import functools
import http.client
import inspect
import itertools
import json
import operator
import os
import pathlib
import pickle
import pickletools
import platform
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
import zipfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiktoken

import chat
import checkpoint
import data
import engine
import evaluate
import execution
import kernels
import kvcache
import lora
import muon
import nanochat as nc
import rl
import runtime
import scaling
import scaling_fits
import sharding
import tasks
import torch_files
import train


TESTDATA = pathlib.Path(__file__).parent / "testdata"
# Every program jit had not cached in memory is lowered once, whether XLA then compiles it or reads
# it from the persistent cache: what the no-recompile tests count.
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@pytest.fixture(scope="session", autouse=True)
def shared_compile_cache(tmp_path_factory):
    """One XLA compilation cache, fresh each session, for this process, the other pytest-xdist
    workers and every process the tests start (train.py, chat.py, sweep workers): the suite's time
    is compiles, and the same program (a tiny model's step, say) is compiled once, then read."""
    base = tmp_path_factory.getbasetemp()  # a worker's is popen-gwN under the session's folder
    path = str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "xla-cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    runtime.use_compile_cache(path)


# --------------------------------------------------------------------------------------------------
# The machine: a chip's numbers, child processes, sockets. On a CPU the fixtures change nothing:
# CI compiles and compares what it always did.

def on_chip():
    """Whether jax's default backend is an accelerator (a TPU, a GPU), not a CPU."""
    return jax.default_backend() != "cpu"


@pytest.fixture
def fp32_matmuls():
    """Matmuls at full fp32 precision, for a comparison against fp32 numbers: a chip runs fp32
    matmuls as bf16 passes by default (3 digits agree), a CPU's are fp32 already."""
    precision = jax.default_matmul_precision("highest") if on_chip() else contextlib.nullcontext()
    with precision:
        yield


@pytest.fixture
def on_cpu():
    """The CPU device, for a comparison through exp, log and tanh against fp32 numbers: a chip's
    agree to 4-5 digits, even at full matmul precision. kernels.attention_fn("auto") and
    train.model_config(dtype="auto") still see the chip's backend."""
    cpu = jax.devices("cpu")[0]
    device = jax.default_device(cpu) if on_chip() else contextlib.nullcontext()
    with device:
        yield


@pytest.fixture(autouse=True)
def accelerator_tier(request):
    """Skips the tests marked `accelerator` where the default backend is a CPU (CI's)."""
    if request.node.get_closest_marker("accelerator") and not on_chip():
        pytest.skip("the accelerator tier: no accelerator here")


# A child process that runs our Python stays off the chip (one process holds a TPU; a second one
# fails at its lockfile rather than fall back to the CPU), and without the advice jax prints as it
# is imported on a TPU host (transparent hugepages), so that its stderr is the program's own.
OFF_CHIP = {"JAX_PLATFORMS": "cpu",
            "PYTHONWARNINGS": "ignore::UserWarning:jax._src.cloud_tpu_init"}


def child_env(**changes):
    """The environment of a child process that runs our Python: ours, OFF_CHIP, these changes."""
    return {**os.environ, **OFF_CHIP, **changes}


def emulated(n):
    """The environment changes that give a child n emulated CPU devices. XLA's CPU client runs
    their programs on max(NPROC or the cores, n) threads: with only n, a program waiting on one
    device can hold the thread another's collective needs (on a 2-core machine a 4-device step
    waited 40 s for its fourth device and aborted), so NPROC leaves n to spare."""
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "NPROC": str(2 * n)}


@pytest.fixture(scope="session")
def loopback():
    """Skips a test that needs a TCP socket on 127.0.0.1 where none can be opened (a sandbox's)."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        pytest.skip(f"this machine cannot open a socket: {e}")


# --------------------------------------------------------------------------------------------------
# Shared by the sections below: the configs, random params, the golden file

TINY = nc.Config(sequence_len=64, vocab_size=100, n_layer=3, n_head=4, n_kv_head=2, n_embd=32,
                 window_pattern="SL")


def config(**changes):
    """A tiny model's config: TINY with these fields changed (the way every test makes one)."""
    return dataclasses.replace(TINY, **changes)


# testdata's golden model (testdata/README.md), the byte tokenizer's chat model and testdata's
# real nanochat checkpoint (a d2 trained by nanochat, in NANOCHAT_D2)
GOLDEN_CFG = config(sequence_len=512, vocab_size=300, n_layer=4, n_head=2, n_kv_head=1, n_embd=64)
CHAT_CFG = config(sequence_len=256, vocab_size=265, n_layer=2, n_head=2, n_kv_head=1,
                  window_pattern="L")
NANOCHAT_D2_CFG = config(sequence_len=128, vocab_size=512, n_layer=2, n_head=2, n_kv_head=1,
                         n_embd=64, window_pattern="L")
NANOCHAT_D2 = TESTDATA / "nanochat_checkpoint" / "base_checkpoints" / "d2"
# the tiny training run, as train.py's flags and as values
TRAIN_ARGS = ["--depth", "2", "--aspect-ratio", "32", "--head-dim", "16", "--max-seq-len", "32",
              "--device-batch-size", "4", "--total-batch-size", "256", "--vocab-size", "300",
              "--warmup-steps", "2", "--eval-every", "0", "--sample-every", "0",
              "--compile-cache", ""]
TINY_MODEL = dict(depth=2, aspect_ratio=32, head_dim=16, max_seq_len=32)  # TRAIN_ARGS's, as values
TINY_OPTIM = dict(total_batch_size=256, warmup_steps=2)
# the model's entry points, jitted once for every test
forward = jax.jit(nc.forward, static_argnames="cfg")
loss_fn = jax.jit(nc.loss_fn, static_argnames=("cfg", "reduction", "chunk"))
value_and_grad = jax.jit(jax.value_and_grad(nc.loss_fn), static_argnames="cfg")


def random_params(cfg, seed):
    """Random params with every path alive, drawn in numpy (no init compile): matrices N(0,
    1/fan_in). How the tests get params; nc.init_params only where nanochat's init matters."""
    rng = np.random.default_rng(seed)

    def draw(leaf):  # a jax.ShapeDtypeStruct
        scale = leaf.shape[-2] ** -0.5 if len(leaf.shape) > 1 else 0.3
        return rng.normal(0, scale, leaf.shape).astype(np.float32)

    params = jax.tree.map(draw, nc.param_shapes(cfg))
    params["resid_lambdas"] += 1.0
    return jax.tree.map(jnp.asarray, params)


@pytest.fixture(scope="session")
def golden():
    return np.load(TESTDATA / "nanochat_golden.npz")


def golden_tree(golden, prefix):
    """A golden state_dict (params, grads, ...) under `prefix/` converted to our params layout."""
    n = len(prefix) + 1
    sd = {k[n:]: golden[k] for k in golden.files if k.startswith(prefix + "/")}
    return checkpoint.from_nanochat_state_dict(sd, GOLDEN_CFG)


def assert_matches_golden(params, golden, prefix, atol):
    sd = checkpoint.to_nanochat_state_dict(params, GOLDEN_CFG)
    keys = [k for k in sd if f"{prefix}/{k}" in golden.files]
    assert keys
    for k in keys:
        np.testing.assert_allclose(sd[k], golden[f"{prefix}/{k}"], rtol=0, atol=atol, err_msg=k)


# --------------------------------------------------------------------------------------------------
# The product files: their imports form a DAG, in the order of the sections below

# each module of ours: the modules of ours it imports, in the order of the sections below
IMPORTS = {
    "nanochat": set(),
    "kernels": {"nanochat"},
    "runtime": set(),
    "muon": set(),
    "lora": set(),
    "data": set(),
    "execution": set(),
    "tasks": {"data", "execution"},
    "torch_files": set(),
    "checkpoint": {"data", "lora", "nanochat", "torch_files"},
    "kvcache": {"kernels", "nanochat"},
    "engine": {"kvcache", "nanochat", "runtime"},
    "sharding": set(),
    "evaluate": {"checkpoint", "data", "engine", "kernels", "nanochat", "sharding", "tasks"},
    "report": {"data", "evaluate", "nanochat", "sharding"},
    "rl": {"checkpoint", "data", "engine", "evaluate", "sharding", "tasks"},
    "train": {"checkpoint", "data", "evaluate", "kernels", "lora", "muon", "nanochat", "report",
              "rl", "runtime", "sharding", "tasks"},
    "chat": {"checkpoint", "data", "engine", "kernels", "runtime"},
    "scaling_fits": set(),
    "scaling": {"checkpoint", "data", "evaluate", "kernels", "muon", "nanochat", "runtime",
                "scaling_fits", "sharding", "train"},
    "bench_serving": {"checkpoint", "data", "engine", "kernels", "kvcache", "nanochat", "report",
                      "tasks", "train"},
    "bench": {"bench_serving", "data", "engine", "kernels", "lora", "muon", "nanochat", "report",
              "runtime", "sharding", "train"},
}


def test_imports_form_a_dag_without_private_names():
    """Every module's imports of ours are the ones above (a DAG: the model and optimizer at the
    bottom, data.py without jax, tasks and checkpoints on the model and data, the programs above
    them, the tools on top), and no module uses another's private (_name) functions."""
    root = pathlib.Path(__file__).parent
    assert {p.stem for p in root.glob("*.py")} - {"test_nanochat", "conftest"} == set(IMPORTS)
    for name, want in IMPORTS.items():
        tree = ast.parse((root / f"{name}.py").read_text())
        aliases = {}  # the local name -> the module of ours it is
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names
                                if a.name in IMPORTS})
            from_ours = isinstance(node, ast.ImportFrom) and node.module in IMPORTS
            assert not from_ours, (name, node.module)
        assert set(aliases.values()) == want, name
        private = [f"{aliases[n.value.id]}.{n.attr}" for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                   and n.value.id in aliases and n.attr.startswith("_")]
        assert not private, (name, private)
    data_tree = ast.parse((root / "data.py").read_text())
    data_imports = [a.name for n in ast.walk(data_tree) if isinstance(n, ast.Import)
                    for a in n.names]
    assert data_imports and not [m for m in data_imports if m.split(".")[0] in ("jax", "jaxlib")]
    done = set()  # a topological order exists: no cycle
    while len(done) < len(IMPORTS):
        ready = {m for m, deps in IMPORTS.items() if m not in done and deps <= done}
        assert ready, f"a cycle among {set(IMPORTS) - done}"
        done |= ready


# --------------------------------------------------------------------------------------------------
# nanochat.py: the model against PyTorch nanochat's golden numbers, then its invariants

@pytest.mark.usefixtures("on_cpu")
def test_golden_logits_and_loss(golden):
    params = golden_tree(golden, "param")
    logits = forward(params, golden["tokens"], GOLDEN_CFG)
    assert logits.shape == (2, 512, 300) and logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, golden["logits"], rtol=0, atol=2e-5)
    loss = loss_fn(params, golden["tokens"], golden["targets"], GOLDEN_CFG)
    np.testing.assert_allclose(loss, golden["loss"], rtol=0, atol=1e-5)
    per_token = loss_fn(params, golden["tokens"], golden["targets"], GOLDEN_CFG, reduction="none")
    np.testing.assert_allclose(per_token, golden["loss_per_token"], rtol=0, atol=1e-5)
    assert np.all(np.asarray(per_token)[golden["targets"] < 0] == 0)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("batch", ["", "2"])
def test_golden_gradients(golden, batch):
    # grad2 was taken at nanochat's after1
    params = golden_tree(golden, "after1" if batch else "param")
    loss, grads = value_and_grad(params, golden["tokens" + batch], golden["targets" + batch],
                                 GOLDEN_CFG)
    np.testing.assert_allclose(loss, golden["loss" + batch], rtol=0, atol=1e-5)
    sd = checkpoint.to_nanochat_state_dict(grads, GOLDEN_CFG)
    for k, g in sd.items():
        ref = golden[f"grad{batch}/{k}"]
        assert np.abs(g - ref).max() <= 2e-4 * np.abs(ref).max(), k
    # padded vocab rows get exactly zero gradient
    for k in ("transformer.wte.weight", "lm_head.weight", "value_embeds.1.weight"):
        assert not sd[k][300:].any()


def test_golden_structure(golden):
    assert nc.window_sizes(GOLDEN_CFG) == [int(w) for w in golden["window_sizes"][:, 0]]
    assert not golden["window_sizes"][:, 1].any()
    groups = nc.num_scaling_params(GOLDEN_CFG)
    assert groups == {k: int(golden[f"num_scaling_params/{k}"]) for k in groups}
    assert nc.estimate_flops(GOLDEN_CFG) == float(golden["estimate_flops"])
    assert GOLDEN_CFG.padded_vocab == 320 and GOLDEN_CFG.ve_layers == [1, 3]


@pytest.mark.slow  # the golden model compiled once more, in bfloat16
def test_bf16_close_to_fp32(golden):
    params = golden_tree(golden, "param")
    bf16 = dataclasses.replace(GOLDEN_CFG, compute_dtype="bfloat16")
    logits = forward(params, golden["tokens"], bf16)
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
    # logits reach 1.85; fp32 is off by 1e-6
    assert 1e-3 < float(jnp.abs(logits - golden["logits"]).max()) < 0.1
    # the matmuls really ran in bf16 (traced, not run: the dtype is the program's, not the numbers')
    traced = jax.eval_shape(lambda p, t: nc.hidden(p, t, bf16), params, golden["tokens"])
    assert traced.dtype == jnp.bfloat16
    x = jax.random.normal(jax.random.key(0), (4, 64)).astype(jnp.bfloat16) * 100
    x64 = np.asarray(x, np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True))
    # fp32 statistics
    np.testing.assert_allclose(np.asarray(nc.rms_norm(x), np.float64), ref, rtol=2**-8)
    loss, grads = value_and_grad(params, golden["tokens"], golden["targets"], bf16)
    assert abs(float(loss) - float(golden["loss"])) < 0.01
    chex.assert_tree_all_finite(grads)
    # fp32 masters get fp32 grads
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("depth, width, heads, groups, flops", [
    # nanochat's own numbers at vocab 32768, head_dim 128, T 2048, "SSSL" (nanochat_spec.md section
    # 1.7)
    (12, 768, 6, dict(wte=25.17, value_embeds=150.99, lm_head=25.17, transformer_matrices=84.94,
                      total=286.26),
     7.597e8),
    (20, 1280, 10, dict(wte=41.94, value_embeds=419.43, lm_head=41.94, transformer_matrices=393.22,
                        total=896.53),
     2.886e9),
    (26, 1664, 13, dict(wte=54.53, value_embeds=708.84, lm_head=54.53, transformer_matrices=863.90,
                        total=1681.79),
     5.991e9),
])
def test_depth_dial_matches_nanochat(depth, width, heads, groups, flops):
    cfg = nc.config_for_depth(depth, vocab_size=32768)
    assert (cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (width, heads, heads, 128)
    counts = nc.num_scaling_params(cfg)
    for k, millions in groups.items():
        assert round(counts[k] / 1e6, 2) == millions, k
    assert counts["scalars"] == 2 * depth + 26
    assert float(f"{nc.estimate_flops(cfg):.3e}") == flops


def test_presets():
    d6 = nc.config_for_depth(6, vocab_size=8192, head_dim=64, sequence_len=512, window_pattern="L")
    assert (d6.n_embd, d6.n_head) == (384, 6)  # runs/runcpu.sh's model
    default = train.model_config(384)  # train.py's default model: d3, 96 wide, 3 heads
    shape = (default.n_layer, default.n_embd, default.n_head, default.sequence_len)
    assert shape == (3, 96, 3, 256)
    assert nc.num_scaling_params(default)["total"] == 479_336
    # nc.Config's own default window pattern, SSSL; lower case works too
    assert nc.window_sizes(nc.Config(sequence_len=2048, n_layer=8)) == [512, 512, 512, 2048] * 2
    sl = nc.Config(sequence_len=1024, n_layer=3, window_pattern="sl")
    assert nc.window_sizes(sl) == [256, 1024, 1024]


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_embd=100, n_head=3), "heads"),
    (dict(n_head=6, n_kv_head=4), "multiple"),
    (dict(window_pattern="SXL"), "S and L"),
    (dict(n_embd=16, n_head=2, n_kv_head=2), "at least"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        nc.Config(**kwargs)


# --------------------------------------------------------------------------------------------------
# Model invariants

def test_init_follows_nanochat():
    p, C = nc.init_params(TINY, jax.random.key(0)), TINY.n_embd
    s = 3**0.5 / C**0.5
    assert abs(float(p["wte"].std()) - 0.8) < 0.03 and abs(float(p["wte"].mean())) < 0.05
    assert abs(float(p["lm_head"].std()) - 0.001) < 1e-4

    # U(lo, hi): inside the bounds and reaching near both (a wrong scale fails)
    def uniform(w, lo, hi):
        margin = 0.25 * (hi - lo)
        return lo <= float(w.min()) < lo + margin and hi - margin < float(w.max()) <= hi

    for w in (p["h"]["attn"]["c_q"], p["h"]["attn"]["c_k"], p["h"]["attn"]["c_v"],
              p["value_embeds"]):
        assert uniform(w, -s, s)
    assert uniform(p["h"]["mlp"]["c_fc"], -0.4 * s, 0.4 * s)
    assert uniform(p["h"]["attn"]["ve_gate"], 0, 0.02) and uniform(p["smear_gate"], 0, 0.02)
    assert not p["h"]["attn"]["c_proj"].any() and not p["h"]["mlp"]["c_proj"].any()
    np.testing.assert_allclose(p["resid_lambdas"], [1.15, 1.10, 1.05], atol=1e-6)
    np.testing.assert_allclose(p["x0_lambdas"], [0.20, 0.125, 0.05], atol=1e-6)
    assert float(p["smear_lambda"][0]) == 0 and float(p["backout_lambda"][0]) == pytest.approx(0.2)
    again = nc.init_params(TINY, jax.random.key(0))
    other = nc.init_params(TINY, jax.random.key(1))
    fast = kernels.init_params(TINY, jax.random.key(0))  # compiled at LLVM -O1
    # it composes: e.g. out_shardings
    nested = jax.jit(nc.init_params, static_argnames="cfg")(TINY, jax.random.key(0))
    for same in (again, fast, nested):
        assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, p, same)))
    assert not jnp.array_equal(p["wte"], other["wte"])


def test_causality():
    params = random_params(TINY, 1)
    tokens = jax.random.randint(jax.random.key(2), (2, 48), 0, TINY.vocab_size)
    changed = tokens.at[:, 30:].set((tokens[:, 30:] + 7) % TINY.vocab_size)
    a, b = forward(params, tokens, TINY), forward(params, changed, TINY)
    np.testing.assert_array_equal(a[:, :30], b[:, :30])
    assert float(jnp.abs(a[:, 30:] - b[:, 30:]).max()) > 1e-3


def test_sliding_window_limits_context():
    cfg = config(sequence_len=512, n_layer=1, n_head=2, window_pattern="S")
    assert nc.window_sizes(cfg) == [512]  # a single layer is the last layer: always full context
    mask = nc.attention_mask(jnp.arange(300), jnp.arange(300), 128)
    assert int(mask.sum(1)[-1]) == 129 and int(mask.sum(1)[5]) == 6 and not mask[10, 11]
    decode = nc.attention_mask(jnp.array([200]), jnp.arange(256), 128)  # one query against a cache
    assert np.flatnonzero(decode[0]).tolist() == list(range(72, 201))


def test_rotary_swap_is_exact():
    """apply_rotary's half swap by a permutation matmul against the halves' rotation: bit for
    bit, in fp32 and bf16 (on a chip too, at its default matmul precision: the swap's matmul
    asks for full precision)."""
    x = jax.random.normal(jax.random.key(5), (2, 3, 16, 8))
    rope = nc.rotary(jnp.arange(16), 8)  # (16, 4) each

    def by_halves(x, rope):
        cos, sin = (table.astype(x.dtype) for table in rope)
        x1, x2 = x[..., :4], x[..., 4:]
        return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)
    for dtype in (jnp.float32, jnp.bfloat16):
        rotated = jax.jit(nc.apply_rotary)(x.astype(dtype), rope)
        np.testing.assert_array_equal(rotated, jax.jit(by_halves)(x.astype(dtype), rope))


def test_bf16_logits_come_from_a_bf16_matmul(fp32_matmuls):
    """Under bf16 compute lm_head's matmul takes bf16 operands and gives bf16 logits, as
    nanochat's autocast does, cast to fp32 for the softcap; XLA may fold that cast into the
    matmul (its fp32 sums then come out unrounded: a small jit on a CPU or a TPU does, the
    training step on a TPU does not). Each logit is one of the two, where fp32 compute's are
    neither (fp32 matmuls at full precision, not a TPU's default bf16 passes). The tolerance:
    a TPU's fp32 tanh (8e-5 off), sums' order."""
    keys = jax.random.split(jax.random.key(17), 2)
    x = jax.random.normal(keys[0], (64, 64))
    head = {"lm_head": 0.1 * jax.random.normal(keys[1], (64, 512))}
    w = head["lm_head"][:, :500].astype(jnp.bfloat16)
    sums = jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
    capped = [nc.SOFTCAP * np.tanh(np.asarray(a, np.float64) / nc.SOFTCAP)
              for a in (sums, sums.astype(jnp.bfloat16))]  # unrounded, rounded to bf16

    def either(logits):  # (64, 500) bool: the logit is one of the two
        return np.logical_or(*(np.isclose(logits, c, rtol=2e-4, atol=1e-6) for c in capped))
    for dtype, by_jit in (("bfloat16", True), ("bfloat16", False), ("float32", True)):
        cfg = nc.Config(vocab_size=500, n_embd=64, n_head=1, n_kv_head=1, compute_dtype=dtype)
        fn = jax.jit(nc.logits_from_hidden, static_argnums=2) if by_jit else nc.logits_from_hidden
        logits = fn(head, x.astype(dtype), cfg)
        assert logits.shape == (64, 500) and logits.dtype == jnp.float32
        if dtype == "bfloat16":
            assert either(logits).all(), by_jit
        else:
            assert either(logits).mean() < 0.3


def test_chunked_loss_equals_the_whole(fp32_matmuls):
    """The loss over chunks of rows (the logits computed again in the backward pass) against the
    loss over every row at once: the same mean, per-token losses and gradients to fp32 rounding,
    with a chunk that leaves a padded last chunk, ignored targets and RL's token weights."""
    cfg = config(vocab_size=300)
    params = random_params(cfg, 40)
    tokens = jax.random.randint(jax.random.key(41), (3, 64), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1).at[:, -5:].set(-1)  # (192 rows: chunks of 50 pad 8)
    weights = jax.random.normal(jax.random.key(42), targets.shape)

    def weighted(params, chunk):
        nll = nc.loss_fn(params, tokens, targets, cfg, "none", chunk=chunk)
        return jnp.sum(nll * weights), nll
    grad = jax.jit(jax.grad(weighted, has_aux=True), static_argnums=1)
    whole_grads, whole = grad(params, 1000)
    chunked_grads, chunked = grad(params, 50)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-6)
    assert not chunked[:, -5:].any()  # ignored targets count 0
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(whole_grads)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.abs(b).max()))
    mean = loss_fn(params, tokens, targets, cfg, chunk=50)
    assert float(mean) == pytest.approx(float(whole.sum() / (targets >= 0).sum()), rel=1e-6)
    # the default chunk holds LOGITS_PER_CHUNK logits: one chunk for every CPU model here
    assert nc.LOGITS_PER_CHUNK // cfg.vocab_size > targets.size


def test_the_training_loss_takes_its_gradients_with_the_logits(fp32_matmuls):
    """nll_sum, the bf16 training loss (each chunk's gradients computed from its logits as they
    are made, none computed again), has the value and gradients of plain autodiff through every
    logit at once, in fp32 with a padded last chunk and ignored targets; the cotangent scales
    them. In fp32 loss_fn keeps autodiff's path, so a CPU run's rounding stays as it was."""
    cfg = config(vocab_size=300)
    params = random_params(cfg, 45)
    tokens = jax.random.randint(jax.random.key(46), (3, 64), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1).at[0, :20].set(-1).reshape(-1)

    def plain(params):  # token_nll over all 192 rows at once
        x = nc.hidden(params, tokens, cfg).reshape(-1, cfg.n_embd)
        return nc.token_nll(params, x, targets, cfg).sum()
    want, want_grads = jax.jit(jax.value_and_grad(plain))(params)
    for chunk in (50, None):  # 4 chunks, the last padded; one chunk
        def fused(params):
            x = nc.hidden(params, tokens, cfg).reshape(-1, cfg.n_embd)
            return 3 * nc.nll_sum(params["lm_head"], x, targets, cfg, chunk)
        loss, grads = jax.jit(jax.value_and_grad(fused))(params)
        assert float(loss) == pytest.approx(3 * float(want), rel=1e-6)
        # a chip's fp32 exp and tanh round otherwise: a layer scalar's gradient, summed over
        # every token, then agrees to 2e-5 (measured on a v5e), a CPU's to 1e-5
        rtol = 1e-4 if on_chip() else 1e-5
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(a, 3 * b, rtol=rtol, atol=rtol * float(jnp.abs(b).max()))
        assert not grads["lm_head"][:, cfg.vocab_size:].any()  # the padded columns: none


def test_scanned_layers_equal_the_loop(fp32_matmuls, monkeypatch):
    """Under remat, layers that repeat in groups (SSSL's windows, value embeddings every other
    layer) run as a scan over the groups, the backout taken from the middle layer inside its
    group: the same loss and gradients as the layers one by one (without remat, and with it),
    at 8 layers (two groups, the backout in the second)."""
    cfg = config(n_layer=8, window_pattern="SSSL", sequence_len=256)
    assert nc.layer_period(cfg) == 4 and nc.layer_period(TINY) == 0  # TINY: 3 layers of SL
    assert nc.layer_period(config(n_layer=6, window_pattern="SSSL")) == 0  # 6 % 4
    params = random_params(cfg, 43)
    tokens = jax.random.randint(jax.random.key(44), (2, 256), 0, cfg.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    def loss_and_grads(remat):  # a fresh jit: it traces layer_period as it is now
        grad = jax.jit(jax.value_and_grad(nc.loss_fn), static_argnames=("cfg", "remat"))
        return grad(params, tokens, targets, cfg=cfg, remat=remat)
    scanned = loss_and_grads(remat=True)
    looped = loss_and_grads(remat=False)
    monkeypatch.setattr(nc, "layer_period", lambda cfg: 0)  # remat over the layers one by one
    for loss, grads in (scanned, loss_and_grads(remat=True)):
        assert float(loss) == pytest.approx(float(looped[0]), rel=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(looped[1])):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * float(jnp.abs(b).max()))


def test_bf16_stores_the_embeddings_in_bf16():
    """Under bf16 compute wte and the value embeddings are stored in bf16, as nanochat stores
    them (their values the fp32 init's, rounded), and their AdamW moments follow; the matrices
    and lm_head stay fp32 master weights. fp32 compute stores everything in fp32."""
    bf16 = config(compute_dtype="bfloat16")
    p16, p32 = (nc.init_params(cfg, jax.random.key(0)) for cfg in (bf16, TINY))
    dtypes = {name: str(p16[name].dtype) for name in ("wte", "value_embeds", "lm_head")}
    assert dtypes == {"wte": "bfloat16", "value_embeds": "bfloat16", "lm_head": "float32"}
    assert all(w.dtype == jnp.float32 for w in jax.tree.leaves(p16["h"]))
    assert all(w.dtype == jnp.float32 for w in jax.tree.leaves(p32))
    np.testing.assert_array_equal(p16["wte"], p32["wte"].astype(jnp.bfloat16))
    state = muon.init(p16, *nc.param_groups(p16))
    assert state["mom"]["wte"].dtype == state["var"]["value_embeds"].dtype == jnp.bfloat16
    assert state["var"]["lm_head"].dtype == jnp.float32


# --------------------------------------------------------------------------------------------------
# kernels.py: each attention route against the plain attend, the route each backend takes,
# the process settings

@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("T, window, dtype", [(300, 300, "float32"), (300, 100, "float32"),
                                              (256, 64, "bfloat16"),
                                             # 64-query blocks
                                             (100, 100, "float32"), (128, 40, "float32")])
def test_fast_attention_equals_plain(T, window, dtype):
    """kernels.attend_cpu (no max pass) and its query blocks (fully masked key blocks skipped)
    against the plain attend, and the model's plain causal_attention too; on the CPU device, the
    CPU route's own (a chip's exp, 4-5 digits, misses the fp32 tolerance)."""
    keys = jax.random.split(jax.random.key(12), 3)
    q, k = (nc.rms_norm(jax.random.normal(key, (2, T, h, 16))) * nc.QK_SCALE
            for key, h in zip(keys, (4, 2)))
    q, k, v = (a.astype(dtype) for a in (q, k, jax.random.normal(keys[2], (2, T, 2, 16))))

    @jax.jit  # one program (op by op, each shape's hundred ops compiled one at a time: 3x slower)
    def outputs(q, k, v):
        pos = jnp.arange(T)
        fast = (kernels.attend_cpu(q, k, v, nc.attention_mask(pos, pos, window)),
                kernels.blocked_attention(q, k, v, window),
                kernels.attention_fn("cpu")(q, k, v, window),
                nc.causal_attention(q, k, v, window))
        full = nc.attend(q, k, v, nc.attention_mask(pos, pos, T))
        return nc.attend(q, k, v, nc.attention_mask(pos, pos, window)), fast, full

    plain, fast_outputs, full = outputs(q, k, v)
    plain = plain.astype(jnp.float32)
    for fast in fast_outputs:
        assert fast.dtype == q.dtype
        np.testing.assert_allclose(fast.astype(jnp.float32), plain, rtol=0,
                                   atol=1e-5 if dtype == "float32" else 2e-2)
    if window < T:  # the window binds: full causal attention differs
        assert np.abs(plain - full.astype(jnp.float32)).max() > 0.1


def attention_in_bthd(route, window):
    """kernels.attention_fn(route) over a whole sequence, taking and giving (B, T, H, D) whatever
    layout the route takes (attn.heads_first)."""
    attn = kernels.attention_fn(route)
    if not attn.heads_first:
        return lambda q, k, v: attn(q, k, v, window)
    swap = lambda a: a.swapaxes(1, 2)
    return lambda q, k, v: swap(attn(swap(q), swap(k), swap(v), window))


# op by op: some 190 compiles a route
@functools.partial(jax.jit, static_argnames=("route", "window"))
def attention_loss_and_grads(q, k, v, w, route, window):
    """sum(attention * w) and its gradients in q, k, v, through a route of kernels.ROUTES (None: the
    plain attend)."""
    pos = jnp.arange(q.shape[1])
    if route is None:
        attn = lambda q, k, v: nc.attend(q, k, v, nc.attention_mask(pos, pos, window))
    else:
        attn = attention_in_bthd(route, window)
    return jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v) * w), (0, 1, 2))(q, k, v)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("route", ["cpu", "xla", "plain", "splash"])
def test_every_attention_route_equals_plain(route):
    """Each kernel kernels.attention_fn gives (the library's XLA path and TPU's splash kernel,
    interpreted, included) has the plain attend's outputs and gradients, with a binding window and
    GQA (4 query heads on 2 kv heads), in fp32 on the CPU device."""
    if route == "splash" and jax.default_backend() == "tpu":
        pytest.skip("on a TPU the kernel compiles for the chip: test_splash_attention_on_the_chip")
    keys = jax.random.split(jax.random.key(13), 4)
    q, k, v = (jax.random.normal(key, (2, 256, h, 128)) for key, h in zip(keys, (4, 2, 2)))
    w = jax.random.normal(keys[3], (2, 256, 4, 128))
    for window in (100, 256):
        # compiled once for the four routes
        want = attention_loss_and_grads(q, k, v, w, None, window)
        got = attention_loss_and_grads(q, k, v, w, route, window)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for g, h in zip(got[1], want[1]):
            np.testing.assert_allclose(g, h, rtol=0, atol=1e-4 * float(jnp.abs(h).max()))


@pytest.mark.usefixtures("on_cpu")
def test_the_model_heads_first_equals_its_plain_layout():
    """Where attn takes heads first (splash's route: the model projects q, k, v straight into
    (B, H, T, D) and c_proj reads y so), the loss and every gradient equal those of the model in
    (B, T, H, D) through the plain attention: fp32, a windowed and a causal layer, value
    embeddings, two kv heads. The splash kernel is interpreted here."""
    if jax.default_backend() == "tpu":
        pytest.skip("on a TPU the kernel compiles for the chip: the accelerator tier's steps")
    assert kernels.attention_fn("splash").heads_first
    assert not kernels.attention_fn("plain").heads_first
    cfg = nc.Config(sequence_len=256, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2,
                    n_embd=256, window_pattern="SL")
    assert nc.window_sizes(cfg) == [128, 256] and cfg.ve_layers == [1]
    keys = jax.random.split(jax.random.key(16), 3)
    # every matrix random (the init zeroes c_proj): each path carries gradient
    params = jax.tree.map(lambda p: 0.05 * jax.random.normal(keys[0], p.shape) if p.ndim > 1 else p,
                          nc.init_params(cfg, keys[1]))
    x, y = jax.random.randint(keys[2], (2, 1, 256), 0, 512)
    results = {}
    for route in ("plain", "splash"):
        loss = functools.partial(nc.loss_fn, cfg=cfg, attn=kernels.attention_fn(route))
        results[route] = jax.jit(jax.value_and_grad(loss))(params, x, y)
    (want, want_grads), (got, got_grads) = results["plain"], results["splash"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # to 1e-5 of each leaf's largest, and 1e-7 absolute: a scalar whose gradient sums to ~1e-8
    for g, h in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, h, rtol=0, atol=1e-5 * float(jnp.abs(h).max()) + 1e-7)


def test_write_rows_is_dynamic_update_slice_a_row():
    """The KV cache's write, one scatter of whole vectors, equals a dynamic_update_slice
    into each row, moved back as it moves a write that would run past the end (where the
    scatter's table would run into the next head). A decode chunk's own k, v, written a
    step at a time (write_step: a slab a step as on a TPU, or a row's steps in its row)
    and read as rows (by_rows), equal write_kv's at each step's place in every row, an
    int8 cache's values and scales too."""
    cache = jax.random.normal(jax.random.key(0), (3, 2, 16, 4))
    pos = jnp.array([0, 7, 15])

    def one_row(row, new_row, at):
        return jax.lax.dynamic_update_slice(row, new_row.swapaxes(0, 1), (0, at, 0))
    for T in (1, 5):
        new = jax.random.normal(jax.random.key(T), (3, T, 2, 4))
        want = jax.vmap(one_row)(cache, new, pos)
        np.testing.assert_array_equal(nc.write_rows(cache, new, pos), want)
    for int8, steps_first in itertools.product((False, True), (False, True)):
        rows = jnp.zeros((3, 2, 4, 4))  # (B, K, kmax, D)
        own = kvcache.chunk_buffers([(jnp.zeros((5, 2, 9, 4)),)], 3, 4, steps_first)[0][0]
        if int8:
            rows, own = (nc.quantize(a) for a in (rows, own))
        for step in (2, 0, 3):
            new = jax.random.normal(jax.random.key(step), (3, 1, 2, 4))
            rows = nc.write_kv(rows, new, jnp.full(3, step))
            own = nc.write_step(own, new, step, steps_first)
        for got, want in zip(jax.tree.leaves(nc.by_rows(own, steps_first)),
                             jax.tree.leaves(rows)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.usefixtures("fp32_matmuls")
def test_cached_attention_of_every_route_equals_plain():
    """A query chunk over a KV cache (prefill, decode: pos given, one per row; the cache heads
    first) takes attend_cache: the plain numbers, each row at its own position; a cache in
    parts (a decode chunk's: the cache, then the chunk's own tokens) as the parts joined."""
    keys = jax.random.split(jax.random.key(14), 3)
    q = jax.random.normal(keys[0], (2, 5, 4, 32))  # (B, T, H, D)
    k, v = (jax.random.normal(key, (2, 2, 40, 32)) for key in keys[1:])  # (B, K, S, D)
    pos = jnp.array([20, 7], jnp.int32)
    for window in (8, 64):
        want = nc.causal_attention(q, k, v, window, pos)
        for route in kernels.ROUTES:
            np.testing.assert_allclose(kernels.attention_fn(route)(q, k, v, window, pos), want,
                                       atol=1e-5)
        # each row as if alone: per-row positions are no approximation
        for row in range(2):
            alone = nc.causal_attention(q[row:row + 1], k[row:row + 1], v[row:row + 1], window,
                                        pos[row])
            np.testing.assert_allclose(want[row:row + 1], alone, atol=1e-6)
        # the last 8 slots as a part of their own, at positions of each row's
        held = jnp.where(jnp.arange(32) < 20, jnp.arange(32), -1)  # slots 20..31 empty
        at = jnp.array([[20], [4]]) + jnp.arange(8)
        k_pos = [held, at]
        joined = nc.causal_attention(q, k, v, window, pos, jnp.concatenate(
            [jnp.broadcast_to(held, (2, 32)), at], axis=1))
        for route in kernels.ROUTES:
            parts = kernels.attention_fn(route)(q, [k[:, :, :32], k[:, :, 32:]],
                                                [v[:, :, :32], v[:, :, 32:]], window, pos, k_pos)
            np.testing.assert_allclose(parts, joined, atol=1e-5)


def test_model_names_no_backend():
    """nanochat.py is the math: no backend, kernel or mesh name; kernels.py chooses them, outside
    the model."""
    source = (pathlib.Path(__file__).parent / "nanochat.py").read_text().lower()
    for name in ("cpu", "gpu", "tpu", "cudnn", "splash", "pallas", "mesh", "shard_map",
                 "default_backend"):
        assert not re.search(rf"\b{name}\b", source), name
    params = random_params(TINY, 5)
    tokens = jax.random.randint(jax.random.key(6), (2, 64), 0, TINY.vocab_size)
    forward_with = jax.jit(nc.forward, static_argnames=("cfg", "attn"))
    fast = forward_with(params, tokens, TINY, kernels.attention_fn())
    # the same model
    np.testing.assert_allclose(fast, forward(params, tokens, TINY), rtol=0, atol=2e-5)


def test_attention_route_is_picked_by_backend_and_shape():
    def route(impl, backend, dtype, T=2048, D=128):
        return kernels.resolve_route(impl, backend, jnp.dtype(dtype), T, D)

    assert route("auto", "gpu", "bfloat16") == "cudnn"
    assert route("auto", "gpu", "float32") == "plain"
    assert route("auto", "tpu", "bfloat16") == "splash"
    assert route("auto", "tpu", "bfloat16", T=100) == "plain"
    assert route("auto", "tpu", "bfloat16", D=64) == "plain"
    assert route("auto", "cpu", "float32") == "cpu"
    assert route("xla", "gpu", "bfloat16") == "xla"  # forced
    with pytest.raises(ValueError, match="attention route 'flash' must be one of"):
        kernels.attention_fn("flash")
    # one function a route: jit compiles it once
    assert kernels.attention_fn() is kernels.attention_fn("auto")


def run_alone(call):
    """test_nanochat.`call` (a string) in a Python of its own without the suite's compile cache,
    off a TPU: after Pallas's interpreter ran in a worker, a later compile there segfaulted (jax
    0.10.2, three runs of the suite). On a TPU (one process holds the chip) here."""
    if jax.default_backend() == "tpu":
        return eval(call)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    code = f"import test_nanochat as t; t.{call}"
    done = subprocess.run([sys.executable, "-c", code], cwd=pathlib.Path(__file__).parent,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_written_windows_equal_the_scatter_of_vectors(dtype):
    """kernels.write_tokens through write_windows (the TPU's Pallas kernel, interpreted off a TPU)
    writes what one scatter of vectors writes, bit for bit: into rows, rings across their end and
    pages across a page, rows writing 0..16 tokens, starts on and off tile rows and at the ends.
    An int8 cache's scales into rows and rings (place_scales) likewise."""
    run_alone(f"check_written_windows({dtype!r})")


def check_written_windows(dtype):
    rng = np.random.default_rng(0)
    rows, K, n, D = 8, 2, 16, 128
    start = np.array([0, 5, 8, 27, 40, 44, 47, 33])  # ring: 44 and 47 wrap; pages: 27 crosses
    count = np.array([16, 3, 0, 16, 8, 16, 2, 1])  # the valid prefix of each row's tokens
    at = start[:, None] + np.arange(n)
    valid = jnp.asarray(np.arange(n) < count[:, None])
    def values(*shape):  # an int8 cache's values span the int8 range
        if dtype == "int8":
            return jnp.asarray(rng.integers(-127, 128, shape), dtype)
        return jnp.asarray(rng.standard_normal(shape), dtype)
    new = values(rows, K, n, D)
    own = np.broadcast_to(np.arange(rows)[:, None], at.shape)
    table = rng.permutation(np.arange(1, 2 * rows + 1)).reshape(rows, 2)  # 2 pages of 32 a row
    cases = {"rows": (64, own, at, False),
             "ring": (48, own, at % 48, True),
             "pages": (32, np.take_along_axis(table, np.minimum(at // 32, 1), 1), at % 32, False)}
    for layout, (L, major, slot, wraps) in cases.items():
        N = 2 * rows + 1 if layout == "pages" else rows
        whole = values(N, K, L, D)
        args = (new, jnp.asarray(major), jnp.asarray(slot), valid)
        want = kernels.write_tokens(whole, *args, wraps=wraps, windows=False)
        got = kernels.write_tokens(whole, *args, wraps=wraps, windows=True)
        assert (np.asarray(got) == np.asarray(want)).all(), layout
        assert not (np.asarray(want) == np.asarray(whole)).all()
        if layout != "pages":  # the scales, a value a token and head; a row past the chunk kept
            scales = jnp.asarray(rng.standard_normal((N + 1, K, L)), "float32" if dtype ==
                                 "float32" else "bfloat16")
            parts = (new[..., 0].astype(scales.dtype), *args[1:])
            want = kernels.write_tokens(scales, *parts, wraps=wraps, windows=False)
            got = kernels.write_tokens(scales, *parts, wraps=wraps, own=True, windows=True)
            assert (np.asarray(got) == np.asarray(want)).all(), layout
            assert (np.asarray(got[rows:]) == np.asarray(scales[rows:])).all()
    # a window: the tokens from any row of a tile, in whole tiles
    assert kernels.token_window(16) == 24 and kernels.token_window(8) == 16
    # int8 in tiles of 32 rows where they divide the array (pages of 32: a page whole)
    assert kernels.tile_rows(dtype, 32) == (32 if dtype == "int8" else 8)
    assert kernels.tile_rows(dtype, 48) == 8 and kernels.token_window(16, 32) == 64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_attend_pages_sums_what_the_gathered_pages_sum(dtype):
    """kernels.attend_pages (the TPU's Pallas kernel, interpreted off a TPU) sums over each row's
    pages in place what XLA sums over them gathered: rows holding 0 tokens, one, a page's end, a
    block's end, the whole table; two query heads a kv head; a row's blocks across rows' turns.
    Over rings in place likewise, rows before their ring's end and past it, each query seeing a
    window back from its own position. An int8 cache (fp32 queries) as XLA sums its values
    times their scales."""
    run_alone(f"check_attend_pages({dtype!r})")


def check_attend_pages(dtype):
    for ring in (False, True):
        check_pages_read(dtype, ring)


def check_pages_read(dtype, ring):
    rng = np.random.default_rng(0)
    B, K, G, D, page, n, block = 9, 2, 2, 128, 32, 4, 2  # blocks of 64 tokens, 128 a row
    count = np.array([0, 1, 31, 32, 33, 64, 65, 100, 128])
    S = n * page  # a row's slots
    if ring:  # rings of 128 slots: rows past their end, seeing 96 tokens back or 200
        count = np.array([0, 1, 31, 64, 127, 128, 129, 200, 300])
    first = count - np.array([1, 1, 5, 96, 96, 96, 200, 96, 96])  # (each query at count)
    int8 = dtype == "int8"
    fp = jnp.float32 if int8 else dtype
    q = jnp.asarray(rng.standard_normal((B, K, G, D)) * 0.3, fp)
    stores = [rng.standard_normal((B * n + 1, K, page, D)) * scale for scale in (0.3, 1.0)]
    if int8:
        stores = [nc.quantize(jnp.asarray(a, fp)) for a in stores]
    else:
        stores = [jnp.asarray(a, dtype) for a in stores]
    table = np.zeros((B, n), np.int32)  # the null page past a row's pages
    free = iter(rng.permutation(np.arange(1, B * n + 1)))
    for b, pages in enumerate(-(-np.minimum(count, S) // page)):
        table[b, :pages] = [next(free) for _ in range(pages)]
    table = jnp.asarray(table)
    # each row's slots gathered (B, K, S, D) (a ring: the rows' pages in a row), and the
    # positions they hold; the XLA sums over them in fp32
    gathered = [jax.tree.map(lambda a: kvcache.from_pages(a[table]), s) for s in stores]
    if ring:
        held = nc.ring_positions(jnp.asarray(count) - 1, S)
        seen = (held >= 0) & (held >= first[:, None])
    else:
        seen = jnp.arange(S) < count[:, None]
    k, v = (nc.read_kv(a, None).astype(jnp.float32) for a in gathered)
    with jax.default_matmul_precision("highest"):
        scores = jnp.einsum("bkgd,bksd->bkgs", q.astype(jnp.float32), k) / D**0.5
        w = jnp.where(seen[:, None, None], jnp.exp(scores), 0.0)
        want = (jnp.einsum("bkgs,bksd->bkgd", w, v), w.sum(-1))
    count = jnp.asarray(count, jnp.int32)
    if ring:
        parts = [kvcache.read_in_place(a, None, count, block) for a in gathered]
    else:
        parts = [kvcache.read_in_place(a, table, count, block) for a in stores]
    got = kernels.attend_pages(q, *parts, jnp.asarray(first, jnp.int32) if ring else None, block)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-4)
    assert (np.asarray(got[1][0]) == 0).all() and (np.asarray(got[1][1:]) > 0).all()


# --------------------------------------------------------------------------------------------------
# runtime.py: the compile cache, malloc on huge pages
# --------------------------------------------------------------------------------------------------


def test_use_compile_cache_turns_on_the_compile_cache():
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {k: getattr(jax.config, k) for k in keys}
    try:
        runtime.use_compile_cache(train.parse_args([]).compile_cache)
        default = os.path.expanduser("~/.cache/nanochat_jax/xla")
        assert jax.config.jax_compilation_cache_dir == default
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0  # every compile is cached
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)


def test_tune_malloc_restarts_a_script_onto_huge_pages():
    """Where the kernel offers transparent huge pages and glibc reads the hugetlb tunable (2.35+), a
    script's tune_malloc starts it over once with the tunable set, and malloc's large blocks then
    lie on huge pages."""
    if not os.path.exists("/proc/self/smaps_rollup"):  # gVisor's /proc, say
        pytest.skip("this kernel has no /proc/self/smaps_rollup to count huge pages in")
    code = ("import os, numpy as np, runtime; print('start', os.getpid()); "
            "runtime.tune_malloc(restart=True); "
            "x = np.ones(2**25, np.float32); "  # 128 MiB: one block that malloc maps
            "huge = [int(l.split()[1]) for l in open('/proc/self/smaps_rollup') "
            "if l.startswith('AnonHugePages')]; "
            "print('tunables', os.environ.get('GLIBC_TUNABLES'), 'huge_kb', huge[0])")
    r = subprocess.run([sys.executable, "-c", code], cwd=pathlib.Path(__file__).parent,
                       capture_output=True, text=True, check=True,
                       env={k: v for k, v in child_env().items() if k != "GLIBC_TUNABLES"})
    lines = r.stdout.splitlines()
    if runtime.huge_pages_offered():
        # the same process, started over once
        assert lines[0] == lines[1] and lines[0].startswith("start")
        tunables, huge_kb = lines[2].split()[1], int(lines[2].split()[3])
        assert tunables == runtime.HUGE_PAGES and huge_kb >= 2048
    else:
        assert len(lines) == 2 and lines[1].split()[1] == "None"


# --------------------------------------------------------------------------------------------------
# muon.py: MuonAdamW against PyTorch nanochat (fed nanochat's own gradients: see the golden
# README's warning), then its invariants

def nanochat_update(grads, state, params, **schedule):
    """muon.update with nanochat's parameter groups (setup_optimizer's default lrs)."""
    return muon.update(grads, state, params, *nc.param_groups(params, **schedule))


def init_opt(params):
    return muon.init(params, *nc.param_groups(params))


jit_update = jax.jit(nanochat_update)  # one compile for both golden tests (weight decay is traced)


# on a chip's CPU device: Polar Express's five cubic iterations on the chip miss the golden's fp32
# tolerance even at full matmul precision (the quick tier on a v5e, 2026-12-05)
@pytest.mark.usefixtures("on_cpu")
def test_golden_optimizer_two_steps(golden):
    # nanochat's default
    step = lambda grads, state, params: jit_update(grads, state, params, weight_decay=0.0)
    params = golden_tree(golden, "param")
    params, state = step(golden_tree(golden, "grad"), init_opt(params), params)
    assert_matches_golden(params, golden, "after1", atol=1e-5)
    params, state = step(golden_tree(golden, "grad2"), state, params)
    assert_matches_golden(params, golden, "after2", atol=1e-5)
    assert int(state["step"]) == 2


@pytest.mark.usefixtures("fp32_matmuls")
def test_golden_optimizer_cautious_weight_decay(golden):
    params = golden_tree(golden, "param")
    new, _ = jit_update(golden_tree(golden, "grad"), init_opt(params), params, weight_decay=0.2)
    assert_matches_golden(new, golden, "after1_wd", atol=1e-5)


@pytest.mark.slow  # the optimizer update compiled alone, outside the train step
def test_schedules_do_not_recompile():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(grads, state, params, lr_mult, momentum, weight_decay):
        return nanochat_update(grads, state, params, lr_mult=lr_mult, momentum=momentum,
                               weight_decay=weight_decay)

    params = random_params(TINY, 0)
    state = init_opt(params)
    grads = random_params(TINY, 5)
    for i in range(3):
        params, state = step(grads, state, params, 1.0 - 0.1 * i, 0.85 + 0.05 * i, 0.1 * i)
    chex.assert_tree_all_finite(params)


def test_muon_trains_a_model_that_is_not_the_gpt():
    """muon.py knows no model: a 2-layer MLP regression, its matrices under Muon and its biases
    under AdamW."""
    kx, k1, k2, kt = jax.random.split(jax.random.key(11), 4)
    x = jax.random.normal(kx, (256, 16))
    y = jnp.tanh(x @ jax.random.normal(kt, (16, 4)))
    params = {"w1": jax.random.normal(k1, (16, 64)) / 4, "b1": jnp.zeros(64),
              "w2": jax.random.normal(k2, (64, 4)) / 8, "b2": jnp.zeros(4)}
    labels = {"w1": "matrices", "w2": "matrices", "b1": "biases", "b2": "biases"}
    groups = {"matrices": dict(kind="muon", lr=0.02, momentum=0.95, weight_decay=0.0, beta2=0.9,
                               dtype="float32"),
              "biases": dict(kind="adamw", lr=0.01, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)}
    loss = lambda p: jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

    @jax.jit
    def step(params, state):
        l, grads = jax.value_and_grad(loss)(params)
        return *muon.update(grads, state, params, labels, groups), l

    state = muon.init(params, labels, groups)
    # factored, 2-D leaves
    assert state["var"]["w1"].shape == (1, 64) and state["var"]["w2"].shape == (64, 1)
    assert state["var"]["b1"].shape == (64,)
    losses = []
    for _ in range(100):
        params, state, l = step(params, state)
        losses.append(float(l))
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])


@pytest.mark.usefixtures("fp32_matmuls")
def test_polar_express_orthogonalizes():
    # as the step runs it; the SVDs in numpy (op by op: 40 compiles)
    polar = jax.jit(muon.polar_express)
    x = jax.random.normal(jax.random.key(6), (3, 64, 160))
    for m in (x, x.mT, x[:, :, :64]):  # wide, tall, square
        u = np.asarray(polar(m), np.float64)
        s = np.linalg.svd(u, compute_uv=False)
        assert 0.7 < float(s.min()) and float(s.max()) < 1.25, m.shape
        # and it is the polar factor: aligned with U V^T of the SVD
        uu, _, vt = np.linalg.svd(np.asarray(m, np.float64), full_matrices=False)
        norms = np.linalg.norm(u, axis=(-2, -1)) * min(m.shape[1:]) ** 0.5
        cos = np.sum(u * (uu @ vt), axis=(-2, -1)) / norms
        assert float(cos.min()) > 0.99
    np.testing.assert_allclose(polar(x.mT), polar(x).mT, atol=1e-5)


@pytest.mark.usefixtures("fp32_matmuls")
def test_muon_stacks_do_not_mix():
    """Batching same-shape matrices is only an efficiency device: each matrix steps alone."""
    k = jax.random.split(jax.random.key(7), 4)
    p, g, buf = (jax.random.normal(kk, (3, 48, 16)) for kk in k[:3])
    buf2 = jnp.abs(jax.random.normal(k[3], (3, 48, 1)))
    step = jax.jit(muon.muon_step)
    hp = dict(lr=0.02, momentum=0.9, weight_decay=0.1)
    together = step(p, g, buf, buf2, **hp)
    alone = [step(p[i:i + 1], g[i:i + 1], buf[i:i + 1], buf2[i:i + 1], **hp) for i in range(3)]
    for j in range(3):
        np.testing.assert_allclose(together[j], jnp.concatenate([a[j] for a in alone]), atol=1e-6)


def test_muon_update_padded_for_devices_is_the_same():
    """update's shards pad each Muon stack with zero matrices to a multiple of the devices (the
    stacks of 2 layers to 8) and hand it to place: the same step, the padding gone."""
    params = random_params(TINY, 0)
    labels, groups = nc.param_groups(params)
    grads = jax.tree.map(lambda w: jnp.cos(w * 3.0 + 1.0), params)
    state = muon.init(params, labels, groups)
    placed = []

    def place(stack):
        placed.append(stack.shape)
        return stack
    plain = jax.jit(lambda g, s, p: muon.update(g, s, p, labels, groups))(grads, state, params)
    padded = jax.jit(lambda g, s, p: muon.update(g, s, p, labels, groups, 8, place))(
        grads, state, params)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(padded)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert placed and all(shape[0] % 8 == 0 for shape in placed)
    assert any(shape[0] > 2 * params["h"]["mlp"]["c_fc"].shape[0] for shape in placed)


def test_adamw_matches_numpy():
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=(5, 7)).astype(np.float32)
    grads = rng.normal(size=(3, 5, 7)).astype(np.float32)
    lr, b1, b2, wd, eps = 0.01, 0.8, 0.95, 0.05, 1e-10
    p, m, v = p0.astype(np.float64), np.zeros((5, 7)), np.zeros((5, 7))
    jp, jm, jv = jnp.asarray(p0), jnp.zeros((5, 7)), jnp.zeros((5, 7))
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        jp, jm, jv = muon.adamw_step(jp, jnp.asarray(g), jm, jv, t, lr=lr, beta1=b1, beta2=b2,
                                     weight_decay=wd)
    np.testing.assert_allclose(jp, p, rtol=0, atol=1e-6)


def test_adamw_of_bf16_leaves_computes_in_fp32():
    """A bf16 leaf (an embedding under bf16 compute) keeps bf16 params and moments, and each step
    is the fp32 step of its values rounded once, as nanochat's fused AdamW casts back at the
    end."""
    rng = np.random.default_rng(1)
    p, g, m = (jnp.asarray(rng.normal(size=(4, 6)), jnp.bfloat16) for _ in range(3))
    v = jnp.asarray(rng.uniform(size=(4, 6)), jnp.bfloat16)
    hp = dict(lr=0.01, beta1=0.8, beta2=0.95, weight_decay=0.01)
    got = muon.adamw_step(p, g, m, v, 3, **hp)
    want = muon.adamw_step(*(a.astype(jnp.float32) for a in (p, g, m, v)), 3, **hp)
    assert all(a.dtype == jnp.bfloat16 for a in got)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b.astype(jnp.bfloat16))


def test_optimizer_groups_follow_nanochat(monkeypatch):
    params = random_params(TINY, 0)
    state = init_opt(params)
    calls, step = [], muon.muon_step
    monkeypatch.setattr(muon, "muon_step",
                        lambda p, *a, **hp: calls.append(p.shape) or step(p, *a, **hp))
    jax.eval_shape(nanochat_update, params, state, params)
    # on one device one batched Polar Express per leaf, each a stack of its layers' matrices
    # (K, in, out)
    assert sorted(calls) == sorted(w.shape for w in jax.tree.leaves(params["h"]))
    # split over devices, one per shape, nanochat's shape groups, padded to a multiple of them
    calls.clear()
    jax.eval_shape(lambda *a: muon.update(*a, *nc.param_groups(params), 2, lambda x: x),
                   params, state, params)
    assert sorted(calls) == sorted([(6, 32, 32), (6, 32, 16), (4, 32, 128), (4, 128, 32),
                                    (2, 12, 2)])
    # out >= in: one moment per output unit
    assert state["var"]["h"]["attn"]["c_q"].shape == (3, 1, 32)
    # more inputs than outputs: per input
    assert state["var"]["h"]["mlp"]["c_proj"].shape == (3, 128, 1)
    # Muon even for the tiny (12, 2) ve_gate
    assert state["var"]["h"]["attn"]["ve_gate"].shape == (2, 12, 1)
    # AdamW, though 3-D
    assert state["var"]["value_embeds"].shape == params["value_embeds"].shape
    labels, groups = nc.param_groups(params, embedding_lr=0.3, scalar_lr=0.4, lr_mult=0.5)
    assert labels["h"]["mlp"]["c_fc"] == "h"
    assert labels["backout_lambda"] == labels["smear_gate"] == "smear"
    scale = (32 / 768) ** -0.5
    assert groups["value_embeds"]["lr"] == pytest.approx(0.3 * scale * 0.5 * 0.5)
    assert groups["resid_lambdas"]["lr"] == pytest.approx(0.4 * 0.01 * 0.5)
    assert groups["smear"]["lr"] == pytest.approx(0.2 * 0.5)
    assert groups["h"]["lr"] == pytest.approx(0.02 * 0.5)


# --------------------------------------------------------------------------------------------------
# lora.py: adapters as a transform of the params (merged, and against the unmerged path)
# --------------------------------------------------------------------------------------------------


@jax.tree_util.register_pytree_node_class
class Factored:
    """A LoRA target the model uses unmerged, x @ W + (x @ A) @ B * s: the path lora.merge's
    W + s A @ B replaces. A pytree of (W, A, B), stacked or one layer's ([i] slices a stack)."""

    def __init__(self, w, a, b, s):
        self.w, self.a, self.b, self.s = w, a, b, s

    def tree_flatten(self):
        return (self.w, self.a, self.b), self.s

    @classmethod
    def tree_unflatten(cls, s, leaves):
        return cls(*leaves, s)

    @property
    def shape(self):
        return self.w.shape

    def __getitem__(self, i):
        return Factored(self.w[i], self.a[i], self.b[i], self.s)

    def __rmatmul__(self, x):  # nc.linear's x (N, in) @ w
        return x @ self.w + (x @ self.a) @ self.b * self.s


def factored(base, adapters, scale):
    """The base params with each target a Factored weight."""
    h = {kind: dict(mats) for kind, mats in base["h"].items()}
    for kind, mats in adapters.items():
        for name, ab in mats.items():
            h[kind][name] = Factored(base["h"][kind][name], ab["A"], ab["B"], scale)
    return {**base, "h": h}


def trained_adapters(base, rank, seed, tokens=()):
    """lora.init's adapters with B (and the token deltas) drawn too, as training would leave
    them."""
    adapters = lora.init(base, rank, lora.TARGETS, jax.random.key(seed), tokens)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: a + rng.normal(0, 0.05, a.shape).astype(np.float32), adapters)


@pytest.mark.usefixtures("fp32_matmuls")
def test_lora_with_b_zero_is_the_base_and_merged_equals_unmerged():
    """B = 0: the adapted model's logits are the base's, bit for bit. Trained adapters: the merged
    weights W + s A @ B give the logits of the unmerged x @ W + (x @ A) @ B s within 2e-5 (fp32
    sums in another order; 4e-6 measured), and every leaf but the targets is the base's own."""
    base = random_params(TINY, 20)
    adapters = lora.init(base, 4, lora.TARGETS, jax.random.key(21))
    assert jax.tree.map(jnp.shape, adapters) == {
        "attn": {name: {"A": (3, 32, 4), "B": (3, 4, n)} for name, n in
                 (("c_q", 32), ("c_k", 16), ("c_v", 16), ("c_proj", 32))},
        "mlp": {"c_fc": {"A": (3, 32, 4), "B": (3, 4, 128)},
                "c_proj": {"A": (3, 128, 4), "B": (3, 4, 32)}}}
    assert not any(np.any(ab["B"]) for mats in adapters.values() for ab in mats.values())
    x = jax.random.randint(jax.random.key(22), (2, 16), 0, TINY.vocab_size)
    np.testing.assert_array_equal(forward(lora.merge(base, adapters, 4.0), x, TINY),
                                  forward(base, x, TINY))
    trained = trained_adapters(base, 4, 23)
    merged = lora.merge(base, trained, 4.0)
    logits = forward(merged, x, TINY)
    np.testing.assert_allclose(logits, forward(factored(base, trained, 4.0), x, TINY), rtol=0,
                               atol=2e-5)
    assert np.abs(logits - forward(base, x, TINY)).max() > 0.1  # the adapters do change it
    assert merged["wte"] is base["wte"] and merged["h"]["attn"]["ve_gate"] is \
        base["h"]["attn"]["ve_gate"]
    only_q = lora.merge(base, {"attn": {"c_q": trained["attn"]["c_q"]}}, 4.0)
    assert only_q["h"]["attn"]["c_k"] is base["h"]["attn"]["c_k"]
    # token deltas: zero at first, then added to their wte rows and lm_head columns alone
    ids = np.array([3, 7])
    zero = lora.init(base, 4, lora.TARGETS, jax.random.key(21), tokens=ids)["tokens"]
    np.testing.assert_array_equal(forward(lora.merge(base, {"tokens": zero}, 4.0, ids), x, TINY),
                                  forward(base, x, TINY))
    ones = {"tokens": jax.tree.map(np.ones_like, zero)}
    moved = lora.merge(base, ones, 4.0, ids)
    assert list(np.flatnonzero((moved["wte"] != base["wte"]).any(1))) == [3, 7]
    assert list(np.flatnonzero((moved["lm_head"] != base["lm_head"]).any(0))) == [3, 7]
    np.testing.assert_array_equal(moved["wte"][7], base["wte"][7] + 1)


# --------------------------------------------------------------------------------------------------
# data.py: tokenizer, corpora, packing, chat format, calculator

MULTILINGUAL = ("Réponse courte, s'il vous plaît — "
                "東京 et 東京都 🙂 👍🏽 naïve café. ") * 30


@pytest.fixture(scope="module")
def bpe_golden():
    return json.loads((TESTDATA / "nanochat_bpe.json").read_text())


@pytest.fixture(scope="module")
def render_golden():
    return json.loads((TESTDATA / "nanochat_chat_render.json").read_text())


@pytest.fixture(scope="module")
def tok(bpe_golden):
    """A trained tokenizer whose merges include multi-byte characters (some tokens are partial
    UTF-8)."""
    return data.train_tokenizer([bpe_golden["text"], MULTILINGUAL], 600)


@pytest.fixture(scope="module")
def btok():
    return data.byte_tokenizer()


# --------------------------------------------------------------------------------------------------
# Tokenizer

def test_bpe_merges_equal_nanochat(bpe_golden):
    assert bpe_golden["vocab_size_argument"] == 465 and bpe_golden["num_merges"] == 200
    t = data.train_tokenizer(bpe_golden["text"], 465)
    assert len(t.tokens) == 256 + 200
    # every merge in order, including the 96 whose pair count tied at the top (smallest pair wins,
    # as in rustbpe)
    assert bpe_golden["replay_num_merges_with_ties"] == 96
    assert [x.hex() for x in t.tokens[256:]] == bpe_golden["merged_token_hex"]
    ranks = {x: i for i, x in enumerate(t.tokens)}
    for i, (left, right) in enumerate(bpe_golden["merges_hex"]):
        merged = bytes.fromhex(left) + bytes.fromhex(right)
        assert ranks[merged] == 256 + i, i
        pair = [ranks[bytes.fromhex(left)], ranks[bytes.fromhex(right)]]
        assert pair == bpe_golden["merges_ids"][i]
    assert [t.encode(s) for s in bpe_golden["test_strings"]] == bpe_golden["test_ids"]
    assert t.special == bpe_golden["special_tokens"]
    assert data.SPLIT_PATTERN == bpe_golden["split_pattern"]


def test_vocab_size_counts_specials_and_token_bytes(bpe_golden, render_golden):
    t = data.train_tokenizer(bpe_golden["text"], 465)
    assert t.n_vocab == 465 and len(t.tokens) == 456
    assert list(t.special) == list(data.SPECIAL_TOKENS) and len(data.SPECIAL_TOKENS) == 9
    assert list(t.special.values()) == list(range(456, 465))  # the specials are the last ids
    assert t.bos == 456 == t.special["<|bos|>"]
    tb = t.token_bytes()
    assert tb.shape == (465,) and tb.dtype == np.int32
    assert tb[456:].tolist() == [0] * 9
    assert tb[:456].tolist() == [len(x) for x in t.tokens]
    assert tb[:256].tolist() == [1] * 256
    assert tb[256] == len(bytes.fromhex(bpe_golden["merged_token_hex"][0]))
    ids = t.encode(bpe_golden["text"])
    # bytes-per-token denominator
    assert max(ids) < 456 and tb[ids].sum() == len(bpe_golden["text"].encode())
    b = data.byte_tokenizer()
    ref = render_golden["tokenizer"]
    assert b.n_vocab == ref["vocab_size"] == 265 and b.bos == ref["bos_token_id"] == 256
    assert b.special == ref["special_tokens"] and list(b.special) == ref["special_tokens_order"]
    assert b.token_bytes().tolist() == [1] * 256 + [0] * 9


ROUND_TRIP = [
    "",
    "hello world",
    "It's 2024: we'll ship 12345 items, they've said.\r\n\tIndented\t\tline   with   runs\n\n\n",
    "réponse à l'été — naïve café; 東京 und Straße, "
    "Ελληνικά, русский, עברית, हिन्दी",
    "🙂👍🏽 family: 👨‍👩‍👧‍👦 "
    "flag: 🏳️‍🌈 keycap: 1️⃣ combining: e\u0301",
    "\x00\x01\x02\x07\x08\x0b\x0c\x1b[0m\x7f\x85\u2028\u2029\ufeff end",
    MULTILINGUAL,
]


@pytest.mark.parametrize("s", ROUND_TRIP, ids=["empty", "ascii", "contractions", "non-ascii",
                                               "emoji", "control", "trained-text"])
def test_round_trip(tok, btok, s):
    for t in (tok, btok):
        ids = t.encode(s)
        assert all(isinstance(i, int) for i in ids)
        assert t.decode(ids) == s
        assert b"".join(t.tokens[i] for i in ids) == s.encode()  # byte level, no specials
        assert t.decode(np.array(ids, np.int32)) == s  # numpy ids decode too
    assert btok.encode(s) == list(s.encode())
    if s == MULTILINGUAL:  # merges were trained on it: it must compress
        assert len(tok.encode(s)) < len(s.encode()) / 3


def test_invalid_bytes_and_partial_characters(tok, btok):
    # Some trained tokens are partial UTF-8 (merges inside a CJK or emoji character); each decodes
    # with U+FFFD
    partial = [i for i, x in enumerate(tok.tokens)
               if x.decode("utf-8", "replace") != x.decode("utf-8", "ignore")]
    assert len([i for i in partial if i >= 256]) > 0
    for i, x in enumerate(tok.tokens):
        assert tok.decode([i]) == x.decode("utf-8", "replace")
    # Prefixes of an encoding cut characters; the bytes are still exact, the text gets U+FFFD where
    # they are cut
    s = "東京 🙂👍🏽 é"
    for t in (tok, btok):
        ids = t.encode(s)
        for k in range(len(ids) + 1):
            raw = b"".join(t.tokens[i] for i in ids[:k])
            assert s.encode().startswith(raw)
            assert t.decode(ids[:k]) == raw.decode("utf-8", "replace")
    assert btok.decode([0xE6, 0x9D]) == "\ufffd"  # 東 without its last byte
    assert btok.decode([0xE6, 0x9D, 0xB1]) == "東"
    assert btok.decode([0xFF, 0x41, 0xC3]) == "\ufffdA\ufffd"  # invalid byte, then a truncated é
    assert btok.decode([0xED, 0xA0, 0x80]) == "\ufffd" * 3  # an encoded surrogate is invalid UTF-8
    # A lone surrogate cannot be UTF-8: it is encoded as U+FFFD (tiktoken's rule), never raises
    for t in (tok, btok):
        assert t.encode("a\ud800b") == t.encode("a\ufffdb")
        assert t.decode(t.encode("a\ud800b")) == "a\ufffdb"
    assert btok.encode("\udfff") == [0xEF, 0xBF, 0xBD]


def test_special_strings_never_become_special_ids(tok, btok):
    text = "".join(data.SPECIAL_TOKENS) + " plain <|bos|>text<|endoftext|>"
    for t in (tok, btok):
        ids = t.encode(text)
        assert not set(ids) & set(t.special.values())
        assert max(ids) < len(t.tokens)
        assert t.decode(ids) == text
    # one id per byte: nothing was folded into a special
    assert len(btok.encode(text)) == len(text.encode())
    # decoding real special ids gives their names
    assert btok.decode([btok.bos, 65, btok.special["<|output_end|>"]]) == "<|bos|>A<|output_end|>"
    # in a rendered conversation, only the structure gives special ids
    msgs = [{"role": "user", "content": "say <|assistant_end|><|bos|>"},
            {"role": "assistant", "content": "<|user_start|> ok <|python_start|>1+1<|python_end|>"}]
    ids, mask = data.render_conversation(btok, msgs)
    counts = collections.Counter(i for i in ids if i >= 256)
    sp = btok.special
    assert counts == {sp["<|bos|>"]: 1, sp["<|user_start|>"]: 1, sp["<|user_end|>"]: 1,
                      sp["<|assistant_start|>"]: 1, sp["<|assistant_end|>"]: 1}
    assert len(ids) == 5 + sum(len(m["content"].encode()) for m in msgs)


def test_save_load(tok, btok, tmp_path, bpe_golden):
    path = tmp_path / "tok.json"
    tok.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["tok.json"]  # atomic write leaves no temp file
    t = data.Tokenizer.load(path)
    assert t.tokens == tok.tokens and t.pat_str == tok.pat_str and t.special == tok.special
    assert t.bos == tok.bos and t.n_vocab == tok.n_vocab
    assert t.token_bytes().tolist() == tok.token_bytes().tolist()
    for s in ROUND_TRIP + bpe_golden["test_strings"]:
        assert t.encode(s) == tok.encode(s)
    assert json.loads(path.read_text())["tokens"][:2] == ["00", "01"]  # plain JSON, bytes as hex
    # overwrite with a different tokenizer: loading gives the new one (no stale cache)
    small = data.train_tokenizer(bpe_golden["text"], 300)
    small.save(str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["tok.json"]
    t2 = data.Tokenizer.load(str(path))
    assert t2.tokens == small.tokens and t2.n_vocab == 300 and t2.bos == 291
    assert t2.encode(bpe_golden["test_strings"][0]) == small.encode(bpe_golden["test_strings"][0])
    assert t2.encode(bpe_golden["test_strings"][0]) != tok.encode(bpe_golden["test_strings"][0])
    btok.save(path)
    assert data.Tokenizer.load(path).tokens == [bytes([i]) for i in range(256)]
    # errors a user can cause
    with pytest.raises(FileNotFoundError, match="train one first"):
        data.Tokenizer.load(tmp_path / "missing.json")
    for bad in ("not json", json.dumps({"version": 2, "pat_str": "x", "tokens": [],
                                        "special_tokens": []}),
                json.dumps({"version": 1}), json.dumps([1, 2])):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(ValueError, match="not a tokenizer file"):
            data.Tokenizer.load(tmp_path / "bad.json")


def test_train_tokenizer_inputs(bpe_golden):
    with pytest.raises(ValueError, match="vocab_size 264 is too small: it needs at least 265"):
        data.train_tokenizer("some text", 264)
    with pytest.raises(ValueError, match="too small"):
        data.train_tokenizer("some text", 0)
    with pytest.raises(ValueError, match="no text to train"):
        data.train_tokenizer([], 300)
    with pytest.raises(ValueError, match="no text to train"):
        data.train_tokenizer("", 300)
    t = data.train_tokenizer("hello", 265)  # zero merges: the byte tokenizer
    assert t.tokens == data.byte_tokenizer().tokens and t.n_vocab == 265
    # a string, a list and a one-shot generator of documents train alike
    docs = bpe_golden["text"].split("\n\n")
    a = data.train_tokenizer(docs, 320)
    assert data.train_tokenizer(iter(docs), 320).tokens == a.tokens
    assert data.train_tokenizer(bpe_golden["text"], 465).tokens[:264] == \
        data.train_tokenizer([bpe_golden["text"]], 264 + 9).tokens  # a smaller vocab is a prefix
    # text too small for the vocab: a warning that says how many merges there were
    with pytest.warns(UserWarning, match="allows only 1 merges: the vocab is 266, not 1000"):
        t = data.train_tokenizer(["ab", "ab"], 1000)
    assert t.tokens[256:] == [b"ab"] and t.n_vocab == 266 and t.bos == 257
    # overlapping pairs count twice ("aaaa" holds (a, a) three times) and merge left to right
    t = data.train_tokenizer(["aaaa", "ab", "ab"], 266)
    assert t.tokens[256:] == [b"aa"]
    assert t.encode("aaaaa") == [256, 256, 97]
    with pytest.raises(ValueError, match="unique and start with the 256 single bytes"):
        data.Tokenizer([bytes([i]) for i in range(256)] + [b"a"])
    with pytest.raises(ValueError, match="retrain"):
        data.Tokenizer([bytes([i]) for i in range(1, 256)])


# --------------------------------------------------------------------------------------------------
# Corpora

def test_default_corpus():
    docs = data.default_corpus()
    assert docs == data.default_corpus()  # deterministic order
    n_bytes = sum(len(d.encode()) for d in docs)
    assert 1_000_000 < n_bytes < 4_000_000 and len(docs) > 2000  # about 2 MB
    # "qualified name\n\ndocstring"
    assert any(d.startswith("json.dumps\n\nSerialize ``obj``") for d in docs)
    train, val = list(data.corpus()(0)), list(data.corpus(split="val")(0))
    assert train == list(data.corpus()(0))
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(docs)
    assert 0.03 < len(val) / (len(train) + len(val)) < 0.07  # 1 in 20
    again = list(data.corpus()(1))  # a fresh order per epoch, the same documents
    assert again != train and sorted(again) == sorted(train)
    assert list(data.corpus(seed=1)(0)) != train
    with pytest.raises(ValueError, match="split must be 'train' or 'val'"):
        data.corpus(split="test")


def assert_split(paths, expected):
    """The train and val streams of `paths` partition `expected` (in order) into disjoint documents.
    """
    train, val = list(data.corpus(paths)(0)), list(data.corpus(paths, split="val")(0))
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(expected)
    assert train == [d for d in expected if d in set(train)]
    assert val == [d for d in expected if d in set(val)]
    assert list(data.corpus(paths)(1)) == train  # user files are streamed in order, every epoch


def test_user_corpora(tmp_path):
    texts = [f"document {i}: " + "words " * (i % 7 + 1) + "é" * (i % 3) for i in range(60)]
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "a.txt").write_text("  Small file.\n\nTwo short paragraphs stay one document.\n\n")
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[:40])]
    blank = json.dumps({"text": "  "})
    (tmp_path / "d" / "b.jsonl").write_text("\n".join(lines[:20]) + "\n\n" + blank + "\n"
                                            + "\n".join(lines[20:]) + "\n")
    rest = "".join(json.dumps({"text": t}) + "\n" for t in texts[40:])
    (tmp_path / "d" / "sub" / "c.jsonl").write_text(rest)
    (tmp_path / "d" / "notes.md").write_text("ignored")
    (tmp_path / "d" / "a2.txt").write_text("Plain text in a directory.")
    small = "Small file.\n\nTwo short paragraphs stay one document."
    assert_split(str(tmp_path / "a.txt"), [small])
    assert_split(str(tmp_path / "d" / "b.jsonl"), texts[:40])  # whitespace-only texts skipped
    # recursive, sorted paths
    assert_split(str(tmp_path / "d"), ["Plain text in a directory."] + texts)
    assert_split(str(tmp_path / "d" / "**" / "*.jsonl"), texts)  # a recursive glob
    assert_split([str(tmp_path / "d" / "sub"), str(tmp_path / "a.txt")], texts[40:] + [small])
    # a long .txt is cut at blank lines once a document holds 2000 characters
    paragraphs = [f"Paragraph {i} " + "x" * (300 + 37 * i) + "." for i in range(30)]
    big = "\n\n".join(paragraphs) + "\n"
    (tmp_path / "big.txt").write_text(big)
    big_path = str(tmp_path / "big.txt")
    docs = list(data.corpus(big_path)(0)) + list(data.corpus(big_path, "val")(0))
    docs.sort(key=big.index)
    assert "\n\n".join(docs) == big.strip()
    assert all(len(d) >= 1999 for d in docs[:-1]) and all(len(d) < 2000 + 1500 for d in docs)
    assert len(docs) > 5


def test_corpus_streams(tmp_path):
    path = tmp_path / "a.jsonl"
    text = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50))
    path.write_text(text + "{broken\n")
    docs = data.corpus(str(path))
    gen = docs(0)
    assert inspect.isgenerator(gen)
    first = next(gen)  # reading stops before the broken last line: one document at a time
    assert first.startswith("doc ")
    with pytest.raises(ValueError, match=":51:"):
        list(gen)
    txt = tmp_path / "b.txt"
    txt.write_text("one\n")
    gen = data.corpus(str(txt))(0)
    txt.write_text("two\n")  # nothing was read until the first document was asked for
    assert list(gen) == ["two"]
    lines = [f"line {i} of a file without blank lines\n" for i in range(3000)]  # ~115K chars
    txt.write_text("".join(lines))
    docs = list(data.corpus(str(txt))(0))
    # cut at line ends past 20,000 chars, nothing lost
    assert len(docs) == 6 and max(map(len, docs)) < 20100
    got = sorted(line for d in docs for line in d.split("\n"))
    assert got == sorted(line[:-1] for line in lines)


def test_corpus_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        data.corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match="matches no"):
        data.corpus(str(tmp_path / "*.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        data.corpus(str(tmp_path / "x.csv"))
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "empty_dir" / "readme.md").write_text("not a corpus")
    with pytest.raises(ValueError, match="no .txt, .jsonl or .parquet files in this directory"):
        data.corpus(str(tmp_path / "empty_dir"))
    # an empty corpus: no documents, and packing says so
    (tmp_path / "empty.txt").write_text("\n\n   \n")
    docs = data.corpus(str(tmp_path / "empty.txt"))
    assert list(docs(0)) == []
    with pytest.raises(ValueError, match="no documents"):
        next(data.pretrain_batches(data.byte_tokenizer(), docs, 1, 8))
    # invalid UTF-8: replaced by U+FFFD, with one warning per file that counts the bad sequences
    raw = "ok\n".encode() + "bad \ufffd is text, ".encode() + b"\xff\xfe are not\n\nthen \xc3 cut\n"
    (tmp_path / "bad.txt").write_bytes(raw)
    with pytest.warns(UserWarning, match=r"bad.txt: replaced 3 invalid UTF-8 sequences"):
        bad = str(tmp_path / "bad.txt")
        out = list(data.corpus(bad)(0)) + list(data.corpus(bad, "val")(0))
    assert out == [raw.decode("utf-8", "replace").strip()] and out[0].count("\ufffd") == 4
    # malformed .jsonl lines name the file and the line
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n\n{"text": 5}\n')
    with pytest.raises(ValueError,
                       match=re.escape(f"{tmp_path / 'b.jsonl'}:3: expected a JSON object")):
        list(data.corpus(str(tmp_path / "b.jsonl"))(0))
    for line in ("not json", '["text"]', '{"txt": "a"}'):
        (tmp_path / "c.jsonl").write_text(line + "\n")
        with pytest.raises(ValueError, match="c.jsonl:1:"):
            list(data.corpus(str(tmp_path / "c.jsonl"))(0))


def test_parquet_needs_pyarrow(tmp_path, monkeypatch):
    # as if not installed (requirements-dev has it)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "shard.parquet").write_bytes(b"PAR1 not really")
    docs = data.corpus(str(tmp_path / "shard.parquet"))
    with pytest.raises(ImportError, match="pip install pyarrow"):
        list(docs(0))


def test_parquet_shards(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"shard text {i} " + "é" * (i % 4) for i in range(40)]
    for k in range(2):
        table = pa.table({"text": texts[20 * k:20 * (k + 1)], "id": list(range(20))})
        pq.write_table(table, tmp_path / f"shard_{k:05d}.parquet", row_group_size=6)
    assert pq.ParquetFile(tmp_path / "shard_00000.parquet").num_row_groups == 4
    assert_split(str(tmp_path), texts)
    assert_split(str(tmp_path / "shard_*.parquet"), texts)
    pq.write_table(pa.table({"text": ["kept", None]}), tmp_path / "nulls.parquet")
    # null texts are skipped
    assert list(data.corpus(str(tmp_path / "nulls.parquet"))(0)) == ["kept"]
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match='no "text" column'):
        list(data.corpus(str(tmp_path / "other.parquet"))(0))


# --------------------------------------------------------------------------------------------------
# Packing

def make_docs(n, T, seed=0):
    """n texts whose byte-level lengths range from a few tokens to ~2 rows of T+1 (so some are
    cropped)."""
    rng = random.Random(seed)
    alphabet = "abcdefghij klmnop é東🙂\n"
    docs = []
    for _ in range(n):
        length = rng.choice([rng.randint(0, T // 4), rng.randint(T // 4, T), rng.randint(T, 2 * T)])
        docs.append("".join(rng.choice(alphabet) for _ in range(length)))
    return docs


def ordered(docs):
    return lambda epoch: iter(docs)


def nanochat_bestfit(tok, documents, B, T, n_batches, buffer_size):
    """nanochat/dataloader.py's BOS-aligned best fit, transcribed line by line (the buffer refills
    one document at a time instead of 128, and the crop tails are counted): [(inputs, targets,
    dropped)] for n_batches."""
    row_capacity = T + 1
    batches = (doc for epoch in itertools.count() for doc in documents(epoch))
    doc_buffer, dropped, out = [], 0, []
    for _ in range(n_batches):
        rows = []
        for _ in range(B):
            row = []
            while len(row) < row_capacity:
                while len(doc_buffer) < buffer_size:
                    doc_buffer.append([tok.bos] + tok.encode(next(batches)))
                remaining = row_capacity - len(row)
                best_idx, best_len = -1, 0
                for i, doc in enumerate(doc_buffer):
                    doc_len = len(doc)
                    if doc_len <= remaining and doc_len > best_len:
                        best_idx, best_len = i, doc_len
                if best_idx >= 0:
                    doc = doc_buffer.pop(best_idx)
                    row.extend(doc)
                else:
                    shortest_idx = min(range(len(doc_buffer)), key=lambda i: len(doc_buffer[i]))
                    doc = doc_buffer.pop(shortest_idx)
                    row.extend(doc[:remaining])
                    dropped += len(doc) - remaining
            rows.append(row[:row_capacity])
        rows = np.array(rows, np.int32)
        out.append((rows[:, :-1], rows[:, 1:], dropped))
    return out


def nanochat_sft_bestfit(tok, conversations, B, T, n_batches, buffer_size):
    """scripts/chat_sft.py's sft_data_generator_bos_bestfit, transcribed line by line (renders
    truncated to a row, single rank): [(inputs, targets)] for n_batches."""
    row_capacity = T + 1
    dataset = (conv for epoch in itertools.count() for conv in conversations(epoch))
    conv_buffer, out = [], []
    for _ in range(n_batches):
        rows, mask_rows, row_lengths = [], [], []
        for _ in range(B):
            row, mask_row, padded = [], [], False
            while len(row) < row_capacity:
                while len(conv_buffer) < buffer_size:
                    conv_buffer.append(data.render_conversation(tok, next(dataset),
                                                                max_tokens=row_capacity))
                remaining = row_capacity - len(row)
                best_idx, best_len = -1, 0
                for i, (conv, _) in enumerate(conv_buffer):
                    conv_len = len(conv)
                    if conv_len <= remaining and conv_len > best_len:
                        best_idx, best_len = i, conv_len
                if best_idx >= 0:
                    conv, conv_mask = conv_buffer.pop(best_idx)
                    row.extend(conv)
                    mask_row.extend(conv_mask)
                else:
                    content_len = len(row)
                    row.extend([tok.bos] * remaining)
                    mask_row.extend([0] * remaining)
                    padded = True
                    break
            row_lengths.append(content_len if padded else row_capacity)
            rows.append(row[:row_capacity])
            mask_rows.append(mask_row[:row_capacity])
        batch, masks = np.array(rows, np.int32), np.array(mask_rows, np.int8)
        inputs, targets = batch[:, :-1], batch[:, 1:].copy()
        targets[masks[:, 1:] == 0] = -1
        for i, content_len in enumerate(row_lengths):
            if content_len < row_capacity:
                targets[i, content_len - 1:] = -1
        out.append((inputs, targets, row_lengths))
    return out


def test_pretrain_packing_invariants(btok):
    B, T, n, buffer_size = 4, 64, 15, 16
    docs = make_docs(120, T, seed=1)
    documents = data.shuffled(docs, seed=5)
    batches = data.pretrain_batches(btok, documents, B, T, buffer_size=buffer_size)
    got = list(itertools.islice(batches, n))
    ref = nanochat_bestfit(btok, documents, B, T, n, buffer_size)
    encoded = {tuple([btok.bos] + btok.encode(d)) for d in docs}
    n_segments = 0
    for (x, y, state), (rx, ry, rdropped) in zip(got, ref):
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
        assert state["dropped"] == rdropped
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        assert (x[:, 0] == btok.bos).all()  # every row starts with BOS
        # rows of T+1: whole documents, then one crop
        for row in np.concatenate([x, y[:, -1:]], axis=1).tolist():
            starts = [i for i, t in enumerate(row) if t == btok.bos] + [len(row)]
            segments = [tuple(row[a:b]) for a, b in zip(starts, starts[1:])]
            assert all(s in encoded for s in segments[:-1])
            assert any(e[:len(segments[-1])] == segments[-1] for e in encoded)
            n_segments += len(segments)
    # accounting: every token of every consumed document is in a row, except the crop tails counted
    # in "dropped"
    state = got[-1][2]
    # refilled before the next pick
    assert state["dropped"] > 0 and len(state["buffer"]) == buffer_size - 1
    assert n_segments > 1.5 * n * B  # rows hold several documents
    stream = [([e, i], d) for e in range(state["epoch"] + 1) for i, d in enumerate(documents(e))
              if (e, i) < (state["epoch"], state["index"])]
    consumed = [d for key, d in stream if key not in state["buffer"]]
    assert len(consumed) == n_segments
    assert sum(1 + len(d.encode()) for d in consumed) == n * B * (T + 1) + state["dropped"]
    with pytest.raises(ValueError, match="must be positive"):
        next(data.pretrain_batches(btok, documents, 0, T))


def test_pretrain_resume_is_exact(btok):
    B, T, n, buffer_size = 2, 32, 30, 8
    docs = make_docs(40, T, seed=2)  # small: the stream wraps into new epochs every few batches
    documents = data.shuffled(docs, seed=3)
    batches = data.pretrain_batches(btok, documents, B, T, buffer_size=buffer_size)
    full = list(itertools.islice(batches, n))
    assert full[-1][2]["epoch"] >= 2
    ref = nanochat_bestfit(btok, documents, B, T, n, buffer_size)
    for (x, y, st), (rx, ry, rdropped) in zip(full, ref):
        np.testing.assert_array_equal(x, rx)
        assert st["dropped"] == rdropped
    straddles = 0
    for k in range(1, n):
        state = json.loads(json.dumps(full[k - 1][2]))  # states are plain JSON
        straddles += any(e < state["epoch"] for e, _ in state["buffer"])
        resumed = data.pretrain_batches(btok, documents, B, T, state=state, buffer_size=buffer_size)
        for (x, y, st), (x2, y2, st2) in zip(full[k:], itertools.islice(resumed, n - k)):
            np.testing.assert_array_equal(x, x2)
            np.testing.assert_array_equal(y, y2)
            assert st == st2
    assert straddles > 0  # some saved buffers held documents of an epoch before the next position's
    # resuming on a different (here: shorter) corpus is refused
    state = full[-1][2]
    with pytest.raises(ValueError, match="corpus changed"):
        next(data.pretrain_batches(btok, ordered(docs[:2]), B, T, state=state,
                                   buffer_size=buffer_size))


def test_pretrain_crops_long_documents(btok):
    T, cap, bos = 16, 17, btok.bos
    # nothing fits: the shortest buffered document is cropped, its tail dropped
    docs = ["L" * 40, "m" * 29, "s" * 5]
    batches = data.pretrain_batches(btok, ordered(docs), 1, T, buffer_size=2)
    x, y, state = next(batches)
    row = [bos] + [ord("m")] * 16
    assert x[0].tolist() == row[:-1] and y[0].tolist() == row[1:]
    assert state == {"epoch": 0, "index": 2, "buffer": [[0, 0]], "dropped": 30 - 17}
    # "s" fits whole; then the two "L"s tie and the first one is cropped
    x, y, state = next(batches)
    row = [bos] + [ord("s")] * 5 + [bos] + [ord("L")] * 10
    assert x[0].tolist() == row[:-1] and y[0].tolist() == row[1:]
    assert state == {"epoch": 1, "index": 1, "buffer": [[1, 0]], "dropped": 13 + 41 - 11}
    # a document longer than every row: each row is its cropped head
    x, y, state = next(data.pretrain_batches(btok, ordered(["x" * 40]), 3, T, buffer_size=1))
    assert (x == [bos] + [ord("x")] * 15).all() and (y[:, -1] == ord("x")).all()
    assert state["dropped"] == 3 * (41 - cap)
    long_docs = ["y" * (20 + 7 * i) for i in range(10)]
    batches = data.pretrain_batches(btok, data.shuffled(long_docs), 2, T, buffer_size=3)
    got = list(itertools.islice(batches, 6))
    ref = nanochat_bestfit(btok, data.shuffled(long_docs), 2, T, 6, 3)
    for (gx, gy, gs), (rx, ry, rd) in zip(got, ref):
        np.testing.assert_array_equal(gx, rx)
        assert gs["dropped"] == rd
        assert (gx[:, 0] == bos).all() and (gx[:, 1:] != bos).all()  # one cropped document per row


def test_sft_packing_pads_and_masks(btok):
    B, T, n, buffer_size = 3, 160, 12, 10
    convs = [m for task in tasks.TASKS[:4]
             for m in itertools.islice(tasks.task_conversations(task, "train", seed=4), 12)]
    convs.append([{"role": "user", "content": "long " * 10},
                  {"role": "assistant", "content": "ok " * 60}])
    conversations = data.shuffled(convs, seed=6)
    got = list(itertools.islice(data.sft_batches(btok, conversations, B, T,
                                                 buffer_size=buffer_size), n))
    ref = nanochat_sft_bestfit(btok, conversations, B, T, n, buffer_size)
    sp, padded_rows = btok.special, 0
    for (x, y, state), (rx, ry, lengths) in zip(got, ref):
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(x, rx)
        np.testing.assert_array_equal(y, ry)
        assert (x[:, 0] == btok.bos).all()
        assert ((y == -1) | (y[:, :] == np.concatenate([x[:, 1:], y[:, -1:]], axis=1))).all()
        unsupervised = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                        "<|output_start|>", "<|output_end|>")
        assert not np.isin(y, [sp[s] for s in unsupervised]).any()
        assert (y != -1).any(axis=1).all() and state["dropped"] == 0
        for b, content_len in enumerate(lengths):
            # padded with BOS, and nothing supervised from the last content token on
            if content_len <= T:
                padded_rows += 1
                assert (x[b, content_len:] == btok.bos).all()
                assert (y[b, content_len - 1:] == -1).all()
    assert padded_rows > 0
    rendered = [data.render_conversation(btok, m, max_tokens=T + 1) for m in convs]
    assert max(len(r[0]) for r in rendered) == T + 1  # the long conversation was truncated to a row
    # resume exactly, from any state
    for k in (1, 4, 9):
        state = json.loads(json.dumps(got[k - 1][2]))
        resumed = data.sft_batches(btok, conversations, B, T, state=state, buffer_size=buffer_size)
        for (x, y, st), (x2, y2, st2) in zip(got[k:], itertools.islice(resumed, n - k)):
            np.testing.assert_array_equal(x, x2)
            np.testing.assert_array_equal(y, y2)
            assert st == st2


def test_write_atomic_keeps_the_old_file_when_a_write_fails(tmp_path):
    """A write that fails midway (here a str that UTF-8 cannot encode) leaves the old file as it
    was and no temporary file beside it; one that succeeds replaces it whole."""
    path = tmp_path / "f.json"
    data.write_atomic(path, "old")
    with pytest.raises(UnicodeEncodeError):
        data.write_atomic(path, "new \ud800")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.json"]
    data.write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.json"]


def test_process_batches_split_one_batch_between_processes():
    """Two processes, each packing its own document shard, hold between them the rows one
    process packs from the same two shards, side by side; and each process's loader states
    resume its own shard from the checkpoint's list of every shard's state."""
    tok = data.byte_tokenizer()
    docs = data.corpus()
    shape = (2, 4, 32)  # 2 micro-batches of 4 rows of 32 tokens
    one, states = data.process_batches(data.pretrain_batches, tok, docs, shape, data_shards=2)
    parts = [data.process_batches(data.pretrain_batches, tok, docs, shape, process=(i, 2))[0]
             for i in range(2)]
    for _ in range(3):
        inputs, targets, saved = next(one)
        halves = [next(part) for part in parts]
        assert inputs.shape == (2, 4, 32) and halves[0][0].shape == (2, 2, 32)
        np.testing.assert_array_equal(inputs, np.concatenate([h[0] for h in halves], axis=1))
        np.testing.assert_array_equal(targets, np.concatenate([h[1] for h in halves], axis=1))
        assert saved == halves[0][2] + halves[1][2]
    # process 1 resumed from the whole list: the next batch of its shard
    resumed, own = data.process_batches(data.pretrain_batches, tok, docs, shape, process=(1, 2),
                                        states=saved)
    assert own == saved[1:]
    np.testing.assert_array_equal(next(resumed)[0], next(one)[0][:, 2:])
    with pytest.raises(ValueError, match="--data-shards 3 must be a multiple of the 2"):
        data.process_batches(data.pretrain_batches, tok, docs, shape, process=(0, 2),
                             data_shards=3)


# --------------------------------------------------------------------------------------------------
# Chat format

def test_golden_render(btok, render_golden):
    convs = render_golden["conversations"]
    assert set(convs) == {"a_plain_two_turn", "b_system_message", "c_python_tool"}
    for name, c in convs.items():
        ref = c["render_conversation"]
        ids, mask = data.render_conversation(btok, c["conversation"]["messages"],
                                             max_tokens=ref["max_tokens"])
        assert ids == ref["ids"], name
        assert mask == ref["mask"], name
        assert len(ids) == len(mask) == ref["len"], name
        assert all(isinstance(i, int) for i in ids) and set(mask) <= {0, 1}
    a = convs["a_plain_two_turn"]
    prompt = data.render_for_completion(btok, a["conversation"]["messages"])
    assert prompt == a["render_for_completion_ids"]
    ids, mask = data.render_conversation(btok, a["conversation"]["messages"], max_tokens=40)
    assert ids == a["render_conversation_max_tokens_40"]["ids"] and len(ids) == 40
    assert mask == a["render_conversation_max_tokens_40"]["mask"]
    # the system message is merged into the first user turn
    b = convs["b_system_message"]["conversation"]["messages"]
    merged = [{"role": "user", "content": b[0]["content"] + "\n\n" + b[1]["content"]}] + b[2:]
    assert data.render_conversation(btok, merged) == data.render_conversation(btok, b)


BAD_CONVERSATIONS = [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ({"role": "user", "content": "hi"}, "non-empty list"),
    ([{"role": "user", "content": "hi"}, "hello"], "non-empty list"),
    ([{"role": "assistant", "content": "hi"}],
     "message 0 has role 'assistant' where 'user' is due"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "message 1 has role 'user'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "assistant", "content": "c"}],
     "message 2 has role 'assistant' where 'user' is due"),
    ([{"role": "human", "content": "a"}], "message 0 has role 'human'"),
    ([{"content": "a"}], "message 0 has role None"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "system", "content": "c"}],
     "message 2 has role 'system'"),
    ([{"role": "system", "content": "be terse"}],
     "system message must be a string followed by a user message"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}],
     "followed by a user message"),
    ([{"role": "system", "content": ["s"]}, {"role": "user", "content": "b"}],
     "followed by a user message"),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
      {"role": "user", "content": "b"}],
     "message 2 has role 'user'"),
    ([{"role": "user", "content": ""}], r"message 0 \(user\) is empty"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": " \n\t"}],
     r"message 1 \(assistant\) is empty"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": []}],
     r"message 1 \(assistant\) is empty"),
    ([{"role": "user", "content": "a"}, {"role": "assistant",
                                         "content": [{"type": "text", "text": "  "}]}],
     "is empty"),
    ([{"role": "user"}], "message 0: content must be a string"),
    ([{"role": "user", "content": 5}], "message 0: content must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}]}],
     "message 0: content must be a string"),
    ([{"role": "user", "content": "a"}, {"role": "assistant",
                                         "content": [{"type": "image", "text": "x"}]}],
     "message 1: content must be a string"),
    ([{"role": "user", "content": "a"}, {"role": "assistant",
                                         "content": [{"type": "text", "text": 3}]}],
     "message 1: content must be"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": ["just a string"]}],
     "message 1: content"),
]


@pytest.mark.parametrize("messages, match", BAD_CONVERSATIONS)
def test_render_rejects_bad_conversations(btok, messages, match):
    with pytest.raises(ValueError, match=match):
        data.render_conversation(btok, messages)


def test_render_for_completion_needs_final_assistant(btok):
    user = {"role": "user", "content": "Hi"}
    sp = btok.special
    for bad in ([], [user], [user, {"role": "assistant", "content": "a"},
                             {"role": "user", "content": "b"}], "x",
                [user, "assistant"]):
        with pytest.raises(ValueError, match="ending in the assistant message"):
            data.render_for_completion(btok, bad)
    prompt = data.render_for_completion(btok, [user, {"role": "assistant", "content": "Hello!"}])
    assert prompt == [btok.bos, sp["<|user_start|>"], 72, 105, sp["<|user_end|>"],
                      sp["<|assistant_start|>"]]
    assert prompt == data.render_conversation(btok, [user])[0] + [sp["<|assistant_start|>"]]


def test_render_masks(btok):
    sp = btok.special
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                              {"type": "python", "text": "1+1"},
                                              {"type": "python_output", "text": "2"},
                                              {"type": "text", "text": "b"}]}]
    ids, mask = data.render_conversation(btok, msgs)
    assert ids == [sp["<|bos|>"], sp["<|user_start|>"], ord("q"), sp["<|user_end|>"],
                   sp["<|assistant_start|>"],
                   ord("a"), sp["<|python_start|>"], *b"1+1", sp["<|python_end|>"],
                   sp["<|output_start|>"], ord("2"), sp["<|output_end|>"], ord("b"),
                   sp["<|assistant_end|>"]]
    assert mask == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1]
    for n in range(len(ids) + 2):
        assert data.render_conversation(btok, msgs, max_tokens=n) == (ids[:n], mask[:n])


def test_load_conversations(tmp_path):
    good = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
            [{"role": "system", "content": "s"}, {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": [{"type": "python", "text": "2+2"},
                                               {"type": "python_output", "text": "4"},
                                               {"type": "text", "text": "4"}]}]]
    path = tmp_path / "convs.jsonl"
    path.write_text(json.dumps(good[0]) + "\n\n" + json.dumps(good[1], ensure_ascii=False) + "\n")
    assert data.load_conversations(str(path)) == good
    bad = tmp_path / "bad.jsonl"
    cut = '[{"role": "user", "content": "x"\n'
    bad.write_text(json.dumps(good[0]) + "\n" + json.dumps(good[1]) + "\n" + cut)
    with pytest.raises(ValueError, match=re.escape(f"{bad}:3: invalid JSON")):
        data.load_conversations(str(bad))
    bad.write_text(json.dumps(good[0]) + "\n" + json.dumps({"messages": good[0]}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2: a conversation is a non-empty list")):
        data.load_conversations(str(bad))
    bad.write_text(json.dumps([{"role": "assistant", "content": "x"}]) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{bad}:1: message 0 has role 'assistant'")):
        data.load_conversations(str(bad))
    bad.write_text("\n  \n")
    with pytest.raises(ValueError, match="no conversations in this file"):
        data.load_conversations(str(bad))
    with pytest.raises(FileNotFoundError, match="no such conversations file"):
        data.load_conversations(str(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------------------------------
# Calculator

CALCULATOR = [
    ("1+2", 3),
    ("2*(3+4)", 14),
    ("12*34+5", 413),
    ("2,000 + 1", 2001),  # commas stripped, as in nanochat
    ("1,234,567*2", 2469134),
    ("10/4", 2.5),
    ("8/2", 4.0),
    ("7//2", 3),
    ("-5+3", -2),
    ("-(3)", -3),
    ("--3", 3),
    ("1.5*2", 3.0),
    ("0.1+0.2", 0.1 + 0.2),
    (" 5 ", 5),
    ("'strawberry'.count('r')", 3),
    ('"hello".count("l")', 2),
    ("('banana').count('an')", 2),
    ("3 ** 2", None),  # power refused: 9**9**9 would hang
    ("2**10", None),
    ("1/0", None),
    ("", None),
    ("1 +", None),
    ("()", None),
    ("abc", None),
    ("x.count('a')", None),  # names
    ("'a'.__class__.count('a')", None),  # attribute access / dunders
    ("print(1)", None),  # calls
    ("__import__('os').count('a')", None),
    ("import os", None),
    ("open('f').count('a')", None),
    ("'abc'.count('a', 1)", None),
    ("'abc'.upper().count('A')", None),
    ("'aa'.count('a').count('b')", None),
    ("'abc'.count(1)", None),
    ("'a'+'b'", None),
    ("1e3", None),
    ("9" * 4300, int("9" * 4300)),  # the engine prints results: 4300 digits is Python's str limit
    ("9" * 4301, None),
    ("*".join(["9" * 1000] * 5), None),  # a 5000-digit product cannot be printed
    ("(" * 300 + "1" + ")" * 300, None),  # too deeply nested to parse
    # too deep to evaluate (RecursionError), returns instead of hanging
    ("1" + "+1" * 100_000, None),
]


@pytest.mark.parametrize("expr, value", CALCULATOR,
                         ids=[e if len(e) <= 30 else f"{e[:8]}...{len(e)}chars"
                              for e, _ in CALCULATOR])
def test_use_calculator(expr, value):
    out = data.use_calculator(expr)
    assert out == value and type(out) is type(value)


def test_calculator_tool_state_machine():
    bt = data.byte_tokenizer()
    sp = bt.special
    tool = data.calculator_tool(bt)

    def call(row, expr):
        block = [sp["<|python_start|>"], *bt.encode(expr), sp["<|python_end|>"]]
        return [tool(row, t) for t in block]

    # outside a block: nothing
    assert tool(0, bt.encode("a")[0]) == [] and tool(0, sp["<|python_end|>"]) == []
    *before, out = call(0, "12*34")
    assert not any(before) and out == [sp["<|output_start|>"], *bt.encode("408"),
                                       sp["<|output_end|>"]]
    assert call(1, "'strawberry'.count('r')")[-1][1:-1] == bt.encode("3")
    # not a calculator expression: nothing is forced
    assert call(0, "__import__('os').system('true')")[-1] == []
    assert call(0, "2**1000000")[-1] == []
    # rows are independent: row 1 opens a block while row 0 is inside another
    tool(0, sp["<|python_start|>"])
    tool(0, bt.encode("7")[0])
    tool(1, sp["<|python_start|>"])
    tool(1, bt.encode("1")[0])
    assert tool(0, sp["<|python_end|>"])[1:-1] == bt.encode("7")
    assert tool(1, sp["<|python_end|>"])[1:-1] == bt.encode("1")


# --------------------------------------------------------------------------------------------------
# execution.py: the sandbox that runs generated programs

GOOD_PROGRAM = ("def add(a, b):\n    return a + b\n\n"
                "def check(f):\n    assert f(2, 3) == 5\n\ncheck(add)\n")


def tree_snapshot(d):
    # every path under d with its content (None for a directory), to show that nothing outside
    # changed
    return {p: None if os.path.isdir(p) else open(p, "rb").read()
            for root, dirs, files in os.walk(d)
            for p in [os.path.join(root, n) for n in dirs + files]}


def test_sandbox_correct_program_passes():
    assert execution.run_program(GOOD_PROGRAM)[:2] == (True, None)


def test_sandbox_failing_assert_fails():
    passed, error, _ = execution.run_program(GOOD_PROGRAM.replace("== 5", "== 6"))
    assert not passed and "AssertionError" in error


def test_sandbox_exit_status():
    assert execution.run_program("import sys; sys.exit(3)")[:2] == (False, "exit status 3")
    assert execution.run_program("import os; os.abort()")[:2] == (False, "killed by signal 6")


def test_sandbox_infinite_loop_times_out():
    t = time.time()
    passed, error, _ = execution.run_program("while True:\n    pass\n", timeout=1)
    assert not passed and error == "timed out after 1 s"
    assert time.time() - t < 3


@pytest.mark.parametrize("code", ["x = []\nwhile True:\n    x.append(b'x' * 10**7)\n",
                                  "bytearray(10**10)"])
def test_sandbox_unbounded_allocation_fails(code):
    t = time.time()
    passed, error, _ = execution.run_program(code, timeout=5)
    assert not passed and "MemoryError" in error
    assert time.time() - t < 3  # the memory limit stops it, not the timeout


def test_sandbox_output_flood_is_cut():
    t = time.time()
    passed, error, stdout = execution.run_program("while True:\n    print('x' * 10**6)\n",
                                                  timeout=5)
    assert not passed and "File too large" in error
    assert len(stdout) <= 10_000 and time.time() - t < 5


@pytest.mark.parametrize("code", [
    "import socket\nsocket.socket()\n",
    "import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)\n",
    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:80', timeout=1)\n",
])
def test_sandbox_network_fails(code):
    passed, error, _ = execution.run_program(code, timeout=2)
    assert not passed and "sandbox: socket." in error


def test_sandbox_network_fails_without_namespaces(monkeypatch):
    # where unshare is refused (containers, unprivileged users), the audit hook alone must still
    # stop sockets
    code = "import os\nprint(os.getuid())\nimport socket\nsocket.socket()\n"
    passed, error, stdout = execution.run_program(code, timeout=2, network_namespace=False)
    assert not passed and "sandbox: socket.__new__" in error and stdout == f"{os.getuid()}\n"
    assert execution.run_program(GOOD_PROGRAM)[:2] == (True, None)


@pytest.mark.parametrize("code", [
    "open({target!r}, 'w').write('pwned')",
    "import os\nos.close(os.open({target!r}, os.O_WRONLY | os.O_CREAT))",
    "import pathlib\npathlib.Path({target!r}).write_text('pwned')",
    # symlinks are followed
    "import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('pwned')",
    "import os\nos.mkdir({target!r})",
    "import shutil\nshutil.copy('program.py', {target!r})",
])
def test_sandbox_write_outside_fails(tmp_path, code):
    target = str(tmp_path / "new.txt")
    before = tree_snapshot(tmp_path)
    passed, error, _ = execution.run_program(code.format(target=target))
    assert not passed and "PermissionError: sandbox:" in error
    assert not os.path.exists(target) and tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("code", [
    "import os\nos.remove({victim!r})",
    "import os\nos.rename({victim!r}, 'stolen.txt')",
    "import os\nos.replace('program.py', {victim!r})",
    "import shutil\nshutil.move({victim!r}, 'stolen.txt')",
    "import shutil\nshutil.rmtree({folder!r})",
    "import os\nos.chmod({victim!r}, 0)",
    "import os\nos.truncate({victim!r}, 0)",
    "open({victim!r}, 'a').write('more')",
    # a hard link would share the inode
    "import os\nos.link({victim!r}, 'hard')\nopen('hard', 'a').write('more')",
    # fds are checked by the file they are on
    "import os\nfd = os.open({victim!r}, os.O_RDONLY)\nos.chmod(fd, 0)",
    "import os\nd = os.open({folder!r}, os.O_RDONLY)\nos.remove('victim.txt', dir_fd=d)",
])
def test_sandbox_change_outside_fails(tmp_path, code):
    folder = tmp_path / "folder"
    folder.mkdir()
    victim = folder / "victim.txt"
    victim.write_text("precious")
    os.chmod(victim, 0o644)
    before = tree_snapshot(tmp_path)
    passed, error, _ = execution.run_program(code.format(victim=str(victim), folder=str(folder)))
    assert not passed and "PermissionError: sandbox:" in error
    assert victim.read_text() == "precious" and os.stat(victim).st_mode & 0o777 == 0o644
    assert tree_snapshot(tmp_path) == before


@pytest.mark.parametrize("code", [
    "import os\nassert os.system('touch {target}') == 0",
    "import subprocess\nsubprocess.run(['touch', {target!r}])",
    "import os\nos.execv('/usr/bin/touch', ['touch', {target!r}])",
    "import os\nif os.fork() == 0:\n    open({target!r}, 'w')",
    "import multiprocessing as mp\nif __name__ == '__main__':\n"
    "    p = mp.get_context('spawn').Process(target=print)\n    p.start()\n    p.join()",
    "import ctypes\nctypes.CDLL(None).system(b'touch {target}')",
    "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",  # the parent (pytest) must survive
])
def test_sandbox_process_creation_and_ctypes_fail(tmp_path, code):
    target = str(tmp_path / "touched")
    passed, error, _ = execution.run_program(code.format(target=target))
    assert not passed and "sandbox:" in error
    assert not os.path.exists(target)


def test_sandbox_own_temp_dir_is_writable_and_removed():
    code = ("import os, shutil, tempfile\n"
            "open('data.txt', 'w').write('hello')\n"
            "assert open('data.txt').read() == 'hello'\n"
            "os.makedirs('a/b')\nos.rename('data.txt', 'a/b/data.txt')\nshutil.rmtree('a')\n"
            "with tempfile.TemporaryFile() as f:\n    f.write(b'x')\n"
            "print(os.getcwd())\n")
    passed, error, stdout = execution.run_program(code)
    assert (passed, error) == (True, None)
    cwd = stdout.strip()
    assert cwd.startswith("/") and not os.path.exists(cwd)


def test_sandbox_ordinary_imports_work():
    code = ("import math, itertools, collections, re, json, functools, heapq, string, typing\n"
            "import fractions, decimal\n"
            "import random, hashlib, bisect, statistics, datetime, copy, operator, sys\n"
            "assert hashlib.sha256(b'x').hexdigest().startswith('2d711642')\n"
            "assert json.loads(json.dumps({'a': [1, 2]})) == {'a': [1, 2]}\n"
            "sys.setrecursionlimit(10_000)\n"
            "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
            "assert depth(5_000) == 5_000\n")
    assert execution.run_program(code)[:2] == (True, None)


def test_sandbox_run_goes_on(tmp_path):
    # after every kind of failure in a row, the parent is fine and a normal program still passes
    bad = ["while True: pass", "bytearray(10**10)", "import socket; socket.socket()",
           "import ctypes", f"open({str(tmp_path / 'x')!r}, 'w')",
           "import os; os.system('true')", "raise SystemExit(7)"]
    for code in bad:
        assert execution.run_program(code, timeout=1)[0] is False
    assert execution.run_program(GOOD_PROGRAM)[:2] == (True, None)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------------
# tasks.py: the synthetic tasks, the SFT mixture, the held-out questions

def task_key(task, messages):
    """The item a task conversation is about (what the train/test split hashes)."""
    question, answer = messages[0]["content"], messages[1]["content"]
    if task == "identity":
        return question
    if task == "arithmetic":
        return answer[0]["text"]
    if task == "spelling":
        return answer.replace("-", "")
    if task == "counting":
        return re.match(r"'(\w+)'", answer[0]["text"])[1]
    # the qualified name, the first dotted word
    return re.search(r"[A-Za-z_]\w*(?:\.\w+)+", question)[0]


def reference_completion(btok, messages):
    """The decoded tokens after <|assistant_start|>: what a model that got it right would generate.
    """
    ids, _ = data.render_conversation(btok, messages)
    return btok.decode(ids[len(ids) - ids[::-1].index(btok.special["<|assistant_start|>"]):])


@pytest.mark.parametrize("task", tasks.TASKS)
def test_task_generator_and_checker(btok, task):
    def take(split, seed, n):
        return list(itertools.islice(tasks.task_conversations(task, split, seed), n))

    train = take("train", 0, 300)
    assert train[:30] == take("train", 0, 30)  # deterministic per seed
    assert train[:30] != take("train", 1, 30)
    test = take("test", 0, 100)
    train_keys, test_keys = {task_key(task, m) for m in train}, {task_key(task, m) for m in test}
    assert train_keys and test_keys and not train_keys & test_keys  # disjoint items
    assert len(test_keys) < len(train_keys)
    for messages in train[:100] + test[:30]:
        assert [m["role"] for m in messages] == ["user", "assistant"]
        ids, mask = data.render_conversation(btok, messages)
        assert ids[-1] == btok.special["<|assistant_end|>"] and mask[-1] == 1 and sum(mask) > 1
        generated = reference_completion(btok, messages)
        assert generated.endswith("<|assistant_end|>")
        assert tasks.check(messages, generated)
        ref = messages[-1]["content"]
        numeric = isinstance(ref, list)
        if numeric:
            value = ref[1]["text"]
            assert tasks.check(messages, f"The answer is {value}.")
            assert not tasks.check(messages,
                                   generated.replace("<|assistant_end|>", "") + " -12345678")
            assert not tasks.check(messages, "I don't know.")
            tool_part = generated[:generated.rindex("<|output_end|>") + len("<|output_end|>")]
            # only the final text counts
            assert not tasks.check(messages, tool_part + "No idea.<|assistant_end|>")
        else:
            assert tasks.check(messages, f"  {ref}\n")
            assert not tasks.check(messages, ref + " Extra.")
            assert not tasks.check(messages, "wrong " + ref)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.task_conversations(task, "val")
    with pytest.raises(ValueError, match="unknown task"):
        tasks.task_conversations("poetry", "train")


def test_task_contents():
    take = lambda task, n: list(itertools.islice(tasks.task_conversations(task, "train"), n))
    ops, digits, phrasings = {"+": operator.add, "-": operator.sub, "*": operator.mul,
                              "/": operator.truediv}, [], set()
    for (user, assistant) in take("arithmetic", 400):
        a, op, b = re.fullmatch(r"(\d+)([-+*/])(\d+)", assistant["content"][0]["text"]).groups()
        value = ops[op](int(a), int(b))
        shown = int(value) if op == "/" else value
        assert op != "/" or value == shown  # exact divisions only
        assert [p["type"] for p in assistant["content"]] == ["python", "python_output", "text"]
        assert assistant["content"][1]["text"] == str(value)
        assert assistant["content"][2]["text"] == f"{a} {op} {b} = {shown}"
        assert re.search(rf"(?<!\d){a}(?!\d)", user["content"])
        assert re.search(rf"(?<!\d){b}(?!\d)", user["content"])
        digits += [len(a), len(b)]
        phrasings.add(re.sub(r"\d+", "N", user["content"].lower()))
    assert collections.Counter(digits).keys() == {1, 2, 3, 4}
    assert np.mean(np.array(digits) <= 2) > 0.6
    assert len(phrasings) > 300  # hardly a phrasing twice in 400
    words = []
    for (user, assistant) in take("counting", 200):
        w, c = re.fullmatch(r"'([a-z]+)'\.count\('([a-z])'\)",
                            assistant["content"][0]["text"]).groups()
        by_calculator = data.use_calculator(f"'{w}'.count('{c}')")
        assert assistant["content"][1]["text"] == str(w.count(c)) == str(by_calculator)
        assert re.findall(r"\d+", assistant["content"][2]["text"])[-1] == str(w.count(c))
        assert re.search(rf"\b{w}\b", user["content"]) and re.search(rf"\b{c}", user["content"])
        words.append(w)
    for (user, assistant) in take("spelling", 200):
        w = assistant["content"].replace("-", "")
        assert assistant["content"] == "-".join(w)
        assert w.isalpha() and w.islower() and 3 <= len(w) <= 10
        assert re.search(rf"\b{w}\b", user["content"])
        words.append(w)
    # broad, made-up words too
    assert len(set(words)) > 350 and not set(words) <= set(tasks._corpus_words())
    # doubled letters are common
    assert np.mean([bool(re.search(r"(.)\1", w)) for w in words]) > 0.15
    # reading: the answer is the paragraph's first sentence
    for (user, assistant) in take("docstring", 100):
        sentence = assistant["content"]
        assert sentence in user["content"] and sentence[-1] in ".!?"
        assert not re.search(r"[.!?]\s", sentence)
    for (user, assistant) in take("identity", 50):
        assert "nanochat" in assistant["content"]


def test_sft_mixture_keeps_pretraining_text():
    docs = data.shuffled([f"document {i}" for i in range(5)])
    mixture = tasks.sft_mixture(3, extra=["mine"], documents=docs, text_every=4)
    items = list(itertools.islice(mixture(0), 1 + 40))
    positional = tasks.sft_mixture(3, ["mine"], docs, 4)
    assert items[0] == "mine" and items[1:] == list(itertools.islice(positional(0), 1, 41))
    texts = [i for i, x in enumerate(items[1:]) if isinstance(x, str)]
    assert texts == [4, 9, 14, 19, 24, 29, 34, 39]  # a document after every 4 conversations
    # cycles through the corpus
    assert set(items[1 + t] for t in texts) == {f"document {i}" for i in range(5)}
    kinds = collections.Counter(task_of(m) for m in items[1:] if not isinstance(m, str))
    assert set(kinds) <= set(tasks.MIXTURE)
    assert not any(isinstance(x, str) for x in itertools.islice(tasks.sft_mixture(3)(0), 50))


def task_of(messages):
    answer = messages[1]["content"]
    if isinstance(answer, list):
        return "counting" if ".count(" in answer[0]["text"] else "arithmetic"
    if re.fullmatch(r"[a-z](-[a-z])+", answer):
        return "spelling"
    return "identity" if "nanochat" in answer else "docstring"


def test_heldout_questions_and_grading(tmp_path):
    questions = tasks.load_questions(os.path.join(TESTDATA, "heldout_questions.jsonl"))
    counts = collections.Counter(q["skill"] for q in questions)
    assert len(questions) >= 40 and set(counts) == {"arithmetic", "counting", "spelling",
                                                    "identity"}
    assert tasks.grade("arithmetic", "47",
                       "<|python_start|>12+35<|python_end|><|output_start|>47<|output_end|>"
                      "12 + 35 = 47<|assistant_end|>")
    assert tasks.grade("arithmetic", "12", "84 / 7 = 12.0")
    assert not tasks.grade("arithmetic", "12", "13")
    assert not tasks.grade("arithmetic", "47", "<|output_start|>47<|output_end|>I don't know.")
    assert tasks.grade("counting", "3", "'r' appears 3 time(s) in 'strawberry'.")
    assert not tasks.grade("counting", "3", "")
    assert tasks.grade("spelling", "coffee", "c-o-f-f-e-e")
    assert not tasks.grade("spelling", "coffee", "c-o-f-e-e")
    assert tasks.grade("identity", "nanochat", "I'm nanochat, ...")
    assert not tasks.grade("identity", "nanochat", "A bot.")
    with pytest.raises(ValueError, match=r"README.md:1: invalid JSON"):
        tasks.load_questions(os.path.join(TESTDATA, "..", "README.md"))
    with pytest.raises(ValueError, match=r":1: want \{"):
        (tmp_path / "q.jsonl").write_text('{"skill": "poetry", "question": "?", "answer": "!"}\n')
        tasks.load_questions(tmp_path / "q.jsonl")


# --------------------------------------------------------------------------------------------------
# torch_files.py: nanochat's .pt files read without running their pickles

class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_pickles_are_refused(tmp_path):
    marker = tmp_path / "pwned"
    # an allowed global first
    evil = pickle.dumps(collections.OrderedDict({"w": _Evil(marker)}), protocol=2)
    with zipfile.ZipFile(tmp_path / "model_000001.pt", "w") as z:
        z.writestr("model_000001/data.pkl", evil)
        z.writestr("model_000001/byteorder", "little")
    with pytest.raises(ValueError, match=r"model_000001.pt: refusing to load posix\.system"):
        torch_files.read_torch_state_dict(tmp_path / "model_000001.pt")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        checkpoint.load_nanochat_tokenizer(tmp_path / "tokenizer" / "tokenizer.pkl")
    meta = {"model_config": dataclasses.asdict(CHAT_CFG)}
    (tmp_path / "meta_000001.json").write_text(json.dumps(meta))
    code, _, err = run_chat(["--nanochat-checkpoint", str(tmp_path)])
    assert code == 1 and "refusing to load posix.system" in err and len(err.splitlines()) == 1
    assert not marker.exists()  # nothing ran


def test_damaged_torch_checkpoints_are_one_line_errors(tmp_path):
    """Each way a nanochat .pt can be broken, built here from the real one: a ValueError naming the
    file (chat.py prints it as one line), never a traceback or a half-read model."""
    with zipfile.ZipFile(NANOCHAT_D2 / "model_000100.pt") as z:
        files = {n: z.read(n) for n in z.namelist()}

    def broken(name, change=None, drop=None, raw=None):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(NANOCHAT_D2 / "meta_000100.json", d)
        if raw is not None:
            (d / "model_000100.pt").write_bytes(raw)
        else:
            with zipfile.ZipFile(d / "model_000100.pt", "w") as z:
                for n, b in files.items():
                    if n != drop:
                        z.writestr(n, change(n, b) if change else b)
        return d

    pkl, store = "model_000100/data.pkl", "model_000100/data/0"
    cases = [(broken("notzip", raw=b"not a zip at all"), "a damaged torch checkpoint (BadZipFile"),
             (broken("nopkl", drop=pkl), "not a torch zip checkpoint (no data.pkl)"),
             (broken("big", lambda n, b: b"big" if n.endswith("byteorder") else b),
              "a big-endian checkpoint"),
             (broken("kind", lambda n, b: b if n != pkl else
                     b.replace(b"torch\nFloatStorage", b"collections\nOrderedDict")),
              "a storage of unknown type"),
             (broken("short", lambda n, b: b[:-4] if n == store else b),
              "storage 0 is shorter than its"),
             (broken("gone", drop=store), "a damaged torch checkpoint (KeyError"),
             (broken("cut", lambda n, b: b[:len(b) // 2] if n == pkl else b),
              "a damaged torch checkpoint")]
    for d, message in cases:
        with pytest.raises(ValueError, match=re.escape(f"{d / 'model_000100.pt'}: {message}")):
            torch_files.read_torch_state_dict(d / "model_000100.pt")
    with pytest.raises(pickle.UnpicklingError, match="a tensor runs past its storage"):
        torch_files._rebuild_tensor(np.zeros(4, np.float32), 2, (3,), (1,))
    # a whole checkpoint, but no tokenizer above it, then a tokenizer of another size
    fine = broken("fine")
    with pytest.raises(FileNotFoundError,
                       match="no tokenizer/tokenizer.pkl here or in the 3 directories above"):
        checkpoint.load_nanochat(str(fine))
    (tmp_path / "tokenizer").mkdir()
    ranks = {bytes([i]): i for i in range(256)}
    specials = {s: 256 + i for i, s in enumerate(data.SPECIAL_TOKENS)}
    small = tiktoken.Encoding("small", pat_str=data.SPLIT_PATTERN, mergeable_ranks=ranks,
                              special_tokens=specials)
    (tmp_path / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(small))
    with pytest.raises(ValueError, match="265 tokens, but the model has vocab_size 512"):
        checkpoint.load_nanochat(str(fine))
    code, _, err = run_chat(["--nanochat-checkpoint", str(tmp_path / "short")])
    assert code == 1 and err.count("\n") == 1 and "storage 0 is shorter" in err


# --------------------------------------------------------------------------------------------------
# checkpoint.py: nanochat's state_dict, our checkpoints, real nanochat checkpoints, export

def test_state_dict_round_trip():
    params = random_params(TINY, 0)
    sd = checkpoint.to_nanochat_state_dict(params, TINY)
    assert sd["transformer.h.0.attn.c_k.weight"].shape == (16, 32)  # (out, in)
    assert sd["lm_head.weight"].shape == (128, 32) and "value_embeds.1.weight" not in sd
    back = checkpoint.from_nanochat_state_dict({"_orig_mod." + k: v for k, v in sd.items()}, TINY)
    assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, back, params)))
    again = checkpoint.to_nanochat_state_dict(back, TINY)
    assert all(np.array_equal(again[k], sd[k]) for k in sd)


def test_state_dict_errors():
    sd = checkpoint.to_nanochat_state_dict(random_params(TINY, 0), TINY)
    with pytest.raises(ValueError, match="missing .*lm_head"):
        checkpoint.from_nanochat_state_dict({k: v for k, v in sd.items() if k != "lm_head.weight"},
                                            TINY)
    with pytest.raises(ValueError, match="shape"):
        checkpoint.from_nanochat_state_dict({**sd, "transformer.wte.weight": np.zeros((64, 32))},
                                            TINY)


def test_checkpoint_round_trip_and_atomic(tmp_path):
    tiny = random_params(TINY, 0)
    opt = init_opt(tiny)
    for step in (1, 2, 3, 4):
        path = checkpoint.save_checkpoint(str(tmp_path), step, tiny, opt, {"step": step},
                                          keep=2)
    kept = [os.path.basename(d) for d in checkpoint.checkpoint_dirs(str(tmp_path))]
    assert kept == ["step_000003", "step_000004"]
    params, opt2, meta = checkpoint.load_checkpoint(path)
    assert meta == {"step": 4} and all(jax.tree.leaves(jax.tree.map(np.array_equal, params, tiny)))
    assert int(opt2["step"]) == 0 and all(jax.tree.leaves(jax.tree.map(np.array_equal, opt2, opt)))
    # a write that dies midway leaves the previous checkpoint intact
    with pytest.raises(TypeError):
        checkpoint.save_checkpoint(str(tmp_path), 5, {"bad": object()}, None, {})
    # no half-written step 5 left
    assert sorted(os.listdir(tmp_path)) == ["step_000003", "step_000004"]
    unwritable = lambda p: open(os.path.join(p, "no_such_dir", "tokenizer.json"), "w")
    # nor when an extra file (train.py's tokenizer.json) fails
    with pytest.raises(FileNotFoundError):
        checkpoint.save_checkpoint(str(tmp_path), 5, tiny, None, {},
                                   files={"tokenizer.json": unwritable})
    assert sorted(os.listdir(tmp_path)) == ["step_000003", "step_000004"]
    assert checkpoint.latest_checkpoint(str(tmp_path), ("",)) == path
    assert checkpoint.load_checkpoint(path)[2] == {"step": 4}
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        checkpoint.load_checkpoint(str(tmp_path))


def test_a_checkpoint_is_found_from_a_step_a_stage_or_a_root(tmp_path):
    """checkpoint.load_model (chat.py's and evaluate.py's --checkpoint) takes a step directory, a
    stage folder (its newest step) or a root (the newest step of its last stage: RL, then SFT, then
    base)."""
    tiny = random_params(TINY, 0)
    tok, root = data.byte_tokenizer(), tmp_path / "checkpoints"
    meta = {"config": dataclasses.asdict(TINY), "tokenizer": "tokenizer.json"}
    for stage, step in (("base", 5), ("base", 9), ("sft", 3)):
        scaled = jax.tree.map(lambda w: w * step, tiny)  # each step's weights tell it apart
        checkpoint.save_checkpoint(str(root / stage), step, scaled, None, meta,
                                   files={"tokenizer.json": tok.save})
    for where, step in ((root / "base" / "step_000005", 5), (root / "base", 9), (root, 3)):
        assert checkpoint.find_step(str(where)).endswith(f"step_{step:06d}")
        params, cfg, loaded = checkpoint.load_model(str(where))
        np.testing.assert_array_equal(params["wte"], tiny["wte"] * step)
        assert cfg == TINY and loaded.tokens == tok.tokens
    with pytest.raises(FileNotFoundError,
                       match=r"no checkpoint in .*empty/: pass a step directory, a stage folder"):
        checkpoint.load_model(str(tmp_path / "empty"))


@pytest.mark.slow  # five saving processes, each killed after a wait
def test_damaged_checkpoint_is_skipped_by_resume_and_kill9_never_leaves_half_a_step(tmp_path):
    """A damaged params.msgpack or meta.json is a one-line error, and --resume's loader falls back
    to the previous step; a process killed at random moments while saving (kill -9) leaves every
    step_* complete or absent."""
    tiny = random_params(TINY, 0)
    root = str(tmp_path / "ck")
    for step in (1, 2):
        checkpoint.save_checkpoint(root, step, tiny, None, {"step": step})
    newest = os.path.join(root, "step_000002")
    raw = open(os.path.join(newest, "params.msgpack"), "rb").read()
    # truncated; a byte msgpack never uses
    for damage in (raw[:len(raw) // 2], raw[:100] + b"\xc1" + raw[101:]):
        open(os.path.join(newest, "params.msgpack"), "wb").write(damage)
        with pytest.raises(ValueError,
                           match="params.msgpack: damaged .*; use an earlier checkpoint"):
            checkpoint.load_checkpoint(newest)
        said = []
        path, params, _, meta = checkpoint.load_newest(root, log=said.append)
        assert path.endswith("step_000001") and meta == {"step": 1}
        assert said[0].startswith(f"skipping {newest}")
    open(os.path.join(root, "step_000001", "meta.json"), "w").write('{"step": ')
    with pytest.raises(ValueError, match="meta.json: damaged"):
        checkpoint.load_checkpoint(os.path.join(root, "step_000001"))
    assert checkpoint.load_newest(root, log=lambda *_: None) is None
    unknown = r"meta.json: config fields \['n_expert'\] are unknown to this version"
    with pytest.raises(ValueError, match=unknown):
        checkpoint.config_from({**dataclasses.asdict(TINY), "n_expert": 8}, "ck/meta.json")
    saver = (f"import checkpoint, numpy as np\n"
             f"big = {{'w': np.arange(4_000_000, dtype=np.float32)}}\n"
             f"for step in range(10**6):\n"
             f"    checkpoint.save_checkpoint({root!r}, step % 3 + 10, big, big, "
             f"{{'step': step}})\n")
    shutil.rmtree(root)
    for delay in (0.6, 0.9, 1.3, 1.7, 2.2, None):
        p = subprocess.Popen([sys.executable, "-c", saver], cwd=pathlib.Path(__file__).parent,
                             env=child_env())
        if delay is None:  # the last one once a save is whole: a loaded machine imports slowly
            deadline = time.time() + 120
            while not checkpoint.checkpoint_dirs(root) and time.time() < deadline:
                time.sleep(0.05)
        else:
            time.sleep(delay)
        p.kill()  # SIGKILL, wherever the save is
        p.wait()
        for step_dir in checkpoint.checkpoint_dirs(root):  # whatever is there is whole
            params, opt, meta = checkpoint.load_checkpoint(step_dir)
            assert params["w"].shape == (4_000_000,) and float(params["w"][-1]) == 3_999_999
            assert opt is not None
    assert checkpoint.checkpoint_dirs(root)  # some saves completed
    # the next save sweeps what the killed ones left
    checkpoint.save_checkpoint(root, 99, tiny, None, {})
    assert all(re.fullmatch(r"step_\d{6}", n) for n in os.listdir(root))


# --------------------------------------------------------------------------------------------------
# Real nanochat checkpoints

@pytest.mark.usefixtures("on_cpu")
def test_nanochat_checkpoint_import():
    root = TESTDATA / "nanochat_checkpoint"
    e = np.load(root / "expected.npz")
    # the NANOCHAT_BASE_DIR: finds base_checkpoints/d2
    params, cfg, tk = checkpoint.load_nanochat(str(root))
    assert cfg == NANOCHAT_D2_CFG
    assert [tk.bos] + tk.encode("Return the") == e["prompt_ids"][0].tolist() and tk.bos == 503
    # causal: pads are harmless
    batch = np.concatenate([e["text_ids"], np.pad(e["prompt_ids"], ((0, 0), (0, 59)))])
    logits = np.asarray(forward(params, batch, cfg))
    np.testing.assert_allclose(logits[1:, :5], e["logits"], rtol=0, atol=5e-5)
    np.testing.assert_allclose(logits[:1], e["text_logits"], rtol=0, atol=5e-5)
    lse = np.log(np.exp(logits[0, :-1].astype(np.float64)).sum(-1))
    nll = lse - logits[0, np.arange(63), e["text_ids"][0, 1:]]
    np.testing.assert_allclose(nll.mean(), e["text_loss"], rtol=0, atol=1e-5)
    tokens, _ = generated(params, cfg, e["prompt_ids"][0], max_tokens=20)
    assert tokens[:, 0].tolist() == e["greedy_ids"].tolist() == e["naive_greedy_ids"].tolist()
    assert tk.decode(e["prompt_ids"][0].tolist() + tokens[:, 0].tolist()) == \
        "<|bos|>Return the string obtained by replacing the leftmost\nnon"
    # the model directory itself works too
    again, _, _ = checkpoint.load_nanochat(str(NANOCHAT_D2))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, again, params)))
    sd = torch_files.read_torch_state_dict(NANOCHAT_D2 / "model_000100.pt")
    assert sd["transformer.wte.weight"].dtype.name == "bfloat16"
    assert sd["lm_head.weight"].dtype == np.float32


# --------------------------------------------------------------------------------------------------
# Export to nanochat: python checkpoint.py export SOURCE DEST (docs/export.md)

def pickle_globals(raw):
    """The (module, name) of each GLOBAL and STACK_GLOBAL in a pickle (STACK_GLOBAL's from the
    two strings pushed before it)."""
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(raw):
        if op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add(tuple(strings[-2:]))
        elif isinstance(arg, str):
            strings.append(arg)
    return found


def test_export_round_trips_our_checkpoint(tmp_path, bpe_golden, capsys):
    """An SFT checkpoint of ours (testdata's nanochat config, so that the programs its import test
    compiled serve, with our own 512-token tokenizer), exported from its root as `checkpoint.py
    export` does, reads back with load_nanochat bit for bit: weights, tokenizer, logits, greedy
    reply; the meta holds nanochat's GPTConfig and what its scripts read. --embeddings bfloat16
    rounds only wte and value_embeds, and says so."""
    cfg = NANOCHAT_D2_CFG
    tok = data.train_tokenizer([bpe_golden["text"], MULTILINGUAL], cfg.vocab_size)
    params = random_params(cfg, 11)
    flags = {"device_batch_size": 4, "total_batch_size": -1, "embedding_lr": 0.3}
    meta = {"stage": "sft", "step": 7, "config": dataclasses.asdict(cfg), "val_bpb": 1.25,
            "tokenizer": "tokenizer.json", "args": flags}
    root, dest = tmp_path / "checkpoints", tmp_path / "nanochat"
    checkpoint.save_checkpoint(str(root / "sft"), 7, params, None, meta,
                               files={"tokenizer.json": tok.save})
    path = checkpoint.main(["export", str(root), str(dest)])
    assert path == str(dest / "chatsft_checkpoints" / "d2" / "model_000007.pt")
    got, got_cfg, got_tok = checkpoint.load_nanochat(str(dest))
    assert got_cfg == cfg
    assert all(jax.tree.leaves(jax.tree.map(
        lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), got, params)))
    assert (got_tok.tokens, got_tok.pat_str, got_tok.special) == \
        (tok.tokens, tok.pat_str, tok.special)
    assert any(t[0] >= 0x80 for t in tok.tokens[256:])  # merges of UTF-8 bytes, as bytes
    written = json.loads((dest / "chatsft_checkpoints" / "d2" / "meta_000007.json").read_text())
    gpt_config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "compute_dtype"}
    assert written == {"step": 7, "val_bpb": 1.25, "model_config": gpt_config, "user_config": flags,
                       "device_batch_size": 4, "max_seq_len": 128}  # no -1 batch: unknown
    ids = np.array([[tok.bos, *tok.encode("Réponse courte, 東京 " * 9)][:64]] * 2)
    np.testing.assert_array_equal(forward(got, ids, cfg), forward(params, ids, cfg))
    prompt = [tok.bos, *tok.encode("Return the string")][:5]  # 5 tokens, as the import test's
    reply = generated(got, cfg, prompt, max_tokens=20)[0][:, 0].tolist()
    assert reply == generated(params, cfg, prompt, max_tokens=20)[0][:, 0].tolist()
    assert got_tok.decode(reply) == tok.decode(reply)
    capsys.readouterr()
    checkpoint.export_nanochat(params, cfg, tok, str(dest), "sft", 7, force=True,
                               embeddings="bfloat16")
    said = capsys.readouterr().out.splitlines()
    assert said[0] == ("rounded value_embeds.1.weight, transformer.wte.weight from float32 to "
                       "bfloat16 (--embeddings bfloat16)") and len(said) == 2
    sd = torch_files.read_torch_state_dict(path)
    assert {k for k, v in sd.items() if v.dtype.name == "bfloat16"} == \
        {"transformer.wte.weight", "value_embeds.1.weight"}
    rounded, _, _ = checkpoint.load_nanochat(str(dest))
    to_bf16 = lambda a: np.asarray(a).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(rounded["wte"], to_bf16(params["wte"]))
    np.testing.assert_array_equal(rounded["value_embeds"], to_bf16(params["value_embeds"]))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, rounded["h"], params["h"])))


def test_export_of_nanochat_checkpoint_gives_its_bytes_back(tmp_path, capsys):
    """testdata's real nanochat checkpoint, imported and exported again: every tensor's bytes,
    dtype (bf16 embeddings: they are exact in bf16) and shape, the meta's model_config and the
    keys nanochat's scripts read, tokenizer.pkl byte for byte and token_bytes.pt's tensor; zips
    that zipfile tests clean, with the real files' members in their order, each 64-byte aligned."""
    real = TESTDATA / "nanochat_checkpoint"
    params, cfg, tk, stage, step, meta = checkpoint.load_for_export(str(real))
    assert (stage, step) == ("base", 100)
    path = checkpoint.export_nanochat(params, cfg, tk, str(tmp_path), stage, step,
                                      meta_extra=meta)
    said = capsys.readouterr().out.splitlines()
    assert said == [f"{path}: base step 100, bfloat16 embeddings"]
    a, b = torch_files.read_torch_state_dict(NANOCHAT_D2 / "model_000100.pt"), \
        torch_files.read_torch_state_dict(path)
    assert set(a) == set(b)
    for k in a:
        assert (a[k].dtype, a[k].shape, a[k].tobytes()) == \
            (b[k].dtype, b[k].shape, b[k].tobytes()), k
    written = json.loads((tmp_path / "base_checkpoints" / "d2" / "meta_000100.json").read_text())
    assert list(written) == ["step", "val_bpb", "model_config", "user_config", "device_batch_size",
                             "max_seq_len", "total_batch_size"]  # not the resume-only keys
    assert written == {k: meta[k] for k in written}
    ours, theirs = tmp_path / "tokenizer", real / "tokenizer"
    assert (ours / "tokenizer.pkl").read_bytes() == (theirs / "tokenizer.pkl").read_bytes()
    sizes = torch_files.read_torch_tensor(ours / "token_bytes.pt")
    assert sizes.dtype == np.int32 and np.array_equal(
        sizes, torch_files.read_torch_tensor(theirs / "token_bytes.pt"))
    for mine, real_file in [(path, NANOCHAT_D2 / "model_000100.pt"),
                            (ours / "token_bytes.pt", theirs / "token_bytes.pt")]:
        with zipfile.ZipFile(mine) as z, zipfile.ZipFile(real_file) as r:
            assert z.testzip() is None
            assert [n.split("/", 1)[1] for n in z.namelist()] == \
                [n.split("/", 1)[1] for n in r.namelist()]
            assert z.namelist()[0].split("/")[0] == r.namelist()[0].split("/")[0]
            for n in z.namelist()[1:4] + z.namelist()[-2:-1]:  # .format_version ... version
                assert z.read(n) == r.read(n)
            raw = pathlib.Path(mine).read_bytes()
            for info in z.infolist():  # the local header's own name and extra lengths
                name, extra = struct.unpack("<HH", raw[info.header_offset + 26:][:4])
                assert (info.header_offset + 30 + name + extra) % 64 == 0, info.filename


def test_exported_pickles_name_only_what_the_restricted_readers_allow(tmp_path):
    """model_*.pt and token_bytes.pt's data.pkl name only TORCH_GLOBALS (the globals torch's own
    weights_only loader allows for a state_dict), tokenizer.pkl only tiktoken.core.Encoding."""
    real = TESTDATA / "nanochat_checkpoint"
    params, cfg, tk, stage, step, meta = checkpoint.load_for_export(str(real))
    checkpoint.export_nanochat(params, cfg, tk, str(tmp_path), stage, step, meta_extra=meta,
                               embeddings="float32")
    seen = {}
    for pt in ("base_checkpoints/d2/model_000100.pt", "tokenizer/token_bytes.pt"):
        with zipfile.ZipFile(tmp_path / pt) as z:
            seen[pt] = pickle_globals(z.read(z.namelist()[0]))
        assert seen[pt] <= set(torch_files.TORCH_GLOBALS), pt
    assert seen["base_checkpoints/d2/model_000100.pt"] == {
        ("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"),
        ("torch", "FloatStorage")}  # --embeddings float32: no bf16 storage
    assert ("torch", "IntStorage") in seen["tokenizer/token_bytes.pt"]
    raw = (tmp_path / "tokenizer" / "tokenizer.pkl").read_bytes()
    assert pickle_globals(raw) == {("tiktoken.core", "Encoding")}
    assert pickle.loads(raw).encode("Return the") == tk.encode("Return the")  # tiktoken reads it


def test_export_refuses_bad_input_and_leaves_dest_as_it_was(tmp_path, monkeypatch):
    """An unknown source, a step that is there (no force), a tokenizer whose vocabulary is not the
    model's, another tokenizer in dest, an unknown stage, a write failing midway: each a one-line
    error, and dest (or its absence) as it was, no temporary tree left."""
    real = TESTDATA / "nanochat_checkpoint"
    params, cfg, tk, _, _, meta = checkpoint.load_for_export(str(real))
    dest = tmp_path / "dest"
    export = functools.partial(checkpoint.export_nanochat, params, cfg)
    export(tk, str(dest), "base", 100)

    def listing():
        return sorted((str(p.relative_to(tmp_path)), p.stat().st_mtime_ns)
                      for p in tmp_path.rglob("*"))

    def broken_write(path, state_dict, archive=None):
        if path.endswith("model_000200.pt"):
            raise OSError("disk full")
        write(path, state_dict, archive)

    before, write = listing(), torch_files.write_torch_state_dict
    another = data.Tokenizer(tk.tokens, r"\s+|\S+")  # the same tokens, split otherwise
    cases = [(lambda: checkpoint.load_for_export(str(tmp_path / "nowhere")), FileNotFoundError,
              "no checkpoint in"),
             (lambda: export(tk, str(dest), "base", 100), ValueError,
              "model_000100.pt exists: pass --force"),
             (lambda: export(data.byte_tokenizer(), str(dest), "base", 5), ValueError,
              "the tokenizer has 265 tokens but the model vocab_size 512"),
             (lambda: export(another, str(dest), "sft", 5), ValueError,
              "tokenizer.pkl is another tokenizer than this model's"),
             (lambda: export(tk, str(dest), "mid", 5), ValueError, "stage 'mid'"),
             (lambda: export(tk, str(dest), "base", 200, force=True), OSError, "disk full"),
             (lambda: export(tk, str(tmp_path / "new"), "base", 200), OSError, "disk full")]
    monkeypatch.setattr(torch_files, "write_torch_state_dict", broken_write)
    for call, error, message in cases:
        with pytest.raises(error, match=message) as e:
            call()
        assert "\n" not in str(e.value) and listing() == before, message


@pytest.mark.slow  # four checkpoint.py processes
def test_export_cli(tmp_path):
    """`python checkpoint.py export` from a stage folder of ours: one line saying what it wrote;
    again, a step that exists, an unknown source, a checkpoint whose tokenizer is not its model's:
    exit code 1, one stderr line each, dest unchanged."""
    meta = {"stage": "base", "step": 3, "config": dataclasses.asdict(CHAT_CFG),
            "tokenizer": "tokenizer.json"}
    bt, other = data.byte_tokenizer(), data.Tokenizer([bytes([i]) for i in range(256)] + [b"ab"])
    for run, t in (("good", bt), ("bad", other)):  # "bad": 266 tokens for a 265-token model
        checkpoint.save_checkpoint(str(tmp_path / run / "base"), 3, random_params(CHAT_CFG, 1),
                                   None, meta, files={"tokenizer.json": t.save})
    dest = tmp_path / "dest"

    def export(*args):
        return subprocess.run([sys.executable, "checkpoint.py", "export", *args],
                              cwd=pathlib.Path(__file__).parent, capture_output=True, text=True,
                              timeout=300, env=child_env())
    r = export(str(tmp_path / "good" / "base"), str(dest))
    assert r.returncode == 0 and r.stdout == f"{dest}/base_checkpoints/d2/model_000003.pt: base " \
        "step 3, float32 embeddings\n", r.stderr
    listing = sorted((p, p.stat().st_mtime_ns) for p in dest.rglob("*"))
    for args, message in [((str(tmp_path / "good"), str(dest)), "model_000003.pt exists"),
                          ((str(tmp_path / "nowhere"), str(dest)), "no checkpoint in"),
                          ((str(tmp_path / "bad"), str(dest), "--model-tag", "x"),
                           "the tokenizer has 266 tokens but the model vocab_size 265")]:
        r = export(*args)
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and message in r.stderr, \
            r.stderr
        assert sorted((p, p.stat().st_mtime_ns) for p in dest.rglob("*")) == listing


# --------------------------------------------------------------------------------------------------
# engine.py: the reference generate (a KV cache, sampling, tools) against nanochat's Engine
# and the full forward; the slot engine, its KV cache (kvcache.py) among it

# windows [128, 256]: a 160-token generation crosses the short one
WINDOW_CFG = config(sequence_len=256, n_layer=2, n_head=2, n_kv_head=1)
# a ring and pages, heads of one TPU tile's 128 lanes: the shapes the TPU's kernels take
LANES_CFG = config(sequence_len=256, n_layer=2, n_head=1, n_kv_head=1, n_embd=128)
GREEDY = (0.0, 0, 1.0)  # engine.prefill's and decode's settings: temperature, top_k, top_p


def generated(params, cfg, prompt, num_samples=1, tool=None, **sampling):
    """(token columns, mask columns) of one generate call, as (steps, num_samples) arrays; sampling:
    engine.Sampling's fields (greedy, 24 tokens unless given)."""
    sampling = engine.Sampling(**{"max_tokens": 24, "temperature": 0.0, **sampling})
    steps = list(engine.generate(params, cfg, list(prompt), sampling, num_samples=num_samples,
                                 tool=tool))
    return np.array([c for c, _ in steps]), np.array([m for _, m in steps])


@pytest.fixture(scope="session")
def golden_generate(golden):
    """The golden params and what nanochat's Engine generated with them (nanochat_generate.npz)."""
    return golden_tree(golden, "param"), np.load(TESTDATA / "nanochat_generate.npz")


def stepped(params, cfg, prompt, bucket, max_len, feed):
    """Logits of prefill (prompt padded to `bucket`) and of each decode step fed `feed`, through the
    jitted steps that `generate` runs with the same shapes (so nothing compiles twice)."""
    padded = np.zeros((1, bucket), np.int32)
    padded[0, :len(prompt)] = prompt
    key, p = jax.random.key(0), nc.unstack(params, cfg)
    _, logits, cache = engine.prefill(p, padded, len(prompt), key, GREEDY, cfg=cfg, max_len=max_len)
    out = [logits[0]]
    for t in feed:
        _, logits, cache = engine.decode(p, np.array([t], np.int32), cache, key, GREEDY, cfg=cfg)
        out.append(logits[0])
    return np.array(out), cache


@pytest.mark.usefixtures("on_cpu")
def test_golden_generate_equals_nanochat_engine(golden_generate):
    params, g = golden_generate
    # 17 + 24 tokens: prefill bucket 32, cache 64
    tokens, masks = generated(params, GOLDEN_CFG, g["prompt"])
    assert tokens[:, 0].tolist() == g["engine_tokens"].tolist() == g["naive_tokens"].tolist()
    assert masks.all()
    logits, cache = stepped(params, GOLDEN_CFG, g["prompt"], 32, 64, g["engine_tokens"])
    np.testing.assert_allclose(logits[0], g["prefill_last_logits"], rtol=0, atol=2e-5)
    # the step after the last too
    np.testing.assert_allclose(logits[1:], g["decode_logits"], rtol=0, atol=2e-5)
    assert cache["pos"].tolist() == [17 + 24]


@pytest.fixture(scope="module")
def window_model():
    params = random_params(WINDOW_CFG, 3)
    prompt = np.random.default_rng(4).integers(0, WINDOW_CFG.vocab_size, 260)
    return params, prompt


@pytest.mark.slow  # a 256-token cache and programs of its own (the golden test checks decode)
@pytest.mark.usefixtures("fp32_matmuls")
def test_kv_decode_equals_full_forward_with_sliding_window(window_model):
    params, prompt = window_model
    assert nc.window_sizes(WINDOW_CFG) == [128, 256]
    # prefill bucket 128, cache 256
    tokens, _ = generated(params, WINDOW_CFG, prompt[:100], max_tokens=60)
    # 160 tokens: layer 0's 128-token window binds
    seq = np.concatenate([prompt[:100], tokens[:, 0]])[None]
    full = np.asarray(forward(params, seq, WINDOW_CFG))[0]
    # greedy with the cache = naive greedy
    assert full[99:159].argmax(-1).tolist() == tokens[:, 0].tolist()
    logits, _ = stepped(params, WINDOW_CFG, prompt[:100], 128, 256, tokens[:-1, 0])
    np.testing.assert_allclose(logits, full[99:159], rtol=0, atol=2e-5)
    # the window matters: full attention gives other logits past 128 tokens, so the cache really
    # honoured it
    unwindowed = dataclasses.replace(WINDOW_CFG, window_pattern="L")
    other = np.asarray(forward(params, seq, unwindowed))[0]
    np.testing.assert_allclose(other[:129], full[:129], rtol=0, atol=1e-5)
    assert np.abs(other[140:] - full[140:]).max() > 1e-3


def test_prompt_buckets_do_not_change_results_or_recompile(window_model):
    params, prompt = window_model
    key, p = jax.random.key(0), nc.unstack(params, WINDOW_CFG)
    # junk after the prompt
    padded = np.pad(prompt[None, :100], ((0, 0), (0, 28)), constant_values=7)
    _, bucketed, c2 = engine.prefill(p, padded, 100, key, GREEDY, cfg=WINDOW_CFG, max_len=256)
    _, exact, c1 = engine.prefill(p, prompt[None, :100], 100, key, GREEDY, cfg=WINDOW_CFG,
                                  max_len=256)
    np.testing.assert_allclose(bucketed, exact, rtol=0, atol=1e-5)
    assert c1["pos"].tolist() == c2["pos"].tolist() == [100]
    np.testing.assert_array_equal(c1["prev"], c2["prev"])  # the smear carries the last real token
    for (k1, _), (k2, _) in zip(c1["layers"], c2["layers"]):  # (B, K, S, D)
        np.testing.assert_allclose(k1[:, :, :100], k2[:, :, :100], rtol=0, atol=1e-5)
    five = np.array([5], np.int32)
    _, after_exact, _ = engine.decode(p, five, c1, key, GREEDY, cfg=WINDOW_CFG)
    _, after_bucketed, _ = engine.decode(p, five, c2, key, GREEDY, cfg=WINDOW_CFG)
    # the junk slot 100 is overwritten
    np.testing.assert_allclose(after_bucketed, after_exact, rtol=0, atol=1e-5)
    generated(params, WINDOW_CFG, prompt[:100], max_tokens=60)  # generate's own programs
    compiled = engine.prefill._cache_size(), engine.decode._cache_size()
    # one prompt bucket (128) and one cache size (256): a growing chat does not recompile
    for n in (97, 110, 120):
        generated(params, WINDOW_CFG, prompt[:n], max_tokens=60)
    assert (engine.prefill._cache_size(), engine.decode._cache_size()) == compiled


def test_sampling_keys_rows_and_top_k(window_model):
    params, prompt = window_model
    sample = lambda seed, **kw: generated(params, WINDOW_CFG, prompt[:20], max_tokens=12,
                                          seed=seed,
                                          **{"temperature": 1.0, "num_samples": 4, **kw})[0]
    a, b, c = sample(1), sample(1), sample(2)
    assert a.shape == (12, 4)
    np.testing.assert_array_equal(a, b)  # same key, same samples
    assert not np.array_equal(a, c)  # another key, other samples
    assert len({tuple(r) for r in a.T}) > 1  # rows sample independently
    greedy = sample(3, temperature=0.0)
    assert (greedy == greedy[:, :1]).all()
    # top-k 1 is greedy at any temperature
    np.testing.assert_array_equal(sample(4, top_k=1), greedy)


def test_sample_top_k_and_top_p_are_traced():
    """top_k and top_p truncate the distribution as HF does (top-k first, then the smallest set
    holding top_p of what remains; 0 and 1 turn them off); being traced, 40 settings share one
    compiled sampler."""
    probs = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04] + [0.0] * 300)  # V 306 > TOP_K_MAX
    logits = jnp.log(jnp.asarray(probs, jnp.float32) + 1e-30)[None]
    def draw_one(key, t, k, p):
        return engine.sample_next_token(logits, key[None], t, k, p)[0]

    draw = jax.jit(jax.vmap(draw_one, (0, None, None, None)))
    keys = jax.random.split(jax.random.key(0), 20000)

    def freq(t, k, p):
        return np.bincount(np.asarray(draw(keys, t, k, p)), minlength=306)[:8] / len(keys)

    for k, p, kept in ((0, 1.0, 6), (3, 1.0, 3), (0, 0.5, 2), (0, 0.8, 4), (4, 0.75, 3),
                       (4, 0.7, 2), (1, 1.0, 1), (300, 1.0, 6)):
        want = np.zeros(8)
        want[:kept] = probs[:kept] / probs[:kept].sum()
        np.testing.assert_allclose(freq(1.0, k, p), want, atol=0.012,
                                   err_msg=f"top_k {k}, top_p {p}")
    np.testing.assert_array_equal(freq(0.0, 0, 0.3), np.eye(8)[0])  # temperature 0: argmax
    for k, p in itertools.product((0, 1, 2, 50, 256), (1.0, 0.9, 0.5, 0.1)):
        draw(keys, 0.7, k, p)
    assert draw._cache_size() == 1


def test_stops_and_limits(window_model):
    params, prompt = window_model
    run = lambda **kw: generated(params, WINDOW_CFG, prompt[:20], max_tokens=12, num_samples=4,
                                 **kw)[0]
    greedy = run()[:, 0].tolist()
    stopped = run(stop_ids=[greedy[3]])
    # the stop token comes, then the end
    assert stopped[:, 0].tolist() == greedy[:greedy.index(greedy[3]) + 1]
    rows = run(temperature=1.0, stop_ids=[greedy[0]])
    # rows keep going until every row is done
    assert len(rows) == 12 or all(greedy[0] in r for r in rows.T)
    # the context is full
    assert len(generated(params, WINDOW_CFG, prompt[:250], max_tokens=100)[0]) == 6
    with pytest.raises(ValueError, match="context"):
        generated(params, WINDOW_CFG, np.tile(prompt, 2)[:256])


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random model saved as train.py saves an SFT checkpoint: (params, cfg, tokenizer,
    checkpoints root)."""
    params, bt = random_params(CHAT_CFG, 7), data.byte_tokenizer()
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    meta = {"stage": "sft", "step": 5, "config": dataclasses.asdict(CHAT_CFG),
            "tokenizer": "tokenizer.json"}
    step_dir = checkpoint.save_checkpoint(str(root / "sft"), 5, params, None, meta)
    bt.save(os.path.join(step_dir, "tokenizer.json"))
    return params, CHAT_CFG, bt, root


HI = [{"role": "user", "content": "hello"}]


def chat_prompt(bt, messages):
    return data.render_conversation(bt, messages)[0] + [bt.special["<|assistant_start|>"]]


def test_tool_output_is_forced_with_mask_zero(chat_model):
    params, cfg, bt, _ = chat_model
    sp = bt.special
    calculator = data.calculator_tool(bt)
    script = [sp["<|python_start|>"], *bt.encode("6*7"), sp["<|python_end|>"]]
    seen = []

    # a model that writes a python block after its first token, fed to the real calculator
    def tool(row, token):
        seen.append(token)
        return (script if len(seen) == 1 else []) + calculator(row, token)

    tokens, masks = generated(params, cfg, chat_prompt(bt, HI), max_tokens=32, top_k=50, tool=tool)
    forced = script + [sp["<|output_start|>"], *bt.encode("42"), sp["<|output_end|>"]]
    assert tokens[1:1 + len(forced), 0].tolist() == forced
    assert masks[:, 0].tolist() == [1] + [0] * len(forced) + [1] * (32 - 1 - len(forced))
    assert seen == tokens[:, 0].tolist()  # the tool saw every emitted token


def test_decode_donates_its_cache(chat_model):
    params, cfg, _, _ = chat_model
    key, p = jax.random.key(0), nc.unstack(params, cfg)
    # the shapes of the generate call above (prompt bucket 16, cache 64): nothing compiles again
    prompt = np.zeros((1, 16), np.int32)
    _, _, cache = engine.prefill(p, prompt, 3, key, GREEDY, cfg=cfg, max_len=64)
    _, _, new = engine.decode(p, np.array([5], np.int32), cache, key, GREEDY, cfg=cfg)
    # written in place: no second cache
    assert all(a.is_deleted() for a in jax.tree.leaves(cache["layers"]))
    assert new["pos"].tolist() == [4]


# --------------------------------------------------------------------------------------------------
# The slot engine: many requests at once, each equal to the reference `generate` alone. On a chip
# the equality tests run at full fp32 matmul precision: at its default (bf16 passes) a row rounds
# differently in a batch than alone, and a greedy stream takes the other token of a near tie.

def solo(params, cfg, prompt, **kwargs):
    """(tokens, masks) of the first row of the reference engine.generate, greedy by default."""
    tokens, masks = generated(params, cfg, prompt, **kwargs)
    return tokens[:, 0].tolist(), masks[:, 0].tolist()


def greedy(max_tokens, **kwargs):
    return engine.Sampling(max_tokens=max_tokens, temperature=0.0, **kwargs)


@pytest.mark.usefixtures("on_cpu")
def test_engine_golden_prompt_among_others(golden_generate):
    """nanochat's golden prompt, admitted into a slot while the other slots decode other prompts,
    gives nanochat's Engine tokens exactly and its logits (as log-probabilities) within the golden
    tolerance."""
    params, g = golden_generate
    eng = engine.Engine(params, GOLDEN_CFG, slots=4, kmax=4)
    rng = np.random.default_rng(5)
    others = [eng.submit(rng.integers(0, 300, n).tolist(), greedy(40)) for n in (9, 30)]
    eng.step()
    eng.step()  # the others are 5 tokens in
    golden = eng.submit(g["prompt"].tolist(), greedy(24, logprobs=True), stream=True)
    eng.drain()
    assert golden.tokens[0] == g["engine_tokens"].tolist() and golden.finish == ["length"]
    assert golden.masks[0] == [1] * 24 and all(len(r.tokens[0]) == 40 for r in others)
    # each token's log-probabilities: the golden logits that chose it, log-softmaxed
    logits = np.concatenate([g["prefill_last_logits"][None], g["decode_logits"][:23]])
    want = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    for step, event in enumerate(list(golden)[:-1]):
        chosen, likeliest = event.logprobs
        ids = [i for i, _ in likeliest]
        assert ids[0] == event.token and len(ids) == engine.TOP_LOGPROBS
        np.testing.assert_allclose([lp for _, lp in likeliest], want[step, ids], rtol=0, atol=4e-5)
        assert chosen == pytest.approx(float(want[step, event.token]), abs=4e-5)


def test_an_idle_engine_starts_a_burst_in_one_admission(window_model, monkeypatch):
    """Requests that reach an idle engine one shortly after another (within BURST_QUIET of the
    last) start together: one admission, one prefill call, and their greedy replies as when
    submitted before the engine ran. stop() then ends the engine's thread."""
    params, prompt = window_model
    monkeypatch.setattr(engine, "BURST_QUIET", 0.5)  # a wide window: the sleeps below lie in it
    monkeypatch.setattr(engine, "BURST_MOST", 30.0)
    asks = [(12, 6), (30, 5), (7, 8), (20, 4)]
    eng = engine.Engine(params, WINDOW_CFG, slots=4, kmax=4)
    eng.start()
    requests = []
    for n, m in asks:
        requests.append(eng.submit(prompt[:n].tolist(), greedy(m), stream=True))
        time.sleep(0.05)
    replies = [[event.token for event in r if event.token is not None] for r in requests]
    assert eng.stats["admits"] == 1
    # stop(): its thread ends after its round, out of the device (a process may exit)
    eng.stop()
    assert not eng.thread.is_alive() and not eng.running
    alone = engine.Engine(params, WINDOW_CFG, slots=4, kmax=4)
    before = [alone.submit(prompt[:n].tolist(), greedy(m)) for n, m in asks]
    alone.drain()
    assert replies == [r.tokens[0] for r in before] and sum(map(len, replies)) == 23


def test_engine_starts_a_chunk_before_handing_out_the_last(window_model):
    """A step starts the next chunk, then hands out the tokens of the one before: one chunk is in
    flight whenever a slot is busy, and its tokens come one step later."""
    params, prompt = window_model
    eng = engine.Engine(params, WINDOW_CFG, slots=4, kmax=4)
    request = eng.submit(prompt[:20].tolist(), greedy(10))
    counts = []
    while eng.step():
        counts.append((len(request.tokens[0]), eng.stats["chunks"], eng.in_flight is not None))
    # admitted (its first token) and chunk 1 started; then each step a chunk's 4 tokens, the
    # next started; the last chunk is started before the host knows the choice ended
    assert counts == [(1, 1, True), (5, 2, True), (9, 3, True), (10, 4, True), (10, 4, False)]
    assert request.tokens[0] == solo(params, WINDOW_CFG, prompt[:20], max_tokens=10)[0]


@pytest.mark.usefixtures("fp32_matmuls")
def test_engine_staggered_requests_equal_each_alone(window_model):
    """Six prompts of different lengths arrive at different steps into four slots (two reused
    after long requests); slots cross the 128-token sliding window at different steps. Every
    stream equals its prompt's solo greedy `generate`. The engine takes its weights prepared
    (as bench.py and chat.py hand them, the stacked ones freed), solo generate stacked."""
    params, prompt = window_model
    lengths = (5, 100, 40, 120, 3, 60)
    budgets = (150, 100, 100, 120, 130, 150)  # past 128 in all: generate's cache is 256 for each
    weights = engine.prepare(params, WINDOW_CFG)
    assert engine.prepare(weights, WINDOW_CFG) is weights
    eng = engine.Engine(weights, WINDOW_CFG, slots=4, kmax=8)
    arrivals = {0: [0, 1], 1: [2], 3: [3, 4], 6: [5]}  # round -> the requests that come then
    requests = {}
    for round_ in range(200):
        for i in arrivals.get(round_, []):
            requests[i] = eng.submit(prompt[:lengths[i]].tolist(), greedy(budgets[i]))
        if not eng.step() and round_ > max(arrivals):
            break
    assert eng.stats["chunks"] > 20  # long enough to reuse slots
    for i, request in sorted(requests.items()):
        want = min(budgets[i], WINDOW_CFG.sequence_len - lengths[i])
        tokens, masks = solo(params, WINDOW_CFG, prompt[:lengths[i]], max_tokens=want)
        assert request.tokens[0] == tokens and request.masks[0] == masks == [1] * want, i
        assert request.finish == ["length"]
    # the two that crossed the window did so at different steps
    crossings = [128 - lengths[i] for i in (1, 3)]
    assert crossings[0] != crossings[1]
    assert all(0 < c < budgets[i] for c, i in zip(crossings, (1, 3)))


@pytest.mark.usefixtures("fp32_matmuls")
def test_engine_sliding_window_layers_hold_rings(window_model):
    """The engine's cache holds a sliding-window layer's window only: a ring of the window's
    slots (a decode chunk's own tokens lie apart), each position in its slot modulo the ring;
    generate's rings hold ring_size (the window and the token written, rounded up to 16). A
    200-token prompt's last 128 positions go into the ring at admission, decoding wraps it, and
    the greedy reply equals solo generate's over whole-context caches. A ring takes one token a
    call."""
    params, prompt = window_model
    cfg = WINDOW_CFG  # windows 128 and 256 at context 256
    assert (nc.ring_size(128, 256), nc.ring_size(255, 256)) == (144, None)
    pos = jnp.array([3, 150, 400])
    held = np.asarray(nc.ring_positions(pos, 144))  # (3, 144)
    assert (held % 144 == np.arange(144)).all()  # each position in its slot
    assert (held <= pos[:, None]).all() and (held > pos[:, None] - 144).all()  # the latest 144
    eng = engine.Engine(params, cfg, slots=2, kmax=8)
    shapes = [k.shape for k, _ in eng.state["cache"]["layers"]]
    assert shapes == [(2, 1, 128, 16), (2, 1, 256, 16)]
    # with pages, layer 1 is a pool of pages of 32 tokens and the null page
    pooled = engine.new_state(cfg, 2, pages=10)["cache"]["layers"]
    assert [k.shape for k, _ in pooled] == [(2, 1, 128, 16), (11, 1, 32, 16)]
    whole = jax.eval_shape(lambda: nc.init_cache(cfg, 2, 256))
    ringed = jax.eval_shape(lambda: nc.init_cache(cfg, 2, 256, rings=True))
    # k and v of 2 slots: layer 0's 112 positions fewer
    assert nc.count(whole["layers"]) - nc.count(ringed["layers"]) == 2 * 2 * 1 * 112 * 16
    request = eng.submit(prompt[:200].tolist(), greedy(50))
    eng.drain()
    tokens, masks = solo(params, cfg, prompt[:200], max_tokens=50)
    assert request.tokens[0] == tokens and masks == [1] * 50
    layered = engine.prepare(params, cfg)
    cache = nc.init_cache(cfg, 1, cfg.sequence_len, rings=True)
    with pytest.raises(ValueError, match="^a cache with rings takes one token a row, not 2$"):
        nc.forward_cached(layered, prompt[None, :2], cache, cfg, nc.causal_attention, rings=True)


@pytest.mark.usefixtures("fp32_matmuls")
@pytest.mark.usefixtures("fp32_matmuls")
def test_int8_kv_cache(window_model):
    """--kv-cache int8: every k and v vector of a token and head stored as int8 values and one
    scale, each value within half a scale; a decode step's logits over a 90-token int8 cache
    within 0.05 of the exact cache's (6.5e-3 measured, logits up to 2.3); the engine's int8 slots
    hold a byte a value and a scale a head, and the first token of a reply (the prompt prefilled
    exactly, then stored quantized) is the exact engine's; an int8 cache in pages gives the int8
    cache's reply in rows. kernels' attention reads the int8 values as they are stored, the
    scales on its scores and weights: the logits and replies of the values times their scales."""
    params, prompt = window_model
    cfg = WINDOW_CFG
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 16)) * jnp.arange(1, 17)
    q, scale = nc.quantize(x)
    assert q.dtype == jnp.int8 and scale.shape == (2, 5, 3)
    assert bool(jnp.all(jnp.abs(q * scale[..., None] - x) <= scale[..., None] / 2 + 1e-6))
    assert bool(jnp.all(jnp.abs(q).max(-1) == 127))  # each vector's largest value: 127 scales
    # a decode step's logits over each cache
    layered = engine.prepare(params, cfg)
    cached = jax.jit(nc.forward_cached, static_argnames=("cfg", "attn"))
    stored = kernels.attention_fn()  # reads int8 values as stored, scales on scores and weights
    logits = {}
    for name, kv, attn in (("exact", None, nc.causal_attention),
                           ("int8", "int8", nc.causal_attention), ("int8 stored", "int8", stored)):
        cache = nc.init_cache(cfg, 1, cfg.sequence_len, kv)
        _, cache = cached(layered, prompt[None, :90], cache, cfg=cfg, attn=attn)
        logits[name], _ = cached(layered, prompt[None, 90:91], cache, cfg=cfg, attn=attn)
    assert 0 < float(jnp.abs(logits["int8"] - logits["exact"]).max()) < 0.05
    np.testing.assert_allclose(logits["int8 stored"], logits["int8"], atol=2e-5, rtol=0)
    # the engine's slots: a byte a value, a scale a token and head; in pages, the same tokens
    replies = {}
    for name, kv, pages, attn in (("exact", None, None, nc.causal_attention),
                                  ("int8 pages stored", "int8", 8, stored),
                                  ("int8 pages", "int8", 8, nc.causal_attention),
                                  ("int8", "int8", None, nc.causal_attention)):
        eng = engine.Engine(params, cfg, slots=2, kmax=4, kv_cache=kv, pages=pages, attn=attn)
        request = eng.submit(prompt[:100].tolist(), greedy(20))
        eng.drain()
        replies[name] = request.tokens[0]
    assert replies["int8 pages stored"] == replies["int8 pages"] == replies["int8"]
    k, scales = eng.state["cache"]["layers"][0][0]
    B, K, S, D = k.shape
    assert k.dtype == jnp.int8 and scales.shape == (B, K, S)
    # the tokens each layer holds: a ring's slots, a pool's pages
    held = sum(k[0].shape[0] * k[0].shape[2] for k, _ in eng.state["cache"]["layers"])
    assert engine.state_bytes(cfg, 2, "int8") == engine.state_bytes(cfg, 2) - (
        2 * K * held * (4 * D - D - 4))
    assert replies["int8"][0] == replies["exact"][0]
    with pytest.raises(ValueError, match="^kv_cache is 'fp8'; it must be None"):
        engine.Engine(params, cfg, slots=2, kv_cache="fp8")


def test_engine_slots_that_do_not_fit_are_one_line(chat_model, monkeypatch, capsys):
    """Slots whose state and decode call do not fit the device's free memory (faked here: a CPU
    has no fixed limit; the CPU compiler's counts stand in for the chip's) are one ValueError
    line before any cache exists, naming what they need, what is free and how many fit; as many
    as it names fit, and their state is the bytes counted. chat.py --serve says it in one line,
    and bench.py's infer sweep skips such a batch and goes on."""
    params, cfg, _, root = chat_model
    null = engine.state_bytes(cfg, 0)  # no slot: the null page of each paged layer
    one = engine.state_bytes(cfg, 1) - null
    assert engine.state_bytes(cfg, 8) == null + 8 * one
    # the largest decode call's work, by the compiler's count: more with more slots
    work = engine.Engine(params, cfg, slots=3).decode_work
    assert 0 < work(3) < work(4) < work(8)
    monkeypatch.setattr(kvcache, "free_device_bytes", lambda: null + 3 * one + work(3) + one // 2)
    with pytest.raises(ValueError, match=r"^8 slots need \d+\.\d\d GiB of KV cache and "
                                         r"\d+\.\d\d GiB to decode, more than the \d+\.\d\d "
                                         r"GiB the device has free beside the weights; at most 3 "
                                         r"fit$"):
        engine.Engine(params, cfg, slots=8)
    eng = engine.Engine(params, cfg, slots=3)
    assert sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(eng.state)) == null + 3 * one
    with pytest.raises(SystemExit) as e:
        chat.main(["--checkpoint", str(root / "sft" / "step_000005"), "--compile-cache", "",
                   "--serve", "--slots", "8"])
    assert str(e.value).startswith("error: 8 slots need ") and e.value.code.endswith(
        "at most 3 fit (--slots)")
    # bench.py serve --infer-bench and --chat-traffic: the batch of 4 skipped with that line, the
    # sweep goes on
    import bench_serving
    monkeypatch.setitem(bench_serving.CONFIGS, "tiny", TINY)
    tiny_work = engine.Engine(random_params(TINY, 48), TINY, slots=1, kmax=4,
                              attn=kernels.attention_fn()).decode_work(1)
    # one slot and half another (a TPU's count of the work can dwarf a tiny model's slot)
    slot = engine.state_bytes(TINY, 2) - engine.state_bytes(TINY, 1)
    one_and_a_half = engine.state_bytes(TINY, 1) + tiny_work + slot // 2
    monkeypatch.setattr(kvcache, "free_device_bytes", lambda: one_and_a_half)
    capsys.readouterr()
    bench_serving.bench_infer("tiny", batch_sizes=(4, 1), decode_tokens=8, kmax=4)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["batch_size"] == 4 and re.fullmatch(r"4 slots need .* to decode, .*; at most "
                                                         r"[123] fit", lines[0]["skipped"])
    assert [row["batch_size"] for row in lines[-1]["sweep"]] == [1]
    monkeypatch.setattr(kvcache, "free_device_bytes", lambda: 2 * engine.state_bytes(TINY, 1))
    bench_serving.bench_chat_traffic("tiny", 4)
    line = json.loads(capsys.readouterr().out)
    assert line["slots"] == 4 and re.fullmatch(r"4 slots and \d+ pages need .*; at most 0 fit",
                                               line["skipped"])
    bench_serving.bench_decode_chunk("tiny", 4, positions=(10, 20), kmax=4, calls=2)
    line = json.loads(capsys.readouterr().out)
    assert line["rows"] == 4 and re.fullmatch(r"4 slots and \d+ pages need .*; at most 0 fit",
                                              line["skipped"])


def block_tool(start, end, result):
    """The calculator's state machine on ids start and end (data.calculator_tool's): after start,
    ids, end it forces result(ids)."""
    blocks = {}

    def tool(row, token):
        if token == start:
            blocks[row] = []
        elif row in blocks and token == end:
            return list(result(blocks.pop(row)))
        elif row in blocks:
            blocks[row].append(token)
        return []
    return tool


@pytest.mark.usefixtures("fp32_matmuls")
@pytest.mark.parametrize("forced", [[7, 8, 9], []], ids=["result", "nothing"])
def test_engine_calculator_hops_and_forced_tokens(window_model, forced):
    """A python block the model writes hands the slot to the host, which runs the tool and queues
    its ids: the same tokens and masks as `generate` with that tool, one hop per closed block; a
    tool that gives nothing (an empty or failing expression) forces nothing."""
    params, prompt = window_model
    # prompts and lengths whose shapes the staggered test compiled
    plain, _ = solo(params, WINDOW_CFG, prompt[:40], max_tokens=125)
    start = plain[2]  # tokens this model writes: its greedy stream opens and closes a block
    end = next(t for t in plain[4:] if t != start)
    want, masks = solo(params, WINDOW_CFG, prompt[:40], max_tokens=125,
                       tool=block_tool(start, end, lambda ids: forced))
    eng = engine.Engine(params, WINDOW_CFG, slots=4, kmax=8, python_ids=(start, end))
    others = [eng.submit(prompt[:n].tolist(), greedy(125)) for n in (7, 33)]
    request = eng.submit(prompt[:40].tolist(), greedy(125),
                         tool=block_tool(start, end, lambda ids: forced))
    eng.drain()
    assert request.tokens[0] == want and request.masks[0] == masks
    assert (0 in masks) == bool(forced)
    streams = [want]
    for r, n in zip(others, (7, 33)):  # the others, without a tool, resume sampling at once
        streams.append(solo(params, WINDOW_CFG, prompt[:n], max_tokens=125,
                            tool=block_tool(start, end, lambda ids: []))[0])
        assert r.tokens[0] == streams[-1]
    # a block closed by a choice's last token needs no hop: the choice ends
    assert eng.stats["hops"] == sum(closed_blocks(s[:-1], start, end) for s in streams)
    assert closed_blocks(want[:-1], start, end) >= 1


def closed_blocks(tokens, start, end):
    """The python blocks a stream closes, counted as nanochat's Engine does."""
    closed = 0
    inside = False
    for t in tokens:
        if t == start:
            inside = True
        elif t == end and inside:
            inside = False
            closed += 1
    return closed


@pytest.mark.usefixtures("fp32_matmuls")
def test_engine_stops_limits_choices_and_seeds(window_model):
    """Stop ids, max_tokens and a full context end a choice as in `generate`; n choices share one
    prefill and equal generate's rows; a seeded request gives the same tokens alone and among
    seven others."""
    params, prompt = window_model
    eng = engine.Engine(params, WINDOW_CFG, slots=8, kmax=8)
    plain, _ = solo(params, WINDOW_CFG, prompt[:20], max_tokens=12)
    stopped = eng.submit(prompt[:20].tolist(), greedy(12, stop_ids=(plain[3],)))
    limited = eng.submit(prompt[:20].tolist(), greedy(5))
    full = eng.submit(prompt[:250].tolist(), greedy(100))
    eng.drain()
    assert stopped.tokens[0] == plain[:plain.index(plain[3]) + 1] and stopped.finish == ["stop"]
    assert limited.tokens[0] == plain[:5] and limited.finish == ["length"]
    assert len(full.tokens[0]) == 6 and full.finish == ["length"]  # the context is full
    # four choices from one prefill: generate's four rows, whose keys are fold_in(key(seed), row)
    admits = eng.stats["admits"]
    sampled = engine.Sampling(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=11)
    choices = eng.submit(prompt[:20].tolist(), sampled, n=4)
    eng.drain()
    rows, _ = generated(params, WINDOW_CFG, prompt[:20], max_tokens=12, seed=11,
                        temperature=1.0, top_k=50, top_p=0.9, num_samples=4)
    assert choices.tokens == rows.T.tolist() and len({tuple(c) for c in choices.tokens}) > 1
    assert eng.stats["admits"] == admits + 1  # one prefill for the four
    alone = eng.submit(prompt[:30].tolist(), sampled)
    eng.drain()
    crowd = [eng.submit(prompt[:n].tolist(), dataclasses.replace(sampled, seed=n))
             for n in (3, 9, 15, 21, 40, 50, 60)]
    among = eng.submit(prompt[:30].tolist(), sampled)
    eng.drain()
    assert among.tokens == alone.tokens and all(len(r.tokens[0]) == 12 for r in crowd)
    with pytest.raises(ValueError, match="context"):
        eng.submit(prompt[:256].tolist(), sampled)
    with pytest.raises(ValueError, match="top_k"):
        eng.submit(prompt[:5].tolist(), dataclasses.replace(sampled, top_k=257))


@pytest.mark.usefixtures("fp32_matmuls")
def test_engine_prefills_a_burst_together(window_model):
    """Prompts waiting at one call are prefilled together, one admit call for each prompt
    bucket and as many prompts as its largest count holds: a burst of eight takes four calls,
    and each reply equals its request's alone (greedy: generate's; seeded, with three choices:
    the engine's with the request alone). A call's choices and logprobs are what its prompts
    need."""
    params, prompt = window_model
    eng = engine.Engine(params, WINDOW_CFG, slots=16, kmax=8)
    assert [eng.prompt_rows(T) for T in (64, 256)] == [[1, 4], [1]]
    lengths = (3, 9, 20, 31, 100, 40, 64, 150)  # six of bucket 64, two of 256
    seeded = engine.Sampling(max_tokens=10, temperature=1.0, top_k=40, seed=5)
    burst = [eng.submit(prompt[:n].tolist(), greedy(10)) for n in lengths[:-1]]
    burst.append(eng.submit(prompt[:lengths[-1]].tolist(), seeded, n=3))
    eng.step()
    assert eng.stats["admits"] == 4  # 64: four prompts, then two; 256: one and one
    eng.drain()
    for n, request in zip(lengths, burst[:-1]):
        assert request.tokens[0] == solo(params, WINDOW_CFG, prompt[:n], max_tokens=10)[0], n
    alone = eng.submit(prompt[:lengths[-1]].tolist(), seeded, n=3)
    eng.drain()
    assert alone.tokens == burst[-1].tokens and len({tuple(t) for t in alone.tokens}) == 3
    # a call's choices are as many as its prompts can start (16 each), its logprobs drawn only
    # where a request asks
    wide = engine.Engine(params, WINDOW_CFG, slots=32, kmax=8)
    plain = engine.Request(prompt[:3].tolist(), greedy(4), 1, None, False)
    asks = engine.Request(prompt[:9].tolist(), engine.Sampling(max_tokens=4, logprobs=True), 1,
                          None, False)
    one = wide.request_arrays(64, [(plain, [0], 0)])
    two = wide.request_arrays(64, [(plain, [0], 0), (asks, [1], 0)])
    assert one["slots"].shape == (16,) and not one["logprobs"]
    assert two["prompt"].shape == (4, 64) and two["slots"].shape == (32,) and two["logprobs"]


@pytest.mark.usefixtures("fp32_matmuls")
def test_engine_pages_are_taken_returned_and_never_shared(window_model):
    """The layers over the whole context hold pages of 32 tokens from one pool: a request holds
    the pages its prompt and max_tokens reach, waits for them as for a slot, and returns them when
    it ends, is cancelled or the engine fails; no two slots ever hold one page; the replies equal
    solo generate's. A request that no pool could hold, or a pool under one context, is one line."""
    params, prompt = window_model
    eng = engine.Engine(params, WINDOW_CFG, slots=4, kmax=8, pages=10)  # 8 pages a context

    def check_pages():
        held = [page for pages in eng.pool.held for page in pages]
        assert len(held) == len(set(held)) and 0 not in held  # none shared, none the null page
        assert sorted(held + eng.pool.free) == list(range(1, 11))
        for slot, pages in enumerate(eng.pool.held):
            assert eng.pool.table[slot, :len(pages)].tolist() == pages
            assert not eng.pool.table[slot, len(pages):].any()
    asks = [(100, 100), (20, 20), (60, 100)]  # 7, 2 and 5 pages
    requests = [eng.submit(prompt[:n].tolist(), greedy(m)) for n, m in asks]
    eng.step()
    assert [r.started for r in requests] == [1, 1, 0]  # a free slot, but 1 page of the 5
    assert eng.stats["pages_peak"] == 9
    while eng.step():
        check_pages()
    for (n, m), request in zip(asks, requests):
        assert request.tokens[0] == solo(params, WINDOW_CFG, prompt[:n], max_tokens=m)[0]
    assert len(eng.pool.free) == 10 and not eng.pool.table.any()
    # cancelled, and failed: the pages come back
    cancelled = eng.submit(prompt[:50].tolist(), greedy(150))
    failed = eng.submit(prompt[:30].tolist(), greedy(60))
    eng.step()
    assert not eng.pool.free  # 7 and 3 pages
    cancelled.cancel()
    eng.step()
    check_pages()
    assert len(eng.pool.free) == 7
    eng.fail(RuntimeError("injected"))
    assert failed.error is not None and len(eng.pool.free) == 10 and not eng.pool.table.any()
    with pytest.raises(ValueError, match="^2 choices of up to 256 tokens need 16 pages of 32 "
                                         "tokens, more than the engine's 10; ask for fewer "
                                         "choices or tokens$"):
        eng.submit(prompt[:56].tolist(), greedy(200), n=2)
    with pytest.raises(ValueError, match=r"^pages is 7; the engine needs at least 8 \(one "
                                         r"context of 256 tokens in pages of 32\)$"):
        engine.Engine(params, WINDOW_CFG, slots=4, pages=7)
    # a chunk's tokens cross one page's end at most, and one ring's (of 128 here)
    too_many = "^kmax is {}; a chunk's tokens must fit a page and a ring: 1 to {}$"
    with pytest.raises(ValueError, match=too_many.format(33, 32)):
        engine.Engine(params, WINDOW_CFG, slots=4, pages=8, kmax=33)
    with pytest.raises(ValueError, match=too_many.format(129, 128)):
        engine.Engine(params, WINDOW_CFG, slots=4, kmax=129)


@pytest.mark.parametrize("kv_cache, pages", [(None, 24), ("int8", 24), ("int8", None)])
def test_engine_served_the_tpus_way_serves_as_the_cpus_way(kv_cache, pages):
    """A paged engine served the TPU's way (interpreted here): a decode chunk's tokens written by
    whole windows (kernels.write_windows) and its pages and rings read in place
    (kernels.attend_pages), replies as one served the CPU's way (one scatter of vectors, the
    pages gathered) and leaves the same state: heads of 128, chunks of 16 tokens, rows across a
    ring's end (128 slots) and across pages of 32, two choices of one prompt, the chunk's own
    tokens a step a slab; an int8 cache's too (its values by windows of 32-row tiles in pages
    and rings, its scales scattered into pages and placed in rings and rows; read in place, its
    scales beside), and an int8 engine without pages (its rows read in place).
    (Each kernel against its CPU twin, bit for bit or to fp32's rounding:
    test_written_windows_equal_the_scatter_of_vectors,
    test_attend_pages_sums_what_the_gathered_pages_sum.)"""
    run_alone(f"check_engine_kernels({kv_cache!r}, {pages})")


def check_engine_kernels(kv_cache=None, pages=24):
    cfg = LANES_CFG
    params = random_params(cfg, 5)
    prompt = np.random.default_rng(6).integers(0, cfg.vocab_size, 140).tolist()
    write, reads_in_place = kernels.write_tokens, kvcache.reads_in_place
    runs = []
    for tpu in (False, True):
        kernels.write_tokens = functools.partial(write, windows=tpu)
        kvcache.reads_in_place = lambda *_, forced=tpu, **__: forced  # every layer's
        base = kernels.attention_fn("plain")

        @functools.wraps(base)  # its attributes, in a function of its own: programs traced anew
        def attn(*args, **kwargs):
            return base(*args, **kwargs)
        attn.steps_first = tpu  # the chunk's own tokens a step a slab
        try:
            with jax.default_matmul_precision("highest"):
                eng = engine.Engine(params, cfg, slots=4, kmax=16, attn=attn, pages=pages,
                                    kv_cache=kv_cache)
                # read in place: one view, a decode program fewer a row count
                assert eng.views == {rows: [256] if tpu else [64, 256] for rows in (1, 4)}
                # past the ring, across pages; every prompt in one bucket: fewer programs
                requests = [eng.submit(prompt[:n], greedy(m))
                            for n, m in ((5, 150), (20, 120), (31, 80))]
                drawn = engine.Sampling(max_tokens=50, temperature=1.0, seed=3)
                requests.append(eng.submit(prompt[:30], drawn, n=2))
                eng.drain()
            runs.append(([t for r in requests for t in r.tokens],
                         jax.device_get(eng.state["cache"])))
        finally:
            kernels.write_tokens, kvcache.reads_in_place = write, reads_in_place
    assert runs[0][0] == runs[1][0]
    assert sum(map(len, runs[0][0])) == 350 + 2 * 50
    # (a layer's k, v after a layer read in place: fp32's sums in another order, ~1e-6 apart)
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_a_tpu_reads_in_place_what_it_read_faster_so(monkeypatch):
    """On a TPU (faked), heads of whole lanes: pages always; an exact ring or row from RING_ROWS
    rows (XLA read fewer faster); int8 rings and rows of whole 32-row tiles; never heads of 64
    lanes, or a CPU's cache."""
    exact = jax.ShapeDtypeStruct((4, 2, 512, 128), jnp.bfloat16)
    narrow = jax.ShapeDtypeStruct((4, 2, 512, 64), jnp.bfloat16)
    int8 = (jax.ShapeDtypeStruct(exact.shape, jnp.int8), None)
    odd = (jax.ShapeDtypeStruct((4, 2, 528, 128), jnp.int8), None)
    few, many = kvcache.RING_ROWS // 2, kvcache.RING_ROWS
    cases = [(exact, "pages", few, True), (exact, "ring", few, False),
             (exact, "ring", many, True), (exact, "rows", few, False), (exact, "rows", many, True),
             (int8, "ring", few, True), (int8, "rows", few, True), (odd, "ring", many, False),
             (narrow, "pages", many, False)]
    for backend in ("tpu", "cpu"):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        for entry, layout, rows, tpu in cases:
            assert kvcache.reads_in_place(entry, layout, rows) == (tpu and backend == "tpu")
            assert kvcache.reads_in_place(entry, layout, rows, in_place=False) is False


def test_an_int8_cache_is_read_in_longer_blocks():
    """attend_pages reads an exact cache BLOCK copy units at a time and an int8 cache
    INT8_BLOCK (on the chip 1.2-1.7x as fast as 8), never more than a row's; read_in_place
    gathers an int8 cache's scales into the blocks the kernel reads."""
    table = jnp.zeros((2, 64), jnp.int32)  # 64 pages of 32 tokens a row
    exact, int8 = jnp.bfloat16, jnp.int8
    assert [kernels.block_of(2048, t, dtype) for t in (None, table) for dtype in (exact, int8)
            ] == [kernels.BLOCK, kernels.INT8_BLOCK] * 2 == [16, 32] * 2
    assert kernels.block_of(512, None, int8) == 16  # a ring of 512 slots: 16 tiles, one block
    assert kernels.block_of(128, None, exact) == 4
    values, scales = jnp.zeros((2, 3, 2048, 128), int8), jnp.ones((2, 3, 2048), exact)
    pages = kvcache.read_in_place((values, scales), None, jnp.array([5, 2048]))
    assert pages.scales.shape == (2, 2, 3, 1024)  # (rows, blocks, heads, a block's tokens)


def test_a_cache_read_in_place_is_read_at_one_view(monkeypatch):
    """A decode chunk reads up to its view only a layer it gathers: on a TPU (faked) pages,
    int8 rows and exact rows from RING_ROWS rows are read in place, each row as far as it
    holds, and rings whole, so such a chunk is compiled for one view; exact rows in fewer
    rows, heads of 64 lanes, attention that reads no stored cache or a CPU's cache: two
    views, two programs a row count."""
    def entry(S, D=128, dtype=jnp.bfloat16):
        values = jax.ShapeDtypeStruct((4, 2, S, D), dtype)
        return (values, None) if dtype == jnp.int8 else values
    ring = (entry(512),) * 2
    few, many = kvcache.RING_ROWS // 2, kvcache.RING_ROWS
    cases = [("pages", entry(32), few, False), ("rows", entry(2048, dtype=jnp.int8), few, False),
             ("rows", entry(2048), few, True), ("rows", entry(2048), many, False),
             ("pages", entry(32, D=64), many, True)]
    for backend in ("tpu", "cpu"):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        for layout, whole, rows, by_view in cases:
            layers, kinds = [ring, (whole,) * 2], ["ring", layout]
            assert kvcache.reads_by_view(layers, kinds, rows) == (by_view or backend == "cpu")
            assert kvcache.reads_by_view(layers, kinds, rows, in_place=False)
    assert engine.in_place_of(kernels.attention_fn("plain")) is None  # reads_stored
    assert engine.in_place_of(nc.causal_attention) is False
    cfg = LANES_CFG
    params, attn = random_params(cfg, 5), kernels.attention_fn("plain")
    both = [64, 256]  # a row count's views: of an engine of pages, then of one of rows
    for backend, of_pages, of_rows in (("tpu", {1: [256], 4: [256], 16: [256]},
                                        {1: both, 4: both, 16: [256]}),
                                       ("cpu", {1: both, 4: both, 16: both}, None)):
        monkeypatch.setattr(jax, "default_backend", lambda: backend)
        assert engine.Engine(params, cfg, slots=16, attn=attn, pages=24).views == of_pages
        assert engine.Engine(params, cfg, slots=16, attn=attn).views == (of_rows or of_pages)


def test_a_decode_programs_layers_of_one_shape_share_a_kernel(monkeypatch):
    """A decode program served the TPU's way lowers attend_pages once for each shape its
    layers read (a ring, pages) and write_windows once for each they write, however many
    layers call them: each kernel's trace and lowering took 2-3 s a layer on the TPU's host
    (int8 d20's 20 layers: a minute of a program's start)."""
    monkeypatch.setattr(kernels, "write_tokens",
                        functools.partial(kernels.write_tokens, windows=True))
    monkeypatch.setattr(kvcache, "reads_in_place", lambda *_, **__: True)
    cfg = dataclasses.replace(LANES_CFG, n_layer=4)
    eng = engine.Engine(random_params(cfg, 5), cfg, slots=4, kmax=16,
                        attn=kernels.attention_fn("plain"), pages=24)
    layouts = kvcache.layouts(cfg, paged=True)
    assert sorted(layouts) == ["pages", "pages", "ring", "ring"]  # two shapes, two layers each
    text = eng.chunk_call(engine.decode_chunk.lower, eng.state, eng.idle_control(4), 4,
                          256).as_text()
    for kernel, lowered, calls in (("attend_pages", 2, 4), ("write_windows", 2, 8)):
        assert len(re.findall(rf"func.func private @{kernel}(_\d+)?\(", text)) == lowered
        assert len(re.findall(rf"call @{kernel}(_\d+)?\(", text)) == calls


def test_engine_never_recompiles_after_warm_up_and_donates(window_model, recwarn, monkeypatch):
    """After warm_up (every slot's values as a fresh engine's; its programs compiled in 2 threads,
    a many-core host's way), prompts of every bucket, any number of concurrent requests, chunks of
    any row count, calculator hops, logprobs and cancellations compile nothing; each call donates
    the state (no second cache)."""
    params, prompt = window_model
    monkeypatch.setattr(engine, "WARM_UP_THREADS", 2)
    plain, _ = solo(params, WINDOW_CFG, prompt[:20], max_tokens=8)
    eng = engine.Engine(params, WINDOW_CFG, slots=4, kmax=8, python_ids=(plain[2], plain[5]))
    eng.warm_up()
    # its chunks' steps ran on live slots, whose values it put back
    fresh = engine.new_state(WINDOW_CFG, 4)
    for a, b in zip(*(jax.tree.leaves(engine.per_slot(s)) for s in (eng.state, fresh))):
        if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert (np.asarray(a) == np.asarray(b)).all()
    compiles = []

    def listen(event, *_, **__):
        if event == LOWERED:
            compiles.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        rng = np.random.default_rng(0)
        for wave in range(4):
            requests = []
            for i in range(1 + 3 * wave):
                n = int(rng.integers(1, 255))
                sampling = engine.Sampling(max_tokens=int(rng.integers(1, 40)),
                                           temperature=float(rng.uniform(0, 2)),
                                           top_k=int(rng.integers(0, 257)),
                                           top_p=float(rng.uniform(0.1, 1)),
                                           seed=int(rng.integers(0, 2**32)),
                                           logprobs=bool(i % 2),
                                           stop_ids=tuple(rng.integers(0, 100, i % 3).tolist()))
                tool = block_tool(plain[2], plain[5], lambda ids: ids[:2])
                requests.append(eng.submit(rng.integers(0, 100, n).tolist(), sampling,
                                           n=1 + i % 3, tool=tool))
            old = eng.state
            eng.step()
            assert all(a.is_deleted() for a in jax.tree.leaves(old["cache"]))
            requests[0].cancel()
            eng.drain()
            assert all(r.done for r in requests[1:]) and requests[0].cancelled
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == [] and eng.stats["hops"] > 0
    assert not [w for w in recwarn if "donated" in str(w.message)]
    assert all(owner is None for owner in eng.owner)  # every slot free again


# --------------------------------------------------------------------------------------------------
# sharding.py: each leaf's split over the devices and the bytes it leaves each, from shapes

# 8 stacked layers, width 64, vocab 320: every layer stack and first dimension divides 8 but the
# value embeddings' stack of 4 and the (1,) scalars; TINY_MODEL's stacks of 2 layers do not divide
SHARD_MODELS = {"d8": dict(depth=8, aspect_ratio=8), "d2": {}}


def test_sharded_state_bytes_per_device():
    """Per device, --shard full holds at most 1/8 of the replicated params and optimizer state plus
    the leaves that stay replicated (no axis their kind allows divides 8), --shard optimizer the
    same of the optimizer state alone; counted from shapes, no devices needed. The optimizer state
    splits on any axis (a stack of 2 layers on a matrix's), full's params on a matrix's own
    dimensions first. A mode that needs several devices falls back to none on one, with a
    warning."""
    P = jax.sharding.PartitionSpec
    for model in (dict(depth=16, aspect_ratio=4), *SHARD_MODELS.values()):
        params = nc.param_shapes(train.model_config(320, **{**TINY_MODEL, **model}))
        opt = jax.eval_shape(lambda p: muon.init(p, *nc.param_groups(p)), params)
        replicated = sharding.memory(params, opt, 8, "none")
        p_specs, o_specs = sharding.state_specs(params, opt, 8, "full")
        kept = []  # the bytes of the leaves left whole, of the params and of the optimizer state
        for tree, specs in ((params, p_specs), (opt, o_specs)):
            leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=sharding.is_spec))
            kept.append(sum(a.size * a.dtype.itemsize for a, s in leaves if s == P()))
        full, optimizer = (sharding.memory(params, opt, 8, m) for m in ("full", "optimizer"))
        assert full["params"] + full["optimizer"] <= \
            (replicated["params"] + replicated["optimizer"]) / 8 + sum(kept)
        assert optimizer["optimizer"] <= replicated["optimizer"] / 8 + kept[1]
        assert optimizer["params"] == optimizer["grads"] == replicated["params"]
        assert full["grads"] == full["params"] < replicated["params"]
        # value embeddings: 2 or 8 tables; vocab 320 divides 8
        assert p_specs["value_embeds"] == P(None, "data")
        assert o_specs["mom"]["value_embeds"] == (P("data") if model.get("depth") == 16
                                                  else P(None, "data"))
        # the Muon stacks split on the stack axis where it divides, else on a matrix's
        assert o_specs["mom"]["h"]["mlp"]["c_fc"] == (P("data") if model.get("depth") in (8, 16)
                                                      else P(None, "data"))
        whole = [a.shape for a, s in zip(jax.tree.leaves(opt), jax.tree.leaves(
            o_specs, is_leaf=sharding.is_spec)) if s == P()]
        assert all(d % 8 for shape in whole for d in shape)  # only where no axis divides
        if model.get("depth") == 16:  # every stack divides: only the (1,) scalars stay whole
            assert sum(kept) < 64 and full["params"] * 8 - replicated["params"] < 64
    # Muon's stacks, while updated, split along the stack axis only, never across a matrix
    assert sharding.leaf_spec((8, 64, 256), 8, "stack") == P("data")
    assert sharding.leaf_spec((2, 64, 256), 8, "stack") == P()
    assert sharding.leaf_spec((2, 64, 256), 8, "any") == P(None, "data")
    assert sharding.leaf_spec((8, 64, 256), 8, "matrix") == P(None, "data")
    assert sharding.leaf_spec((8, 60, 256), 8, "matrix") == P(None, None, "data")
    assert sharding.leaf_spec((), 8, "any") == sharding.leaf_spec((8, 64), 8, None) == P()
    said = []
    assert sharding.choose_mode("full", 1, said.append) == "none" and "warning" in said[0]
    assert sharding.choose_mode(None, 8) == "optimizer" and sharding.choose_mode(None, 1) == "none"


# --------------------------------------------------------------------------------------------------
# evaluate.py: bits per byte, our tasks, CORE and ChatCORE against nanochat

def test_bits_per_byte():
    params = random_params(TINY, 11)
    x = np.asarray(jax.random.randint(jax.random.key(12), (2, 16), 0, TINY.vocab_size))
    y = np.roll(x, -1, axis=1)
    y[0, 3] = -1
    # ids with 0 bytes (specials) count neither nats nor bytes
    token_bytes = np.arange(TINY.vocab_size) % 4
    nats = np.asarray(loss_fn(params, x, y, TINY, reduction="none"))
    nb = np.where(y >= 0, token_bytes[np.maximum(y, 0)], 0)
    want = (nats * (nb > 0)).sum() / (np.log(2) * nb.sum())
    got = evaluate.evaluate_bpb(params, TINY, iter([(x, y, None)] * 3), jnp.asarray(token_bytes), 2)
    assert got == pytest.approx(want, rel=1e-5)


def test_task_evaluation_scores_exact_matches(monkeypatch):
    btok = data.byte_tokenizer()
    cfg = config(sequence_len=512, vocab_size=btok.n_vocab, n_layer=1, n_head=1, n_kv_head=1)
    # a stand-in model that knows every reference answer of two tasks and none of the others
    answers = {}

    def oracle(params, cfg, tok, prompts, n, max_tokens):  # evaluate.complete's replies
        return [[answers.get(tuple(prompt), [])] * n for prompt in prompts]

    for task in tasks.TASKS:
        for c in itertools.islice(tasks.task_conversations(task, "test"), 5):
            ids, mask = data.render_conversation(btok, c)
            prompt = data.render_for_completion(btok, c)
            if task in ("identity", "arithmetic"):
                reply = zip(ids[len(prompt):], mask[len(prompt):])
                answers[tuple(prompt)] = [t for t, m in reply if m][:-1]
    monkeypatch.setattr(evaluate, "complete", oracle)
    acc, _ = evaluate.evaluate_tasks(None, cfg, btok, n=5)
    assert acc == {"identity": 1.0, "arithmetic": 1.0, "counting": 0.0, "spelling": 0.0,
                   "docstring": 0.0}


CORE_DIR = TESTDATA / "core_eval"


@pytest.fixture(scope="session")
def nanochat_d2():
    return checkpoint.load_nanochat(str(NANOCHAT_D2))


@pytest.mark.usefixtures("on_cpu")
def test_core_equals_nanochat(nanochat_d2):
    """nanochat's own CORE code on its checkpoint (testdata/core_eval/README.md): every example's
    decision equal, mean losses within 1e-4, token rows, spans and prompts (few-shot included)
    exact, the accuracies and CORE equal."""
    params, cfg, tok = nanochat_d2
    expected = json.loads((CORE_DIR / "expected.json").read_text())
    found = evaluate.load_bundle(str(CORE_DIR / "eval_bundle"))
    # several batches a task
    out = evaluate.evaluate_core(params, cfg, tok, found, batch_tokens=512, details=True)
    assert [t["label"] for t in found] == list(expected["results"])
    for task in found:
        want, got = expected["tasks"][task["label"]], out["per_example"][task["label"]]
        dataset = CORE_DIR / "eval_bundle" / "eval_data" / want["dataset_uri"]
        lines = [l for _, l in data.json_lines(dataset, "")]
        assert task["data"] == [lines[i] for i in want["shuffled_lines"]]  # Random(1337)'s shuffle
        assert got["correct"] == [bool(c) for c in want["correct"]]
        for ex, losses in zip(want["examples"], got["mean_losses"]):
            np.testing.assert_allclose(losses, ex.get("mean_losses", [ex.get("mean_loss")]),
                                       atol=1e-4)
            if "detail" in ex:
                fewshot = [task["data"][i] for i in ex["fewshot_idx"]]
                item = task["data"][ex["idx"]]
                prompts = evaluate.core_prompts(item, task["type"], task["delimiter"], fewshot)
                assert prompts == ex["detail"]["prompts"]
                tokens = ex["detail"]["tokens"]
                if task["type"] == "language_modeling":
                    tokens = tokens[-1:]
                assert evaluate.core_example(tok, task, ex["idx"]) == (
                    tokens, ex["start_idxs"], ex["end_idxs"])
    assert out["results"] == expected["results"]
    assert out["centered_results"] == expected["centered_results"]
    assert out["core_metric"] == pytest.approx(expected["core_metric"], abs=1e-12)


@pytest.mark.slow  # five evaluate.py processes
def test_core_cli_on_four_devices_and_its_errors(tmp_path):
    """evaluate.py on a 4-device mesh (each batch's rows split over the devices) gives nanochat's
    CORE; bad bundles and checkpoints are one-line errors."""
    cmd = [sys.executable, "evaluate.py", "--nanochat-checkpoint",
           str(TESTDATA / "nanochat_checkpoint")]
    four = child_env(**emulated(4))
    run = lambda *a: subprocess.run(cmd + list(a), cwd=pathlib.Path(__file__).parent,
                                    capture_output=True, text=True, timeout=300, env=four)
    r = run("--eval-bundle", str(CORE_DIR / "eval_bundle"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "4 devices" in r.stdout
    expected = json.loads((CORE_DIR / "expected.json").read_text())
    core = json.loads(r.stdout.splitlines()[-1])["core"]
    assert core["core_metric"] == pytest.approx(expected["core_metric"])
    bad = tmp_path / "bundle"
    shutil.copytree(CORE_DIR / "eval_bundle", bad)
    (bad / "eval_data" / "opposites.jsonl").write_text('{"query": "up", "gold": 0}\n')
    for args, message in [(["--eval-bundle", str(tmp_path / "nowhere")],
                           "no core.yaml here, not an eval_bundle"),
                          (["--eval-bundle", str(bad)],
                           "opposites.jsonl: example 0 lacks one of ('query', 'choices'"),
                          (["--chat-data", str(tmp_path)], "none of the ChatCORE datasets"),
                          ([], "give --eval-bundle DIR (CORE) and/or --chat-data DIR (ChatCORE)")]:
        r = run(*args)
        assert r.returncode in (1, 2), r.stderr[-2000:]
        assert r.stderr.count("\n") == 1 and message in r.stderr, r.stderr[-2000:]


def test_core_yaml_and_bad_bundles(tmp_path):
    yaml = tmp_path / "core.yaml"
    yaml.write_text("# a comment\n"
                    "icl_tasks:\n"
                    "- label: a  # inline comment\n"
                    "  num_fewshot:\n"
                    "  - 0\n"
                    "  - 3\n"
                    "  continuation_delimiter: \"#### \\n\"\n"
                    "-\n"
                    "  label: 'it''s'\n"
                    "  num_fewshot: [10, 5]\n"
                    "  has_categories: true\n"
                    "eval_gauntlet:\n"
                    "  weighting: EQUAL\n")
    assert evaluate.read_icl_tasks(str(yaml)) == [
        {"label": "a", "num_fewshot": [0, 3], "continuation_delimiter": "#### \n"},
        {"label": "it's", "num_fewshot": [10, 5], "has_categories": True}]
    bundle = tmp_path / "b"
    shutil.copytree(CORE_DIR / "eval_bundle", bundle)
    with pytest.raises(ValueError,
                       match="task 'opposites' takes 3-shot examples from the others of its 3"):
        evaluate.load_bundle(str(bundle), max_per_task=3)
    (bundle / "eval_meta_data.csv").write_text("Eval Task,Random baseline\npydoc_qa,25\n")
    with pytest.raises(ValueError, match="no 'Random baseline' for task 'opposites'"):
        evaluate.load_bundle(str(bundle))
    (bundle / "core.yaml").write_text("icl_tasks:\n- label: x\n  what is this\n")
    with pytest.raises(ValueError, match=r"core.yaml:3: cannot read 'what is this'"):
        evaluate.load_bundle(str(bundle))


def test_core_task_types_by_hand(btok):
    """The three task types' prompts and scored spans, worked out by hand with the byte tokenizer.
    """
    mc = dict(label="mc", type="multiple_choice", num_fewshot=1, delimiter=" ",
              data=[{"query": "Pets:", "choices": ["cat", "car"], "gold": 0},
                    {"query": "Q", "choices": ["a"], "gold": 0}])
    rows, starts, ends = evaluate.core_example(btok, mc, 0)
    assert [btok.decode(r[1:]) for r in rows] == ["Q a\n\nPets: cat", "Q a\n\nPets: car"]
    # the shared prefix is not scored
    assert starts == [len("Q a\n\nPets: ca") + 1] * 2 and ends == [len(rows[0])] * 2
    schema = dict(label="s", type="schema", num_fewshot=0, delimiter=" ",
                  data=[{"context_options": ["It rained", "It was sunny"],
                         "continuation": "so it is wet.", "gold": 0}])
    rows, starts, ends = evaluate.core_example(btok, schema, 0)
    # the shared suffix
    assert [btok.decode(r[s:e]) for r, s, e in zip(rows, starts, ends)] == [" so it is wet."] * 2
    lm = dict(label="lm", type="language_modeling", num_fewshot=0, delimiter="\nAnswer: ",
              data=[{"context": "  Capital of France? ", "continuation": "Paris"}])
    (row,), (s,), (e,) = evaluate.core_example(btok, lm, 0)
    assert btok.decode(row[1:s]) == "Capital of France?\nAnswer:"
    assert btok.decode(row[s:e]) == " Paris"


def write_chat_data(root):
    """Small ChatCORE datasets in the public layouts: ARC-Easy as Hugging Face parquet,
    ARC-Challenge as AI2's own .jsonl, the others as Hugging Face .jsonl; returns {task: rows as
    written}."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    arc = [{"id": f"q{i}", "question": f"Which is number {i}?", "answerKey": "ABCD"[i % 4],
            "choices": {"text": [f"number {j}" for j in range(4)], "label": list("ABCD")}}
           for i in range(6)]
    ai2 = [{"id": "c1", "answerKey": "2", "question": {"stem": "Pick two.", "choices": [
        {"text": "one", "label": "1"}, {"text": "two", "label": "2"},
        {"text": "three", "label": "3"}]}}]
    mmlu = [{"question": f"{i} + 1 =", "subject": "math", "choices": [str(i + d) for d in range(4)],
             "answer": 1}
            for i in range(5)]
    gsm = [{"question": f"Tom has {i} apples and buys 2 more. How many?",
            "answer": f"He has {i}+2=<<{i}+2={i + 2}>>{i + 2} apples.\n#### {i + 2}"}
           for i in range(4)]
    he = [{"task_id": "HumanEval/0",
           "prompt": "import math\n\ndef root(x):\n    \"\"\"Square root.\"\"\"\n",
           "canonical_solution": "    return math.sqrt(x)\n", "entry_point": "root",
           "test": "def check(f):\n    assert f(9) == 3\n"}]
    folders = {"ai2_arc/ARC-Easy": None, "ai2_arc/ARC-Challenge": ai2, "mmlu/all": mmlu,
               "gsm8k/main": gsm,
               "openai_humaneval/openai_humaneval": he}
    for folder, rows in folders.items():
        (root / folder).mkdir(parents=True)
        if rows is not None:
            (root / folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(arc), root / "ai2_arc/ARC-Easy/test-00000-of-00001.parquet")
    train_split = "".join(json.dumps(r) + "\n" for r in gsm[::-1])
    (root / "gsm8k/main/train-00000-of-00001.jsonl").write_text(train_split)
    return {"ARC-Easy": arc, "ARC-Challenge": ai2, "MMLU": mmlu, "GSM8K": gsm, "HumanEval": he}


@pytest.mark.slow  # a model of its own, scored by hand row by row on three tasks
def test_chatcore_categorical_is_the_letters_argmax(tmp_path, btok):
    rows = write_chat_data(tmp_path)
    found = tasks.load_chat_tasks(str(tmp_path))
    order = np.random.default_rng(42).permutation(6)  # nanochat's Dataset.shuffle(seed=42)
    answers = [c["messages"][-1]["content"] for c in found["ARC-Easy"]]
    assert answers == [rows["ARC-Easy"][i]["answerKey"] for i in order]
    assert found["ARC-Challenge"][0]["messages"] == [
        {"role": "user",
         "content": "Multiple Choice question: Pick two.\n- one=1\n- two=2\n- three=3\n\n"
                    "Respond only with the letter of the correct answer."},
        {"role": "assistant", "content": "2"}]
    cfg = config(sequence_len=256, vocab_size=btok.n_vocab, n_layer=2, n_head=2)
    params = random_params(cfg, 3)
    want = {}
    # by hand: one row at a time, the full forward's last logits
    for name in ("ARC-Easy", "ARC-Challenge", "MMLU"):
        hits = []
        for c in found[name]:
            ids = data.render_for_completion(btok, c["messages"])
            # causal: the pads change no logit before
            padded = np.zeros((1, cfg.sequence_len), np.int32)
            # them, and one shape compiles once, not once a prompt length
            padded[0, :len(ids)] = ids
            z = np.asarray(forward(params, padded, cfg))[0, len(ids) - 1]
            letter_ids = [btok.encode(l)[0] for l in c["letters"]]
            best = c["letters"][int(np.argmax(z[letter_ids]))]
            hits.append(best == c["messages"][-1]["content"])
        want[name] = np.mean(hits)
    categorical = {n: found[n] for n in want}
    for batch_tokens in (256, 1 << 14):  # one row per batch, or all rows in one
        out = evaluate.evaluate_chat(params, cfg, btok, categorical, batch_tokens=batch_tokens)
        assert out["results"] == want
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "mmlu", bad / "mmlu")
    row = '{"question": "q", "choices": ["a", "b"], "answer": 7}\n'
    (bad / "mmlu/all/test.jsonl").write_text(row)
    with pytest.raises(ValueError,
                       match="mmlu/all: row 0: .*want the layout of Hugging Face's cais/mmlu"):
        tasks.load_chat_tasks(str(bad))


@pytest.mark.slow  # a model of its own through ChatCORE three times, programs in the sandbox
def test_gsm8k_humaneval_and_chatcore(tmp_path, btok, monkeypatch):
    assert tasks.gsm8k_answer("so 3 + 4 = 7\n#### 1,234.5 dollars") == "1234.5"
    assert tasks.gsm8k_answer("#### -12") == "-12"
    assert tasks.gsm8k_answer("the answer is 12") is None
    assert tasks.gsm8k_parts("It is 12/60=<<12/60=0.2>>0.2 a minute.\n#### 0.2") == [
        {"type": "text", "text": "It is 12/60="}, {"type": "python", "text": "12/60"},
        {"type": "python_output", "text": "0.2"},
        {"type": "text", "text": "0.2 a minute.\n#### 0.2"}]
    write_chat_data(tmp_path)
    found = tasks.load_chat_tasks(str(tmp_path))
    he = found["HumanEval"][0]
    reply = "Here:\n```python\ndef root(x):\n    return math.sqrt(x)\n```\nDone."
    program = tasks.humaneval_program(he, reply)
    assert program.startswith("import math\n\ndef root(x):\n") and program.endswith("check(root)")
    cfg = config(sequence_len=512, vocab_size=btok.n_vocab, n_layer=1, n_head=2)
    params = random_params(cfg, 0)

    def answer(right):  # the engine's completion replaced by the reference answer (or a wrong one)
        refs = {}
        for c in found["GSM8K"] + found["HumanEval"]:
            ref = c["messages"][-1]["content"]
            text = f"#### {tasks.gsm8k_answer(ref[-1]['text'])}" if isinstance(ref, list) else ref
            prompt = data.render_for_completion(btok, c["messages"])
            refs[tuple(prompt)] = text if right else text[:-3] + "1"
        return lambda p, cfg, tok, prompts, n, *a, **k: [[btok.encode(refs[tuple(prompt)])] * n
                                                         for prompt in prompts]

    for right in (True, False):
        monkeypatch.setattr(evaluate, "complete", answer(right))
        generative = {n: found[n] for n in ("GSM8K", "HumanEval")}
        results = evaluate.evaluate_chat(params, cfg, btok, generative)["results"]
        assert results == {"GSM8K": right, "HumanEval": right}
    out = evaluate.evaluate_chat(params, cfg, btok, found)
    baselines = (("ARC-Easy", .25), ("ARC-Challenge", .25), ("MMLU", .25), ("GSM8K", 0),
                 ("HumanEval", 0))
    centred = [(out["results"][n] - b) / (1 - b) for n, b in baselines]
    assert out["chatcore"] == pytest.approx(np.mean(centred))
    del found["MMLU"]
    # ChatCORE needs all five
    assert evaluate.evaluate_chat(params, cfg, btok, found)["chatcore"] is None


# --------------------------------------------------------------------------------------------------
# report.py: the report card, checked where train.py writes it (test_default_pipeline)


# --------------------------------------------------------------------------------------------------
# rl.py: RL's batch and loss by hand, and a reward that RL raises

# a flat schedule (no warmup, warmdown or weight decay, a constant momentum) and nanochat's lrs
FLAT = dict(num_iterations=10, warmup_steps=0, warmdown_ratio=0.0, final_lr_frac=1.0,
            momentum_start=0.95, momentum=0.95, momentum_end=0.95, momentum_warmup=1,
            weight_decay=0.0)
LRS = dict(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, scalar_lr=0.5)


@pytest.mark.slow  # RL's loss, its gradient and a step compiled for RL's weighted batch alone
def test_rl_loss_and_advantages_by_hand():
    # prompt 5 6; 7 8 and 9 sampled
    groups = [([[5, 6, 7, 8], [5, 6, 9]], [[0, 0, 1, 1], [0, 0, 1]], [1.0, 0.0]),
              # 2 at index 2: tool output
              ([[3, 4, 2, 2], [3, 4, 1, 0]], [[0, 1, 0, 1], [0, 1, 1, 1]], [1.0, 1.0])]
    x, y, w = rl.rl_batch(groups, T=5)
    # r - mean(r) of the group, no std division
    np.testing.assert_array_equal(w[:, :, 0], [[0.5, -0.5], [0, 0]])
    assert (w == w[:, :, :1]).all()
    np.testing.assert_array_equal(x[0], [[5, 6, 7, 0, 0], [5, 6, 0, 0, 0]])
    np.testing.assert_array_equal(y[0], [[-1, 7, 8, -1, -1], [-1, 9, -1, -1, -1]])
    np.testing.assert_array_equal(y[1], [[4, -1, 2, -1, -1], [4, 1, 0, -1, -1]])
    params = random_params(TINY, 3)
    # jitted: op by op, the backward pass alone compiled some 400 XLA programs (half a minute on 2
    # cores)
    loss_and_grads = jax.jit(jax.value_and_grad(train.weighted_loss), static_argnames="cfg")
    for i in range(2):  # -sum(logp * adv) / valid tokens, per prompt (a micro-batch of the step)
        logp = np.asarray(jax.nn.log_softmax(forward(params, jnp.asarray(x[i]), TINY), -1),
                          np.float64)
        valid = [(j, t) for j in range(2) for t in range(5) if y[i, j, t] >= 0]
        by_hand = -sum(logp[j, t, y[i, j, t]] * w[i, j, t] for j, t in valid) / len(valid)
        loss, grads = loss_and_grads(params, TINY, x[i], y[i], w[i])
        np.testing.assert_allclose(loss, by_hand, rtol=1e-5, atol=1e-7)
    # all rewards equal: no signal, no NaN
    assert all((np.asarray(g) == 0).all() for g in jax.tree.leaves(grads))
    p = jax.tree.map(jnp.copy, params)
    new, _, m = train.jit_train_step(p, init_opt(p), (x[1:], y[1:], w[1:]), 0, FLAT, LRS, cfg=TINY)
    assert bool(m["finite"]) and float(m["loss"]) == 0.0
    # Muon (no weight decay here) moves nothing; AdamW only
    chex.assert_trees_all_equal(new["h"], params["h"])
    # applies nanochat's fixed weight decays
    assert all(np.isfinite(a).all() for a in jax.tree.leaves(new))
    with pytest.raises(FloatingPointError, match="not all finite"):
        rl.rl_batch([([[1, 2]], [[0, 1]], [float("nan")])], T=4)


# a training run: 70 steps and 14 rounds of sampling (RL's math is checked just above)
@pytest.mark.slow
def test_rl_raises_the_reward_of_a_tiny_task(btok):
    """SFT teaches "yes" and "no" equally to one question; RL rewarding "yes" makes the model say
    it."""
    cfg = config(sequence_len=32, vocab_size=btok.n_vocab, n_layer=1, n_head=2)
    ask = lambda answer: [{"role": "user", "content": "yes?"},
                          {"role": "assistant", "content": answer}]
    # SFT in RL's shapes, (1, 16, 32) and weights, all 1 (the plain mean loss): one step compiles
    # for both
    rows = [data.render_conversation(btok, ask(a)) for a in ("yes", "no") * 8]
    pad = lambda ids, fill: ids + [fill] * (cfg.sequence_len - len(ids))
    x = np.array([pad(ids[:-1], 0) for ids, _ in rows], np.int32)[None]
    y = np.array([pad([t if m else -1 for t, m in zip(ids[1:], mask[1:])], -1)
                  for ids, mask in rows], np.int32)[None]
    params = nc.init_params(cfg, jax.random.key(0))
    opt = init_opt(params)
    for i in range(60):
        params, opt, _ = train.jit_train_step(params, opt, (x, y, np.ones(x.shape, np.float32)), i,
                                              FLAT, LRS, cfg=cfg)

    # over 64 samples, 16 at a time as the steps below draw them: one engine's programs
    def reward(params, seed):
        groups = [rl.rollout(params, cfg, btok, [(ask("yes"), tasks.check)], seed + j, 16, 8)[0]
                  for j in range(4)]
        return np.mean([g[2] for g in groups])

    before = reward(params, 100)
    assert 0.2 < before < 0.8  # SFT left both answers likely
    opt = init_opt(params)
    for i in range(10):
        groups = rl.rollout(params, cfg, btok, [(ask("yes"), tasks.check)], i, 16, 8)
        batch = rl.rl_batch(groups, cfg.sequence_len)
        params, opt, m = train.jit_train_step(params, opt, batch, i, FLAT,
                                              {k: v * 0.3 for k, v in LRS.items()},
                                              cfg=cfg)
    assert reward(params, 100) > before + 0.3


# --------------------------------------------------------------------------------------------------
# train.py: schedules, the step, checkpoints and exact resume, stages, devices and processes,
# the pipeline, the CLI

def test_schedules_follow_nanochat():
    s = dict(num_iterations=100, warmup_steps=10, warmdown_ratio=0.65, final_lr_frac=0.05,
             momentum_start=0.85, momentum=0.97, momentum_end=0.90, momentum_warmup=20,
             weight_decay=0.2)
    # (lr multiplier, momentum, wd)
    at = lambda i: np.array(train.schedules(jnp.int32(i), s), np.float64)
    expect = {0: (0.1, 0.85, 0.2), 9: (1.0, 0.904, 0.2 * 0.5 * (1 + np.cos(np.pi * 0.09))),
              # warmdown: round(0.65 * 100)
              10: (1.0, 0.91, None), 20: (1.0, 0.97, None), 35: (1.0, 0.97, None),
              68: (32 / 65 + 33 / 65 * 0.05, 0.97 - 0.07 * 33 / 65, None), 50: (None, None, 0.1),
              100: (0.05, 0.90, 0.0)}
    for i, want in expect.items():
        got = at(i)
        for g, w in zip(got, want):
            if w is not None:
                assert g == pytest.approx(w, abs=1e-6), (i, got, want)


@pytest.mark.parametrize("depth, tokens, batch, iters, lr_scale, wd", [
    # nanochat's scaling rules at vocab 32768, ratio 12 (nanochat_spec.md section 1.7)
    (12, 1.321e9, 2**19, 2520, 1.0, 0.280), (20, 5.222e9, 2**20, 4980, 1.4142, 0.100),
    (26, 11.021e9, 2**20, 10510, 1.4142, 0.0475),
])
def test_horizon_follows_nanochat(depth, tokens, batch, iters, lr_scale, wd):
    cfg = nc.config_for_depth(depth, 32768)
    steps, b, scale, weight_decay = train.horizon(
        cfg, 32, -1, train.Optim(total_batch_size=-1, batch_lr_scale=-1))
    assert (steps, b) == (iters, batch)
    assert float(f"{steps * b:.4g}") == pytest.approx(tokens, rel=2e-3)
    assert scale == pytest.approx(lr_scale, abs=1e-4)
    assert weight_decay == pytest.approx(wd, rel=1e-2)
    flops = train.horizon(cfg, 32, -1, train.Optim(total_batch_size=-1, target_flops=1e18))[0]
    assert flops == round(1e18 / (nc.estimate_flops(cfg) * batch))
    # --num-iterations wins
    assert train.horizon(cfg, 32, 7, train.Optim(total_batch_size=-1, target_flops=1e18))[0] == 7


# --------------------------------------------------------------------------------------------------
# The step

def test_step_never_recompiles():
    """train.jit_train_step itself: after its first call, new steps (so new schedule values) compile
    nothing. Its (2, 2, 16) batch is the next two tests' too, which then compile no step of their
    own."""
    s = dict(num_iterations=10, warmup_steps=2, warmdown_ratio=0.5, final_lr_frac=0.0,
             momentum_start=0.85, momentum=0.95, momentum_end=0.9, momentum_warmup=3,
             weight_decay=0.1)
    lrs = dict(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, scalar_lr=0.5)
    params = random_params(TINY, 0)
    opt = init_opt(params)
    # 2 micro-batches of 2 x 16
    x = jax.random.randint(jax.random.key(8), (2, 2, 16), 0, TINY.vocab_size)
    y = jnp.roll(x, -1, axis=2)
    losses, compiles = [], []
    listen = lambda event, *_, **__: compiles.append(event) if event == LOWERED else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for i in range(4):
            params, opt, m = train.jit_train_step(params, opt, (x, y), i, s, lrs, cfg=TINY)
            losses.append(float(m["loss"]))
            assert bool(m["finite"])
            if i == 0:  # compiled (or found compiled): from here on nothing may compile
                compiles.clear()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == []
    assert losses[-1] < losses[0]  # the same batch: loss must fall


@pytest.mark.slow  # two train steps compiled for batch shapes of their own
def test_grad_accumulation_equals_big_batch():
    x = jax.random.randint(jax.random.key(9), (4, 16), 0, TINY.vocab_size)
    y = jnp.roll(x, -1, axis=1)
    p = random_params(TINY, 10)  # again: the step donates them
    one, _, m1 = train.jit_train_step(p, init_opt(p), (x[None], y[None]), 0, FLAT, LRS, cfg=TINY)
    p = random_params(TINY, 10)  # again: the step donates them
    two, _, m2 = train.jit_train_step(p, init_opt(p), (x.reshape(2, 2, 16), y.reshape(2, 2, 16)),
                                      0, FLAT, LRS, cfg=TINY)
    np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
    chex.assert_trees_all_close(one, two, atol=2e-5)


def test_step_donates_params_and_opt_state():
    p = random_params(TINY, 0)
    opt = jax.device_put(init_opt(p))  # host zeros on the device, as train.py puts them
    x = jnp.zeros((2, 2, 16), jnp.int32)  # the shape the step was compiled for above
    train.jit_train_step(p, opt, (x, x), 0, FLAT, LRS, cfg=TINY)
    # updated in place: no second copy in memory
    assert all(a.is_deleted() for a in jax.tree.leaves((p, opt)))


# --------------------------------------------------------------------------------------------------
# Runs: exact resume, --debug, a loss that is not finite, Ctrl-C, remat

@pytest.fixture(scope="session")
def train_root(tmp_path_factory):
    """A checkpoint root holding a tokenizer trained once for every training test."""
    root = tmp_path_factory.mktemp("train")
    data.tokenizer_for(str(root), vocab_size=300)
    return root


def fresh_root(train_root, tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizer.json").write_bytes((train_root / "tokenizer.json").read_bytes())
    return str(tmp_path)


def run_base(root, iterations, seed=0, model=None, optim=None, evals=None, device_batch_size=4,
             **kwargs):
    """train.run_stage on a fresh tiny base model, wired as train.main wires TRAIN_ARGS, through the
    values API: (params, cfg, losses, info). kwargs: train.Run's (resume, save_every, debug, ...).
    """
    tok = data.Tokenizer.load(os.path.join(root, "tokenizer.json"))
    cfg = train.model_config(tok.n_vocab, **{**TINY_MODEL, **(model or {})})
    stage = train.base_stage(cfg, data.corpus(None, "train", seed=seed), jax.random.key(seed),
                             iterations)
    evals = {"eval_every": 0, "sample_every": 0, **(evals or {})}
    run = train.Run(out=root, device_batch_size=device_batch_size, **kwargs)
    return train.run_stage(stage, tok, run, train.Optim(**{**TINY_OPTIM, **(optim or {})}), evals)


def test_resume_is_bit_identical(train_root, tmp_path):
    full_root = fresh_root(train_root, tmp_path / "a")
    cut_root = fresh_root(train_root, tmp_path / "b")
    _, _, full, _ = run_base(full_root, 6)
    _, _, first, _ = run_base(cut_root, 6, save_every=3)
    assert first == full  # same seed, same machine: the same trajectory, bit for bit
    shutil.rmtree(os.path.join(cut_root, "base", "step_000006"))
    params, _, rest, _ = run_base(cut_root, 6, resume=True)
    assert rest == full[3:]
    a = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(full_root))[0]
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, a, jax.device_get(params))))
    mismatch = r"step_000006 holds Config\(.*n_layer=2.*but these flags make .*n_layer=3"
    with pytest.raises(ValueError, match=mismatch):
        run_base(cut_root, 6, model=dict(depth=3), resume=True)  # the weights would not fit
    # the tokenizer inside the atomic write
    files = ["meta.json", "opt.msgpack", "params.msgpack", "tokenizer.json"]
    assert sorted(os.listdir(checkpoint.latest_checkpoint(full_root))) == files
    assert full[-1] < full[0]


@pytest.mark.slow  # a whole step op by op: some 600 compiles, half a minute on 2 cores
def test_debug_runs_the_same_step_unjitted(train_root, tmp_path, monkeypatch):
    _, _, jitted, _ = run_base(fresh_root(train_root, tmp_path / "a"), 1)
    monkeypatch.setattr(train, "jit_train_step",
                        lambda *a, **k: pytest.fail("--debug took the jitted step"))
    eager_step, jit_off = train.train_step, []

    def unjitted(*a, **k):
        jit_off.append(jax.config.jax_disable_jit)
        return eager_step(*a, **k)

    monkeypatch.setattr(train, "train_step", unjitted)
    _, _, eager, _ = run_base(fresh_root(train_root, tmp_path / "b"), 1, debug=True)
    assert jit_off == [True]
    np.testing.assert_allclose(eager, jitted, rtol=1e-5)
    # a NaN inside the model stops at the op that made it, not at the end of the step
    loss_fn = nc.loss_fn
    monkeypatch.setattr(nc, "loss_fn",
                        lambda p, *a, **k: loss_fn({**p, "wte": p["wte"] * jnp.nan}, *a, **k))
    with pytest.raises(FloatingPointError, match="nan"):
        run_base(fresh_root(train_root, tmp_path / "c"), 1, debug=True)


def test_nonfinite_loss_stops_and_ctrl_c_saves(train_root, tmp_path, monkeypatch):
    real, handler = train.jit_train_step, signal.getsignal(signal.SIGINT)
    _, _, full, _ = run_base(fresh_root(train_root, tmp_path / "full"), 6)

    def failing(*a, **k):
        params, opt, m = real(*a, **k)
        return params, opt, {**m, "finite": m["finite"] & (a[3] < 3)}  # step 3 "diverges"
    failing.lower = real.lower  # (an accelerator's memory plan compiles the real step)

    monkeypatch.setattr(train, "jit_train_step", failing)
    with pytest.raises(FloatingPointError,
                       match="step 3: .*not finite; the last good checkpoint is .*step_000002"):
        run_base(fresh_root(train_root, tmp_path / "nan"), 6, save_every=2)
    with pytest.raises(FloatingPointError,
                       match="step 3: .*not finite; no checkpoint was saved yet .*--save-every N"):
        run_base(fresh_root(train_root, tmp_path / "nan0"), 6)

    # Ctrl-C the moment a step's update is done, before the loop has counted the step
    def ctrl_c(*a, **k):
        out = real(*a, **k)
        for _ in range(presses.get(a[3], 0)):
            # handled before it returns (os.kill may land on an XLA thread)
            signal.raise_signal(signal.SIGINT)
        return out
    ctrl_c.lower = real.lower

    root = fresh_root(train_root, tmp_path / "cut")
    monkeypatch.setattr(train, "jit_train_step", ctrl_c)
    presses = {1: 2}  # step -> Ctrl-Cs; twice: the second aborts at once, saving nothing
    with pytest.raises(KeyboardInterrupt):
        run_base(root, 6)
    assert checkpoint.latest_checkpoint(root) is None and signal.getsignal(signal.SIGINT) is handler
    # once: the run stops where params, step and data position agree, and saves there
    presses = {3: 1}
    with pytest.raises(KeyboardInterrupt,
                       match="interrupted: saved .*step_000004; continue with --resume"):
        run_base(root, 6)
    assert checkpoint.latest_checkpoint(root).endswith("step_000004")
    assert signal.getsignal(signal.SIGINT) is handler
    monkeypatch.setattr(train, "jit_train_step", real)
    _, _, rest, _ = run_base(root, 6, resume=True)
    assert rest == full[4:]  # no batch trained twice or skipped


def test_fit_device_batch_takes_the_largest_that_fits():
    """The plan's search: the largest power of two from `most` down whose step fits, each size
    compiled once, none below the first that fits and none that a refused larger size proves
    too large; a given batch is kept when it fits, and a
    one-line error names what it needs, the limit and the largest that fits when it does not."""
    tried = []

    def needs(rows):
        tried.append(rows)
        return 1e9 + rows * 0.5e9  # 1 GB of state, 0.5 GB a row
    assert train.fit_device_batch(needs, limit=5.2e9, most=64) == (8, 5e9)
    assert tried == [64, 8]  # 64 rows' 33 GB prove 32 and 16 too large: 16.5 and 8.25 GB
    tried.clear()
    assert train.fit_device_batch(needs, limit=5.2e9, most=64, base=1e9) == (8, 5e9)
    assert tried == [64, 8]
    tried.clear()
    assert train.fit_device_batch(needs, limit=4.2e9, most=64, base=1e9) == (4, 3e9)
    assert tried == [64, 4]  # the bound with the base: 8 rows need at least 5 GB
    assert train.fit_device_batch(needs, limit=5.2e9, given=4) == (4, 3e9)
    with pytest.raises(ValueError) as e:
        train.fit_device_batch(needs, limit=5.2e9, given=32)
    assert str(e.value) == ("--device-batch-size 32 needs 15.8 GiB, more than the 4.8 GiB a step "
                            "may take on a device; the largest that fits is 8")
    with pytest.raises(ValueError, match="not even one row a device fits"):
        train.fit_device_batch(needs, limit=1e9, most=4)


def test_the_plan_leaves_a_twentieth_of_the_device(monkeypatch):
    """The memory plan lets a step take PLAN_SHARE (95%) of a device's limit, where its plans have
    come 1-3% under the measured peak."""
    class Chip:
        def memory_stats(self):
            return {"bytes_limit": 16_000, "bytes_in_use": 9}
    monkeypatch.setattr(jax, "local_devices", lambda: [Chip()])
    assert train.memory_limit() == 15_200


def test_memory_plan_on_an_accelerator(train_root, tmp_path, monkeypatch, capsys):
    """On an accelerator (its memory limit faked on this CPU, the CPU compiler's plans standing in
    for the chip's) the device batch is the largest power of two whose compiled step fits, the
    micro-batches make up the step's tokens, and the startup says so; a device batch given by
    hand that does not fit is a one-line error before any step runs."""
    needs = {}
    needed_bytes = runtime.needed_bytes

    def recorded(lowered, state_bytes):
        needs[lowered.args_info[0][2][0].shape[1]] = needed_bytes(lowered, state_bytes)
        return needs[lowered.args_info[0][2][0].shape[1]]
    monkeypatch.setattr(runtime, "needed_bytes", recorded)
    # a limit between the plans of 4 and 8 rows (TINY_OPTIM's 256 tokens: 8 rows of 32 at most)
    monkeypatch.setattr(train, "memory_limit", lambda: 10**12)
    for rows in (None, 4):  # the plans of 8 rows (none given: the most) and of 4
        run_base(fresh_root(train_root, tmp_path / f"probe{rows}"), 1, device_batch_size=rows)
    monkeypatch.setattr(train, "memory_limit", lambda: (needs[4] + needs[8]) // 2)
    assert needs[4] < needs[8]
    capsys.readouterr()
    _, _, losses, info = run_base(fresh_root(train_root, tmp_path / "auto"), 2,
                                  device_batch_size=None)
    out = capsys.readouterr().out
    assert "memory plan: 2 micro-batches of 4 rows a device" in out and len(losses) == 2
    with pytest.raises(ValueError, match="^--device-batch-size 8 needs .* GiB, more than the .* "
                                         "GiB a step may take on a device; the largest that "
                                         "fits is 4$"):
        run_base(fresh_root(train_root, tmp_path / "given"), 2, device_batch_size=8)


def test_memory_plan_remembers_its_refused_compiles(tmp_path, monkeypatch):
    """XLA caches no refused compile: the plan keeps each refused program's bytes beside the
    compilation cache, so a second plan of the same step compiles only the size that fits (the
    chip's compiles faked here: each size's bytes as a function of its rows)."""
    cfg = config()
    params = jax.device_put(random_params(cfg, 47))
    opt_state = jax.device_put(muon.init(params, *nc.param_groups(params)))
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves((params, opt_state)))
    compiled = []

    def fake_needed_bytes(lowered, state_bytes):
        rows = lowered.args_info[0][2][0].shape[1]
        compiled.append(rows)
        return state_bytes + 1000 * rows
    monkeypatch.setattr(runtime, "needed_bytes", fake_needed_bytes)
    monkeypatch.setattr(train, "memory_limit", lambda: state_bytes + 2500)  # 2 rows fit
    stage = train.Stage(name="base", cfg=cfg, init=None, iterations=0)
    step_fn = functools.partial(train.jit_train_step, sched=train.base_schedule(10, 0.0),
                                lrs=train.learning_rates(), cfg=cfg)
    cache = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        for _ in range(2):
            run, _, planned = train.plan_memory(stage, train.Run(), 8 * cfg.sequence_len,
                                                step_fn, (params, opt_state, None, 0))
            assert (run.device_batch_size, planned) == (2, state_bytes + 2000)
    finally:
        jax.config.update("jax_compilation_cache_dir", cache)
    # 8 rows refused (their bytes rule out 4); then 2 rows alone: 8's refusal remembered
    assert compiled == [8, 2, 2]
    memo, = tmp_path.glob("memory-plan-*.json")
    assert list(json.loads(memo.read_text()).values()) == [state_bytes + 8000]


@pytest.mark.usefixtures("fp32_matmuls")
def test_remat_leaves_the_losses(train_root, tmp_path):
    """jax.checkpoint recomputes the same numbers: fp32 losses equal to rounding (in bf16, a chip's
    default, the recomputed program rounds otherwise: 7e-4 apart in 3 steps; a chip's exp, log and
    tanh agree to 4-5 digits between programs fused differently, as the layers scanned under remat
    are)."""
    fp32 = {"dtype": "float32"}
    _, _, plain, _ = run_base(fresh_root(train_root, tmp_path / "plain"), 3, model=fp32)
    _, _, remat, _ = run_base(fresh_root(train_root, tmp_path / "remat"), 3, model=fp32,
                              remat=True)
    np.testing.assert_allclose(remat, plain, rtol=1e-4 if on_chip() else 1e-6)


@pytest.mark.slow  # two compiles of a step 50x the tiny one's activations, 20 s
def test_remat_lowers_the_step_temp_bytes():
    """jax.checkpoint around each block lowers XLA's temp bytes of the train step. CPU XLA's
    default scheduler orders for concurrency and keeps every activation either way, so the step is
    compiled with its memory-optimized scheduler, as a memory-bound accelerator's would order it.
    The model is one whose activations outweigh the optimizer's temporaries (0.71 of the bytes):
    in smaller ones the scheduler's choices move the bytes by as much as remat saves."""
    cfg = train.model_config(300, depth=4, aspect_ratio=32, head_dim=32, max_seq_len=256)
    params = nc.param_shapes(cfg)
    opt = jax.eval_shape(lambda p: muon.init(p, *nc.param_groups(p)), params)
    x = jax.ShapeDtypeStruct((1, 4, 256), jnp.int32)
    temp = {}
    for remat in (False, True):
        lowered = train.jit_train_step.lower(params, opt, (x, x), 0, train.base_schedule(10, 0.0),
                                             train.learning_rates(), cfg=cfg,
                                             layout=train.Layout(remat=remat))
        memory_first = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
        compiled = lowered.compile(memory_first)
        temp[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[True] < 0.8 * temp[False], temp


# --------------------------------------------------------------------------------------------------
# Stages after base: SFT and RL

RL_TINY = dict(prompts=2, samples=2, max_tokens=8, eval_n=0, iterations=4)


def run_stage(root, name, iterations=None, resume=False, **stage_kwargs):
    """A tiny base (T 128), SFT or RL stage through train.run_stage, as train.main wires it.
    stage_kwargs: the stage's (rl.Settings' for RL, on top of RL_TINY)."""
    tok = data.Tokenizer.load(os.path.join(root, "tokenizer.json"))
    if name == "base":
        cfg = train.model_config(tok.n_vocab, **{**TINY_MODEL, "max_seq_len": 128})
        stage = train.base_stage(cfg, data.corpus(None, "train"), jax.random.key(0), iterations)
    elif name == "sft":
        stage = train.sft_stage(root, tok, data.corpus(None, "train"), iterations=iterations)
    else:
        given = {} if iterations is None else {"iterations": iterations}
        settings = rl.Settings(**{**RL_TINY, **given, **stage_kwargs})
        stage = train.Stage(**rl.rl_stage(root, tok, settings))
    optim = train.Optim(**{**TINY_OPTIM, "total_batch_size": 512})
    run = train.Run(out=root, device_batch_size=4, resume=resume)
    return train.run_stage(stage, tok, run, optim, {"eval_every": 0, "sample_every": 0})


@pytest.mark.slow  # base, SFT and RL stages: the pipeline
def test_rl_stage_resumes_exactly_and_saves_on_ctrl_c(train_root, tmp_path, monkeypatch):
    root = fresh_root(train_root, tmp_path / "full")
    with pytest.raises(FileNotFoundError,
                       match="no sft checkpoint under .*: run `python train.py --stage sft` first"):
        run_stage(root, "rl")
    with pytest.raises(SystemExit):  # argparse names the tasks there are
        train.parse_args(["--rl-tasks", "poetry"])
    run_stage(root, "base", 2)
    run_stage(root, "sft", 2)
    cut = shutil.copytree(root, tmp_path / "cut")
    params, _, full, _ = run_stage(root, "rl")
    assert len(full) == 4 and np.isfinite(full).all()
    _, _, meta = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(root), optimizer=False)
    assert meta["stage"] == "rl" and meta["step"] == 4 and meta["schedule"]["warmdown_ratio"] == 1.0
    real, calls = rl.rollout, []

    def ctrl_c(*a, **k):  # Ctrl-C in the middle of step 3's sampling (one batch a step)
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(rl, "rollout", ctrl_c)
    with pytest.raises(KeyboardInterrupt,
                       match="interrupted: saved .*rl.step_000003; continue with --resume"):
        run_stage(str(cut), "rl")  # the step in flight finishes, then the run saves and stops
    monkeypatch.setattr(rl, "rollout", real)
    resumed, _, rest, _ = run_stage(str(cut), "rl", resume=True)
    assert rest == full[3:]  # the same prompts and samples: the key is threaded from (seed, step)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(resumed),
                                            jax.device_get(params))))


@pytest.mark.slow  # base, SFT and RL stages: the pipeline
def test_rl_on_gsm8k_takes_nanochat_settings(train_root, tmp_path):
    """--rl-tasks gsm8k: nanochat's chat_rl settings unless a flag says otherwise, GSM8K's train
    split walked in order and rewarded by its '####' answer; a checkpoint of another tokenizer is
    refused in one line."""
    args = train.parse_args(["--rl-tasks", "gsm8k"])
    assert (args.rl_prompts, args.rl_samples, args.rl_max_tokens, args.rl_lr_frac,
            args.rl_iterations, args.rl_eval,
            args.rl_eval_every) == (16, 16, 256, 0.05, -1, 400, 60)
    assert train.parse_args(["--rl-tasks", "gsm8k", "--rl-prompts", "2"]).rl_prompts == 2
    assert train.parse_args([]).rl_prompts == 8 and train.parse_args([]).rl_eval_every == 0
    write_chat_data(tmp_path / "chat")
    root = fresh_root(train_root, tmp_path / "run")
    run_stage(root, "base", 2)
    run_stage(root, "sft", 2)
    gsm = dict(task_names=["gsm8k"], chat_data=str(tmp_path / "chat"), eval_n=2, eval_every=1,
               iterations=-1,
               lr_frac=0.05)  # --rl-tasks gsm8k's defaults, as the flags' check above found them
    tok = data.Tokenizer.load(os.path.join(root, "tokenizer.json"))
    sft_meta = os.path.join(checkpoint.latest_checkpoint(root, ("sft",)), "meta.json")
    cfg = nc.Config(**json.load(open(sft_meta))["config"])
    fits = lambda messages: len(data.render_for_completion(tok, messages)) < cfg.sequence_len - 1
    found = tasks.rl_tasks(["gsm8k"], 0, str(tmp_path / "chat"), fits)
    train_split = tmp_path / "chat/gsm8k/main/train-00000-of-00001.jsonl"
    train_rows = [json.loads(l) for l in open(train_split)]
    order = np.random.default_rng(42).permutation(4)
    # in order, then round again
    steps = [[c for c, _ in rl.rl_prompts(found, step, 2)] for step in range(3)]
    asked = [c[0]["content"] for s in steps for c in s]
    assert asked == [train_rows[i]["question"] for i in [*order, *order[:2]]]
    reward = found["gsm8k"][2]
    assert reward(steps[0][0], f"#### {tasks.gsm8k_answer(train_rows[order[0]]['answer'])}") is True
    assert reward(steps[0][0], "#### 1000") is False
    _, _, losses, info = run_stage(root, "rl", **gsm)
    assert len(losses) == 2 and np.isfinite(losses).all()  # one epoch: 4 questions / 2 a step
    assert set(info) >= {"pass@k before", "pass@k 1", "pass@k"}
    assert set(info["pass@k"]["gsm8k"]) == {"pass@1", "pass@2"}
    other = data.train_tokenizer(["a different corpus for another tokenizer"] * 50, 280)
    other.save(os.path.join(root, "tokenizer.json"))
    with pytest.raises(ValueError,
                       match="was trained with another tokenizer than .*tokenizer.json"):
        run_stage(root, "rl", **gsm)


# --------------------------------------------------------------------------------------------------
# Devices and processes: data parallel, --shard, two processes

def run_cli(root, *extra, env=None):
    cmd = [sys.executable, "train.py", "--stage", "base", "--out", root, *TRAIN_ARGS,
           "--num-iterations", "3", *extra]
    r = subprocess.run(cmd, cwd=pathlib.Path(__file__).parent, capture_output=True, text=True,
                       timeout=300, env=child_env(**(env or {})))
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(root, "base", "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line], r.stdout


@pytest.mark.slow  # three train.py processes
def test_four_devices_equal_one(train_root, tmp_path, capsys):
    """Data parallel on a 4-device mesh (--shard optimizer, the default) through TPU's
    splash-attention route (interpreted here, run per device by shard_map) trains to the losses
    of one device through the CPU route; the startup line names the route. The val loss and the
    sample at the last step run on one device of the four (outside the step's mesh), the val
    loss that of one device. (The CPU route on several devices: the --shard modes' test.)"""
    args = ("--max-seq-len", "128", "--device-batch-size", "2", "--total-batch-size", "1024",
            "--eval-every", "3", "--eval-steps", "1", "--sample-every", "3")
    _, _, one, info = run_base(fresh_root(train_root, tmp_path / "one"), 3,
                               model={"max_seq_len": 128}, optim={"total_batch_size": 1024},
                               evals=dict(eval_every=3, eval_steps=1), device_batch_size=2)
    # one device accumulates 4 micro-batches of 2 rows; four devices take 2 rows each of one
    # micro-batch of 8
    assert "(4 x 2 x 128), 1 devices, attention cpu," in capsys.readouterr().out
    four, out4 = run_cli(fresh_root(train_root, tmp_path / "splash"), *args, "--attention",
                         "splash", env=emulated(4))
    assert "(1 x 8 x 128), 4 devices, attention splash," in out4 and "sample:" in out4
    assert "--shard optimizer: per device" in out4  # several devices' default
    np.testing.assert_allclose(four, one, rtol=1e-5)
    val = float(re.search(r"^step +3 \| val bpb (\S+)$", out4, re.M)[1])
    assert val == pytest.approx(info["val_bpb"], rel=1e-4)


SHARD_CHILD = """
import json, os, shutil, sys
import test_nanochat as t
root, out = sys.argv[1], {}
for name, model in t.SHARD_MODELS.items():
    for mode in ("none", "optimizer", "full"):
        d = t.fresh_root(t.pathlib.Path(root), t.pathlib.Path(root) / f"{name}-{mode}")
        steps, save = (6, 3) if name == "d2" else (4, -1)
        out[name, mode] = t.run_base(d, steps, model=model, device_batch_size=1, shard=mode,
                                     save_every=save)[2]
shutil.rmtree(os.path.join(root, "d2-full", "base", "step_000006"))  # cut at step 3
print(json.dumps({" ".join(k): v for k, v in out.items()}))
"""


def emulated_devices(n, *cmd):
    """(the last stdout line as JSON, stdout) of python cmd in a child with n emulated devices."""
    r = subprocess.run([sys.executable, *cmd], cwd=pathlib.Path(__file__).parent, text=True,
                       capture_output=True, timeout=600,
                       env=child_env(**emulated(n)))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1]), r.stdout


@pytest.mark.slow  # two processes of 8 and 4 emulated devices
def test_shard_modes_equal_data_parallel_and_resume_on_other_devices(train_root, tmp_path):
    """--shard optimizer and full on 8 devices train to the losses of --shard none (rtol 1e-5: the
    gradient's sum is reduced in another order) over 4 steps of a model whose stacks divide 8 and
    6 of one whose do not; the full run, cut at step 3, resumes under none on 1 device and under
    optimizer on 4 with the losses of the uninterrupted run. (Data parallel against one device:
    test_four_devices_equal_one.)"""
    root = fresh_root(train_root, tmp_path / "eight")
    eight, out = emulated_devices(8, "-c", SHARD_CHILD, root)
    assert "--shard optimizer: per device" in out and "--shard full: per device" in out
    assert set(eight) == {f"{name} {mode}" for name in SHARD_MODELS for mode in sharding.MODES}
    for key, losses in eight.items():  # the modes agree with plain data parallel to fp32 noise
        assert len(losses) == (4 if key.startswith("d8") else 6), key
        np.testing.assert_allclose(losses, eight[f"{key.split()[0]} none"], rtol=1e-5, err_msg=key)
    cut = os.path.join(root, "d2-full")
    for n, mode in ((1, "none"), (4, "optimizer")):
        shutil.copytree(cut, tmp_path / mode)
        if n == 1:
            rest = run_base(str(tmp_path / mode), 6, resume=True, shard=mode)[2]
        else:
            child = ("import json, sys, test_nanochat as t; "
                     "print(json.dumps(t.run_base(sys.argv[1], 6, device_batch_size=2, "
                     "resume=True, shard='optimizer')[2]))")
            rest, out = emulated_devices(4, "-c", child, str(tmp_path / mode))
            assert "--shard optimizer: per device" in out
        # one device sums 2 micro-batches of 4 rows, 8 devices 8 rows at once: this tiny model's
        # large lrs and Muon wd amplify that reordering to some 1e-3 in 6 steps (plain data
        # parallel's gap, not the sharding's)
        np.testing.assert_allclose(rest, eight["d2 full"][3:], rtol=3e-3, err_msg=mode)


BAD_SHARD_CHILD = """
import hashlib, json, os, pathlib, sys
import jax, rl, train, test_nanochat as t
root, errors = sys.argv[1], {}
base = ["--stage", "base", "--out", root, *t.TRAIN_ARGS, "--num-iterations", "2",
        "--total-batch-size", "512", "--shard", "full"]
train.main(base)  # a checkpoint to resume


def files():  # every file under root with its contents' hash
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pathlib.Path(root).rglob("*")) if p.is_file()}
before = files()
for name, run in {
        "model": lambda: train.main(base + ["--resume", "--depth", "3"]),
        "batch": lambda: train.main(base + ["--total-batch-size", "256"]),
        "samples": lambda: rl.rl_stage(root, None, rl.Settings(samples=6))}.items():
    try:
        run()
    except ValueError as e:
        errors[name] = str(e)
print(json.dumps({"errors": errors, "unchanged": files() == before}))
"""


@pytest.mark.slow  # a process of 4 emulated devices
def test_bad_input_under_shard_on_four_devices(train_root, tmp_path):
    """Under --shard full on 4 devices, each bad input is one line that says what to do, and no
    file is written or changed: a checkpoint of another model to resume, a total batch that is not
    a multiple of the rows the mesh takes at once, RL samples that do not split over the devices."""
    out, _ = emulated_devices(4, "-c", BAD_SHARD_CHILD, fresh_root(train_root, tmp_path))
    errors = out["errors"]
    assert set(errors) == {"model", "batch", "samples"} and out["unchanged"]
    advice = "resume with the flags it was trained with, or train into another --out"
    assert advice in errors["model"]
    assert errors["batch"].startswith("--total-batch-size 256 must be a multiple of 512 ")
    assert errors["samples"].startswith("--rl-samples 6 must be a multiple of the 4 devices")
    assert all("\n" not in e for e in errors.values())


def two_process_cmd(root, iterations):
    """train.py's command line for process i (append --process-id i) of a two-process run on a free
    local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "train.py", "--stage", "base", "--out", root, *TRAIN_ARGS,
            "--num-iterations",
            str(iterations), "--device-batch-size", "4", "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2"]


@pytest.mark.slow  # a pair of train.py processes (jax.distributed)
@pytest.mark.usefixtures("loopback")
def test_two_processes_equal_one(train_root, tmp_path):
    """Two processes of one device each train as one process does under --shard full; the val
    loss and the sample at the last step and the report card (which gather the params: a
    collective every process must join) finish on both. (Two processes under --shard optimizer,
    several devices' default: test_two_processes_agree_on_ctrl_c.)"""
    # one process reading both shards, accumulating two micro-batches of 4 rows
    _, _, one, _ = run_base(fresh_root(train_root, tmp_path / "one"), 3, data_shards=2)
    root = fresh_root(train_root, tmp_path / "full")
    cmd = two_process_cmd(root, 3) + ["--shard", "full", "--eval-every", "3", "--eval-steps",
                                      "1", "--sample-every", "3"]
    procs = [subprocess.Popen(cmd + ["--process-id", str(i)],
                              cwd=pathlib.Path(__file__).parent, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env())
             for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-2000:] + outs[1][1][-2000:]
    assert "--shard full: per device" in outs[0][0]
    with open(os.path.join(root, "base", "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    two = [entry["loss"] for entry in lines if "loss" in entry]
    assert len(two) == 3  # one line per step: only process 0 writes the log
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert [entry["step"] for entry in lines if "val_bpb" in entry] == [0, 3]
    assert "sample:" in outs[0][0] and "sample:" in outs[1][0]


@pytest.mark.slow  # three train.py processes
@pytest.mark.usefixtures("loopback")
def test_two_processes_agree_on_ctrl_c(train_root, tmp_path, capsys):
    """Ctrl-C on one process of a two-process run stops both at the same step with one checkpoint
    (unless they agree, it saves while the other steps, both stuck in mismatched collectives);
    --resume trains the rest."""
    root = fresh_root(train_root, tmp_path / "two")
    cmd = two_process_cmd(root, 200)
    # files, not pipes: none blocks when full
    logs, procs = [tmp_path / f"process{i}.log" for i in range(2)], []
    for i, log in enumerate(logs):
        with log.open("w") as f:
            procs.append(subprocess.Popen(cmd + ["--process-id", str(i)],
                                          cwd=pathlib.Path(__file__).parent, stdout=f,
                                          stderr=subprocess.STDOUT, env=child_env()))
    try:
        deadline = time.time() + 300
        # both processes are in the loop
        while not re.search(r"^step +1/200", logs[0].read_text(), re.M):
            assert procs[0].poll() is None and time.time() < deadline, logs[0].read_text()[-2000:]
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGINT)  # one process only
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    outs = [f.read_text() for f in logs]
    saved = [re.search(r"^interrupted: saved (\S+); continue with --resume$", out, re.M)
             for out in outs]
    assert codes == [1, 1] and all(saved), outs[0][-2000:] + outs[1][-2000:]
    path = saved[0][1]
    assert saved[1][1] == path and checkpoint.checkpoint_dirs(os.path.join(root, "base")) == [path]
    _, _, meta = checkpoint.load_checkpoint(path)
    assert path.endswith(f"step_{meta['step']:06d}") and 1 <= meta["step"] < 200
    assert len(meta["data_states"]) == 2
    # one process, both shards
    run_base(root, 200, device_batch_size=8, data_shards=2, resume=True)
    assert f"resuming {path} at step {meta['step']}" in capsys.readouterr().out
    with open(os.path.join(root, "base", "metrics.jsonl")) as f:
        # no step twice, none skipped
        assert [json.loads(line)["step"] for line in f] == list(range(1, 201))


# --------------------------------------------------------------------------------------------------
# LoRA stages: the frozen-base step, adapter checkpoints, resume, devices
# --------------------------------------------------------------------------------------------------


def test_lora_step_trains_the_adapters_alone():
    """The one jitted step with frozen= differentiates and updates the adapters only: its state
    is the adapters and their moments (Muon's for A and B, AdamW's for the token deltas), no
    leaf of the base's shapes (gradients and optimizer state 14% of a full step's at this
    width); the compiled step outputs nothing more, the base is bit-identical after the steps
    and not donated, and the loss on a repeated batch falls."""
    s, lrs = FLAT, LRS
    base = jax.device_put(random_params(TINY, 24))
    kept = jax.device_get(base)
    frozen = lora.frozen(base, rank=4, alpha=8.0, tokens=(3, 7))
    adapters = lora.init(base, 4, lora.TARGETS, jax.random.key(25), tokens=(3, 7))
    opt = muon.init(adapters, *lora.param_groups(adapters))
    x = jax.random.randint(jax.random.key(26), (2, 2, 16), 0, TINY.vocab_size)
    y = jnp.roll(x, -1, axis=2)
    losses = []
    for i in range(6):
        adapters, opt, m = train.jit_train_step(adapters, opt, (x, y), i, s, lrs, cfg=TINY,
                                                frozen=frozen)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.05, losses
    shapes = jax.tree.map(jnp.shape, lora.init(base, 4, lora.TARGETS, jax.random.key(0), (3, 7)))
    assert shapes["tokens"] == {"wte": (2, 32), "lm_head": (32, 2)}
    # a token's wte row moves where it is an input; every lm_head column moves (the softmax)
    present = [bool((x == t).any()) for t in (3, 7)]
    assert (np.abs(adapters["tokens"]["wte"]).max(axis=1) > 0).tolist() == present
    assert np.abs(adapters["tokens"]["lm_head"]).max(axis=0).all()
    assert jax.tree.map(jnp.shape, adapters) == shapes
    assert jax.tree.map(jnp.shape, opt["mom"]) == shapes
    assert opt["var"]["attn"]["c_q"]["A"].shape == (3, 32, 1)  # NorMuon's, factored
    assert opt["var"]["tokens"]["wte"].shape == (2, 32)
    base_shapes = {a.shape for a in jax.tree.leaves(base) if a.ndim > 1}
    assert not base_shapes & {a.shape for a in jax.tree.leaves((adapters, opt))}
    state = sharding.memory(adapters, opt, 1, "none")
    full = sharding.memory(base, init_opt(base), 1, "none")
    ratio = (state["grads"] + state["optimizer"]) / (full["grads"] + full["optimizer"])
    assert 0.1 < ratio < 0.2, ratio  # width 32: rank 4 is an eighth of a matrix's rank
    # the compiled step's outputs: the adapters' state and three scalars, no gradient of the base
    # (counted from their shapes: a TPU pads each array to its tiles)
    compiled = train.jit_train_step.lower(adapters, opt, (x, y), 0, s, lrs, cfg=TINY,
                                          frozen=frozen).compile()
    new_adapters, new_opt, metrics = compiled.out_info
    assert sharding.memory(new_adapters, new_opt, 1, "none") == state
    assert [m.shape for m in metrics.values()] == [()] * 3
    chex.assert_trees_all_equal(jax.device_get(base), kept)
    assert not any(a.is_deleted() for a in jax.tree.leaves(base))


def test_lora_checkpoint_names_its_base_loads_merged_and_exports_merged(tmp_path):
    """An adapter checkpoint holds the adapters (and their optimizer state) and its base's path
    and CRC-32: load_model merges them onto that base, also after the root moved; export writes
    the merged weights, which nanochat's reader (load_nanochat) gives back bit for bit, the same
    state_dict as exporting the merged params. A missing base or another one: one-line errors."""
    cfg = nc.Config(sequence_len=64, vocab_size=265, n_layer=2, n_head=2, n_kv_head=1, n_embd=64,
                    window_pattern="L")
    tok = data.byte_tokenizer()
    base = random_params(cfg, 12)
    root = tmp_path / "checkpoints"
    meta = {"stage": "base", "step": 5, "config": dataclasses.asdict(cfg),
            "tokenizer": "tokenizer.json"}
    base_dir = checkpoint.save_checkpoint(str(root / "base"), 5, base, init_opt(base), meta,
                                          files={"tokenizer.json": tok.save})
    adapters = trained_adapters(base, 4, 13, tokens=[260, 264])
    opt = muon.init(adapters, *lora.param_groups(adapters))
    ref = checkpoint.reference(base_dir, str(root / "sft"))
    assert ref["path"] == os.path.join("..", "base", "step_000005")
    spec = {"rank": 4, "alpha": 8.0, "targets": list(lora.TARGETS), "tokens": [260, 264],
            "base": ref}
    checkpoint.save_checkpoint(str(root / "sft"), 7, adapters, opt,
                               {**meta, "stage": "sft", "step": 7, "lora": spec},
                               files={"tokenizer.json": tok.save})
    merged = jax.device_get(lora.merge(base, adapters, 2.0, np.array([260, 264])))
    params, got_cfg, _ = checkpoint.load_model(str(root))
    assert got_cfg == cfg
    chex.assert_trees_all_equal(jax.device_get(params), merged)
    # the adapter checkpoint's arrays: 8% of the base checkpoint's bytes here
    size = lambda d: sum(os.path.getsize(os.path.join(d, f)) for f in ("params.msgpack",
                                                                      "opt.msgpack"))
    assert size(root / "sft" / "step_000007") < 0.1 * size(base_dir)
    # export: the merged weights, as nanochat's reader loads them
    dest = tmp_path / "nanochat"
    path = checkpoint.main(["export", str(root), str(dest)])
    got, _, _ = checkpoint.load_nanochat(str(dest))
    chex.assert_trees_all_equal(jax.device_get(got), merged)
    again = checkpoint.export_nanochat(merged, cfg, tok, str(tmp_path / "merged"), "sft", 7)
    ours, theirs = (torch_files.read_torch_state_dict(p) for p in (path, again))
    assert ours.keys() == theirs.keys()
    assert all(np.array_equal(ours[k], theirs[k]) for k in ours)
    # moved: the base is found from the adapters' stage folder
    moved = shutil.move(str(root), str(tmp_path / "moved"))
    chex.assert_trees_all_equal(jax.device_get(checkpoint.load_model(moved)[0]), merged)
    # another base at that path, then none: nothing loads
    checkpoint.save_checkpoint(os.path.join(moved, "base"), 5, random_params(cfg, 14), None, meta,
                               files={"tokenizer.json": tok.save})
    with pytest.raises(ValueError, match=r"sft.step_000007 holds LoRA adapters of a base whose "
                       r"params have CRC-32 \d+, but .*base.step_000005 has CRC-32 \d+: restore"):
        checkpoint.load_model(moved)
    shutil.rmtree(os.path.join(moved, "base"))
    with pytest.raises(FileNotFoundError, match=r"holds LoRA adapters of .*checkpoints.base."
                       r"step_000005, which is missing: put that base checkpoint back"):
        checkpoint.load_for_export(moved)


def test_lora_bad_input_is_one_line_and_writes_nothing(train_root, tmp_path):
    root = fresh_root(train_root, tmp_path)
    with pytest.raises(ValueError, match="--lora-rank adapts a trained model: pass --stage sft"):
        train.main(["--stage", "base", "--lora-rank", "4", "--out", root, *TRAIN_ARGS])
    assert os.listdir(root) == ["tokenizer.json"]
    with pytest.raises(ValueError, match=r"--lora-rank 33 exceeds attn.c_q's smaller dimension 32 "
                       r"\(32 x 32\): pass a smaller rank"):
        lora.check(nc.param_shapes(TINY), 33, lora.TARGETS)
    with pytest.raises(ValueError, match=r"mlp.c_proj's smaller dimension 32 \(128 x 32\)"):
        lora.check(nc.param_shapes(TINY), 33, ["mlp.c_proj"])
    with pytest.raises(ValueError, match="--lora-targets 'attn.c_x' is unknown: choose among "
                       "attn.c_q attn.c_k"):
        lora.check(nc.param_shapes(TINY), 4, ["attn.c_x"])
    with pytest.raises(SystemExit):  # argparse names the targets there are
        train.parse_args(["--lora-targets", "attn.c_x"])
    stage = train.base_stage(TINY, data.corpus(None, "train"), jax.random.key(0))
    with pytest.raises(ValueError, match="base starts from none: pass --stage sft or rl"):
        train.lora_stage(stage, root, 4, 8.0, lora.TARGETS, jax.random.key(0))
    r = subprocess.run([sys.executable, "train.py", "--stage", "base", "--lora-rank", "4",
                        "--out", root], cwd=pathlib.Path(__file__).parent, capture_output=True,
                       text=True, timeout=120, env=child_env())
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "pass --stage sft" in r.stderr
    assert os.listdir(root) == ["tokenizer.json"]
    # --stage all: the base's width (64) checked before the tokenizer is trained
    empty = tmp_path / "empty"
    with pytest.raises(ValueError, match="--lora-rank 65 exceeds attn.c_q's smaller dimension"):
        train.main(["--lora-rank", "65", "--out", str(empty), *TRAIN_ARGS])
    assert not empty.exists()


def run_lora(root, name, iterations, rank=4, **run_kwargs):
    """A LoRA SFT or RL stage (RL_TINY's) on run_stage's tiny T-128 model through train.run_stage,
    as train.main wires --lora-rank; run_kwargs: train.Run's."""
    tok = data.Tokenizer.load(os.path.join(root, "tokenizer.json"))
    if name == "sft":
        stage = train.sft_stage(root, tok, data.corpus(None, "train"), iterations=iterations)
    else:
        settings = rl.Settings(**{**RL_TINY, "iterations": iterations})
        stage = train.Stage(**rl.rl_stage(root, tok, settings))
    stage = train.lora_stage(stage, root, rank, 8.0, lora.TARGETS, jax.random.key(0),
                             tokens=sorted(tok.special.values()))
    optim = train.Optim(**{**TINY_OPTIM, "total_batch_size": 512})
    run = train.Run(**{"out": root, "device_batch_size": 4, **run_kwargs})
    return train.run_stage(stage, tok, run, optim, {"eval_every": 0, "sample_every": 0})


def same_files(a, b):
    return all(pathlib.Path(a, f).read_bytes() == pathlib.Path(b, f).read_bytes()
               for f in os.listdir(a))


@pytest.mark.slow  # base, LoRA SFT (run, cut, resumed) and LoRA RL stages
def test_lora_stages_resume_exactly_and_leave_their_base(train_root, tmp_path):
    """LoRA SFT resumed from its step-2 checkpoint continues bit for bit; the base checkpoint's
    files are untouched; the step directories hold the adapters, their AdamW state and the base's
    reference; load_model gives the params the stage returned. LoRA RL on the LoRA SFT names it
    as its base, and loading it merges both. Resuming with another rank is refused."""
    root = fresh_root(train_root, tmp_path / "full")
    run_stage(root, "base", 2)
    base_dir = checkpoint.latest_checkpoint(root, ("base",))
    kept = shutil.copytree(base_dir, tmp_path / "kept")
    cut = shutil.copytree(root, tmp_path / "cut")
    params, _, full, _ = run_lora(root, "sft", 4)
    assert len(full) == 4 and np.isfinite(full).all() and same_files(base_dir, kept)
    sft_dir = checkpoint.latest_checkpoint(root, ("sft",))
    adapters, opt, meta = checkpoint.load_checkpoint(sft_dir)
    assert set(adapters) == {"attn", "mlp", "tokens"} and opt["mom"].keys() == adapters.keys()
    assert meta["lora"]["rank"] == 4 and meta["lora"]["base"]["path"] == os.path.join(
        "..", "base", "step_000002")
    chex.assert_trees_all_equal(jax.device_get(checkpoint.load_model(sft_dir)[0]),
                                jax.device_get(params))
    # cut at step 2, resumed
    _, _, first, _ = run_lora(str(cut), "sft", 4, save_every=2)
    assert first == full
    shutil.rmtree(os.path.join(cut, "sft", "step_000004"))
    resumed, _, rest, _ = run_lora(str(cut), "sft", 4, resume=True)
    assert rest == full[2:]
    chex.assert_trees_all_equal(jax.device_get(resumed), jax.device_get(params))
    with pytest.raises(ValueError, match=r"holds LoRA \{'rank': 4.*but these flags train "
                       r"\{'rank': 8.*resume with the flags and base it was trained with"):
        run_lora(str(cut), "sft", 4, rank=8, resume=True)
    # RL's adapters on SFT's adapters on the base
    rl_params, _, losses, _ = run_lora(root, "rl", 2)
    assert len(losses) == 2 and same_files(base_dir, kept)
    rl_dir = checkpoint.latest_checkpoint(root)
    assert checkpoint.load_checkpoint(rl_dir)[2]["lora"]["base"]["path"] == os.path.join(
        "..", "sft", "step_000004")
    chex.assert_trees_all_equal(jax.device_get(checkpoint.load_model(root)[0]),
                                jax.device_get(rl_params))


LORA_CHILD = """
import json, shutil, sys
import test_nanochat as t
root, out = t.pathlib.Path(sys.argv[1]), {}
for mode in ("optimizer", "full"):
    d = shutil.copytree(root / "one", root / mode, ignore=shutil.ignore_patterns("sft"))
    out[mode] = t.run_lora(str(d), "sft", 3, shard=mode, device_batch_size=1)[2]
print(json.dumps(out))
"""


@pytest.mark.slow  # a child of 4 emulated devices, 2 compiles
def test_lora_on_four_devices_equals_one(train_root, tmp_path):
    """LoRA SFT on 4 emulated devices under --shard optimizer (several devices' default) and
    full (the frozen base split as the params are) trains to one device's losses (rtol 1e-5, as
    the base stage's test)."""
    one = fresh_root(train_root, tmp_path / "one")
    run_stage(one, "base", 2)
    _, _, losses, _ = run_lora(one, "sft", 3)
    out, _ = emulated_devices(4, "-c", LORA_CHILD, str(tmp_path))
    for mode, four in out.items():
        np.testing.assert_allclose(four, losses, rtol=1e-5, err_msg=mode)


# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# The pipeline and the CLI

@pytest.mark.slow  # the whole pipeline
def test_default_pipeline(tmp_path):
    """train.main at a tiny size: tokenizer -> base -> SFT -> RL -> evaluation (CORE, ChatCORE, our
    tasks) and the report card; chat.py finds the RL model."""
    root = str(tmp_path / "run")
    write_chat_data(tmp_path / "chat")
    argv = ["--out", root, "--eval-bundle", str(CORE_DIR / "eval_bundle"),
            "--chat-data", str(tmp_path / "chat"), "--eval-max", "4",
            "--depth", "2", "--aspect-ratio", "32", "--head-dim", "16", "--max-seq-len", "128",
            "--device-batch-size", "2", "--total-batch-size", "512", "--vocab-size", "300",
            "--tokenizer-max-chars", "1e5", "--num-iterations", "3", "--sft-iterations", "2",
            "--warmup-steps", "1", "--eval-every", "1000", "--eval-steps", "1",
            "--sample-every", "0", "--eval-tasks", "1", "--compile-cache", "",
            "--rl-prompts", "2", "--rl-samples", "2", "--rl-max-tokens", "8", "--rl-eval", "1",
            "--rl-iterations", "2"]
    results = train.main(argv)
    # each chat stage is graded on the template split and the hand-written questions
    for stage in ("sft", "rl"):
        assert set(results[stage]["tasks"]) == set(tasks.TASKS)
        assert set(results[stage]["questions"]) == {"arithmetic", "counting", "spelling",
                                                    "identity"}
        assert all(0 <= a <= 1 for a in [*results[stage]["tasks"].values(),
                                         *results[stage]["questions"].values()])
        assert results[stage]["recall_bpb"] > 0
    # corpus bits/byte after each
    assert all(results[stage]["val_bpb"] > 0 for stage in ("base", "sft", "rl"))
    for stage, steps in (("base", 3), ("sft", 2), ("rl", 2)):
        with open(os.path.join(root, stage, "metrics.jsonl")) as f:
            losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
        assert len(losses) == steps and np.isfinite(losses).all()
    _, _, base = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(root, ("base",)),
                                            optimizer=False)
    _, _, sft = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(root, ("sft",)),
                                           optimizer=False)
    rl_params, _, rl = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(root, ("rl",)),
                                                  optimizer=False)
    # nanochat's chat_sft: 0.8 x the base lrs, no warmup, linear warmdown over the last half to 0,
    # no weight decay, Muon momentum 0.85 -> 0.95 over 300 steps; chat_rl: a fraction of the base
    # lrs decaying linearly to 0
    assert sft["lrs"] == pytest.approx({k: 0.8 * v for k, v in base["lrs"].items()})
    assert sft["schedule"] == {**base["schedule"], "num_iterations": 2, "warmup_steps": 0,
                               "warmdown_ratio": 0.5, "final_lr_frac": 0.0,
                               "momentum_start": 0.85, "momentum": 0.95, "momentum_end": 0.95,
                               "momentum_warmup": 300, "weight_decay": 0.0}
    frac = train.parse_args([]).rl_lr_frac
    assert rl["lrs"] == pytest.approx({k: frac * v for k, v in base["lrs"].items()})
    assert rl["schedule"]["warmdown_ratio"] == 1.0 and rl["schedule"]["final_lr_frac"] == 0.0
    assert "pass@1" in results["rl"]["pass@k before"]["counting"]
    assert "pass@2" in results["rl"]["pass@k"]["spelling"]
    # chat.py's default: the newest checkpoint of the last stage
    params, cfg, tok = checkpoint.load_model(root)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, jax.device_get(params), rl_params)))
    assert cfg == nc.Config(**base["config"]) and tok.n_vocab == 300
    assert set(results["base"]["core"]["results"]) == {"pydoc_qa", "opposites", "because_schema",
                                                       "doc_lm", "doc_lm_qa"}
    assert set(results["sft"]["chatcore"]["results"]) == set(tasks.CHAT_TASKS)
    # the report card, from each stage's report.json
    card = open(os.path.join(root, "report.md")).read()
    for stage in ("base", "sft", "rl"):
        r = json.load(open(os.path.join(root, stage, "report.json")))
        assert r["tokens"] > 0 and r["train_time"] > 0 and r["machine"]["jax"] == jax.__version__
        flops = nc.estimate_flops(nc.Config(**r["config"]))
        peak = r["machine"]["peak_flops"] * r["machine"]["devices"]
        mfu = r["tokens"] * flops / (r["train_time"] * peak)
        core = r.get("core", {}).get("core_metric")
        chatcore = r.get("chatcore", {}).get("chatcore")
        params_total = nc.num_scaling_params(cfg)["total"]
        row = (f"| {stage} | {params_total:,} | {flops:,.0f} | {r['steps']} | {r['tokens']:,} | "
               f"{r['train_time']:.0f} s | {100 * mfu:.1f}% | {r['val_bpb']:.4f} | "
               f"{'' if core is None else f'{core:.4f}'} | "
               f"{'' if chatcore is None else f'{chatcore:.4f}'} |")
        assert row in card and f"\n## {stage}\n" in card
        assert all(f"- `{p!r}` -> `{c!r}`" in card for p, c in r["samples"].items())
    assert f"| {platform.python_version()}, jax {jax.__version__} (cpu) | 1 x cpu |" in card
    assert f"CORE on `{CORE_DIR / 'eval_bundle'}`:\n\n| task | accuracy | centred |" in card
    assert f"ChatCORE tasks on `{tmp_path / 'chat'}`:\n\n| task | accuracy |" in card
    assert "| hand-written questions | arithmetic | counting | spelling | identity |" in card
    assert f"| opposites | {results['base']['core']['results']['opposites']:.4f} |" in card
    # a stage run alone rewrites the card from every stage's part
    os.remove(os.path.join(root, "report.md"))
    train.main(argv + ["--stage", "rl", "--eval-tasks", "0"])
    again = open(os.path.join(root, "report.md")).read()
    assert all(f"\n## {stage}\n" in again for stage in ("base", "sft", "rl"))
    assert "--stage rl --eval-tasks 0" in again


def test_train_cli_error_is_one_line_and_help_shows_defaults(tmp_path, capsys):
    cmd = [sys.executable, "train.py", "--stage", "tokenizer", "--data", "no/such.txt", "--out",
           str(tmp_path), "--compile-cache", ""]
    r = subprocess.run(cmd, cwd=pathlib.Path(__file__).parent, capture_output=True, text=True,
                       timeout=120, env=child_env())
    assert r.returncode == 1 and r.stderr.startswith("error: no/such.txt: no such file")
    assert r.stderr.count("\n") == 1
    r = subprocess.run(cmd[:2] + ["--rl-tasks", "poetry"], cwd=pathlib.Path(__file__).parent,
                       capture_output=True, text=True, timeout=120, env=child_env())
    # a bad flag: one line too, naming the choices
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: argument --rl-tasks: invalid choice: 'poetry' "
                               "(choose from 'identity', ")
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--matrix-lr MATRIX_LR Muon lr of the transformer's matrices (default: 0.02)" in out
    assert "--target-flops TARGET_FLOPS base training FLOPs (-1: the ratio) (default: -1.0)" in out


# --------------------------------------------------------------------------------------------------
# chat.py: the terminal, replies, the web server and its API, the page

# <= 16 tokens, as HI
HELLO = [{"role": "system", "content": "Hi."}, {"role": "user", "content": "hello"}]


def greedy_reply(model, prompt, max_tokens=32):
    """The greedy Reply to prompt ids by the reference engine.generate, the calculator on: what
    chat.py's slot engine must produce."""
    params, cfg, bt, _ = model
    reply = chat.Reply(bt)
    sampling = engine.Sampling(max_tokens=max_tokens, temperature=0.0,
                               stop_ids=data.reply_stops(bt))
    for column, _ in engine.generate(params, cfg, prompt, sampling,
                                     tool=data.calculator_tool(bt)):
        reply.add(column[0])
        if reply.finish:
            break
    if not reply.finish:
        reply.end()
    return reply


def expected_reply(model, messages, max_tokens=32):
    """The greedy reply text, its token count and the prompt's that chat.py must produce for these
    messages."""
    prompt = chat_prompt(model[2], messages)
    reply = greedy_reply(model, prompt, max_tokens)
    return reply.content, len(reply.ids), len(prompt)


def run_chat(args, stdin="", cwd=None):
    """(exit code, stdout, stderr) of `python chat.py ARGS` fed stdin; output decoded as is (no
    newline changes)."""
    r = subprocess.run([sys.executable, str(pathlib.Path(__file__).parent / "chat.py"), *args],
                       input=stdin.encode(), capture_output=True, cwd=cwd,
                       env=child_env(PYTHONIOENCODING="utf-8"), timeout=300)
    return r.returncode, r.stdout.decode(), r.stderr.decode()


@pytest.mark.slow  # three chat.py processes
def test_cli_scripted(chat_model, tmp_path):
    params, cfg, bt, root = chat_model
    # the newest step of the root: what `python chat.py` picks
    load = checkpoint.load_model(str(root))
    assert load[1] == cfg and all(jax.tree.leaves(jax.tree.map(np.array_equal, load[0], params)))
    reply, _, _ = expected_reply(chat_model, HI)

    def greedy(prompt):
        return greedy_reply(chat_model, prompt)

    # the second turn's prompt: all of the first turn, as token ids
    sp, first = bt.special, chat_prompt(bt, HI)
    first_reply = greedy(first).ids
    # cut off, not stopped: chat.py closes the turn with <|assistant_end|>
    assert len(first_reply) == 32
    second = first + first_reply + [sp["<|assistant_end|>"], sp["<|user_start|>"],
                                    *bt.encode("the sea"), sp["<|user_end|>"],
                                    sp["<|assistant_start|>"]]
    followup = greedy(second).content
    # the history matters
    assert followup != expected_reply(chat_model, [{"role": "user", "content": "the sea"}])[0]
    cache = ["--compile-cache", str(tmp_path / "xla"), "-t", "0", "-m", "32"]
    # ./checkpoints
    code, out, err = run_chat(cache, "hello\nthe sea\nclear\nhello\nquit\n", cwd=root.parent)
    assert code == 0, err
    assert out == ("nanochat: type 'clear' to start a new conversation, 'quit' to end it\n"
                   # the conversation goes on
                   f"\nUser: \nAssistant: {reply}\n\nUser: \nAssistant: {followup}\n"
                   # clear starts over
                   f"\nUser: Conversation cleared.\n\nUser: \nAssistant: {reply}\n\nUser: ")
    code, out, err = run_chat(["--checkpoint", str(root / "sft" / "step_000005"), "-p", "hello",
                               *cache])
    assert code == 0 and out == f"\nAssistant: {reply}\n", err
    code, out, err = run_chat(cache, "", cwd=tmp_path)
    assert code == 1 and "python train.py" in err and len(err.splitlines()) == 1


@pytest.mark.usefixtures("loopback")
def test_cli_errors_are_one_line(chat_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for args, match in [(["-k", "-1"], "-k"), (["-m", "0"], "-m"),
                            (["--serve", "--port", str(taken.getsockname()[1])],
                             "another --host or --port")]:
            code, _, err = run_chat(["--compile-cache", "", *args], cwd=chat_model[3].parent)
            assert code == 1 and err.startswith("error: ") and match in err, err
            assert len(err.splitlines()) == 1, err


# --------------------------------------------------------------------------------------------------
# Replies: where they stop, their UTF-8, the calculator's parts (on a stand-in engine)

class FakeEngine:
    """Stands in for chat.py's engine: each request's first choice emits `stream`, a token an event,
    and ends at a stop id ("stop") or after it ("length"); what submit was given is kept."""

    def __init__(self, stream):
        self.stream = stream
        self.cfg = CHAT_CFG
        self.calls = []
        self.warmed = threading.Event()

    def submit(self, prompt, sampling, n=1, tool=None, stream=False):
        self.calls.append({"prompt": list(prompt), "sampling": sampling, "tool": tool, "n": n})
        events = []
        for t in self.stream:
            events.append(engine.Event(0, t))
            if t in sampling.stop_ids:
                events.append(engine.Event(0, finish="stop"))
                break
        else:
            events.append(engine.Event(0, finish="length"))
        return FakeRequest(events)


class FakeRequest(list):
    """Its events, in one batch: as if one device call made them all."""

    def batches(self):
        return [list(self)]

    def cancel(self):
        pass


def test_replies_stop_and_call_the_calculator(monkeypatch, capsys, server):
    bt = data.byte_tokenizer()
    sp = bt.special
    fake = FakeEngine([*bt.encode("ok"), bt.bos, *bt.encode("more")])
    chat.chat_cli(fake, bt, "hi")
    # <|bos|> ends the reply, unprinted, whatever comes next
    assert capsys.readouterr().out == "\nAssistant: ok\n"
    monkeypatch.setattr(server, "engine", fake)
    r = json.loads(request(server, "POST", "/v1/chat/completions", {"messages": HI})[2])
    assert r["choices"][0]["message"]["content"] == "ok"
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == 3
    assert [c["sampling"].stop_ids for c in fake.calls] == [(sp["<|assistant_end|>"], bt.bos)] * 2
    # a fresh calculator per reply: no state leaks between them
    assert fake.calls[0]["tool"] is not fake.calls[1]["tool"]
    tool = fake.calls[1]["tool"]
    forced = [tool(0, t) for t in [sp["<|python_start|>"], *bt.encode("6*7"), sp["<|python_end|>"]]]
    assert forced == [[]] * 4 + [[sp["<|output_start|>"], *bt.encode("42"), sp["<|output_end|>"]]]


def test_replies_decode_utf8_incrementally(monkeypatch, server):
    bt = data.byte_tokenizer()
    b = bt.encode("é東")  # byte tokens: é is 2 bytes, 東 3

    def reply(stream):
        replies = chat.sample_replies(FakeEngine(stream), bt, [bt.bos], [chat.Reply(bt)],
                                      engine.Sampling(max_tokens=32))
        return [(t, text) for _, t, text, *_ in itertools.chain.from_iterable(replies)]

    # each once whole
    assert reply(b) == [(b[0], ""), (b[1], "é"), (b[2], ""), (b[3], ""), (b[4], "東"), (None, "")]
    assert reply(b[:4])[-1] == (None, "\ufffd")  # cut off by max_tokens: U+FFFD, not nothing
    assert reply(b[:4] + [bt.bos])[-1] == (bt.bos, "\ufffd")  # ... or by the stop token
    monkeypatch.setattr(server, "engine", FakeEngine(b[:4] + [bt.bos]))
    req = {"messages": HI, "stream": True, "stream_options": {"include_usage": True}}
    chunks = events(request(server, "POST", "/v1/chat/completions", req)[2])
    # one device call's text in one event
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]] == ["é\ufffd"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


CALCULATED = ("So ", "6*7", "42", " it is 42.")


def calculated(bt):
    """A reply's tokens that call the calculator: text, python, python_output, text,
    <|assistant_end|>."""
    sp = bt.special
    return [*bt.encode(CALCULATED[0]),
            sp["<|python_start|>"], *bt.encode(CALCULATED[1]), sp["<|python_end|>"],
            sp["<|output_start|>"], *bt.encode(CALCULATED[2]), sp["<|output_end|>"],
            *bt.encode(CALCULATED[3]), sp["<|assistant_end|>"]]


def test_reply_parts_and_stop_strings():
    """A reply's content holds no special token; its parts are what render_conversation takes back
    (so the next turn's prompt holds the model's own tokens); a stop string cuts the content, its
    beginning held back until what follows shows whether it is one."""
    bt = data.byte_tokenizer()
    r, ids = chat.Reply(bt), calculated(bt)
    said = [r.add(t) for t in ids]
    assert r.content == "So  it is 42." == "".join(text for text, _ in said)
    assert r.finish == "stop" and r.ids == ids
    kinds = ("text", "python", "python_output", "text")
    assert r.parts == [{"type": t, "text": x} for t, x in zip(kinds, CALCULATED)]
    assert [p for _, p in said if p] == r.parts[1:3]  # each calculator part once, when it closes
    conversation = [{"role": "user", "content": "6 times 7?"},
                    {"role": "assistant", "content": r.parts}]
    assert data.render_conversation(bt, conversation)[0] == chat_prompt(bt, conversation[:1]) + ids
    r, said = chat.Reply(bt, stop=["lo w", "xyz"]), []
    for t in bt.encode("hello world"):
        if not r.finish:
            said.append(r.add(t)[0])
    assert said == ["h", "e", "", "l", "", "", ""] and r.content == "hel" and r.finish == "stop"
    r = chat.Reply(bt, stop=["ab"])
    assert [r.add(t)[0] for t in bt.encode("xa")] == ["x", ""]
    assert r.end() == "a" and r.finish == "length"


def test_api_sends_calculator_steps_as_parts(monkeypatch, server):
    bt = data.byte_tokenizer()
    monkeypatch.setattr(server, "engine", FakeEngine(calculated(bt)))
    body = request(server, "POST", "/v1/chat/completions", {"messages": HI})[2]
    message = json.loads(body)["choices"][0]["message"]
    parts = [{"type": t, "text": x} for t, x in zip(("text", "python", "python_output", "text"),
                                                    CALCULATED)]
    # no special token in either
    assert message == {"role": "assistant", "content": "So  it is 42.", "parts": parts}
    chunks = events(request(server, "POST", "/v1/chat/completions",
                            {"messages": HI, "stream": True})[2])
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    # one device call's tokens: its text joined, each calculator part whole
    assert [d.get("content") or d["parts"][0]["text"] for d in deltas] == list(CALCULATED)
    assert [d["parts"][0]["type"] for d in deltas if "parts" in d] == ["python", "python_output"]


# --------------------------------------------------------------------------------------------------
# The web server and its OpenAI API

def chat_server(model, slots=4, **kwargs):
    """chat.py's server on its engine, both running; kwargs: make_server's."""
    params, cfg, bt, _ = model
    eng = chat.chat_engine(params, cfg, bt, slots=slots, waiting=kwargs.pop("waiting", None))
    srv = chat.make_server(eng, bt, port=0, **kwargs)
    eng.start()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture(scope="module")
def server(chat_model, loopback):
    srv = chat_server(chat_model, max_tokens=32, temperature=0.0)
    yield srv
    srv.shutdown()
    srv.server_close()


def request(srv, method, path, body=None, raw=None, headers=None):
    """(status, content type, body text) of one request to the test server."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=120)
    conn.request(method, path,
                 raw if raw is not None else None if body is None else json.dumps(body),
                 headers or {"Content-Type": "application/json"})
    r = conn.getresponse()
    out = r.status, r.getheader("Content-Type"), r.read().decode()
    conn.close()
    return out


def events(text):
    """The JSON payloads of a server-sent event stream, which must end with `data: [DONE]`."""
    blocks = text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""] and all(b.startswith("data: ") for b in blocks[:-1])
    return [json.loads(b[6:]) for b in blocks[:-2]]


def test_api_completion_and_models(server, chat_model):
    reply, n_out, n_in = expected_reply(chat_model, HELLO)
    status, ctype, body = request(server, "POST", "/v1/chat/completions",
                                  {"model": "nanochat", "messages": HELLO})
    assert status == 200 and ctype == "application/json"
    r = json.loads(body)
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    assert r["model"] == "nanochat"
    message = {"role": "assistant", "content": reply, "parts": [{"type": "text", "text": reply}]}
    finish = "length" if n_out == 32 else "stop"
    assert r["choices"] == [{"index": 0, "message": message, "finish_reason": finish}]
    assert r["usage"] == {"prompt_tokens": n_in, "completion_tokens": n_out,
                          "total_tokens": n_in + n_out}
    status, _, body = request(server, "GET", "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "nanochat"
    model = json.loads(body)["data"][0]
    assert model["context_length"] == 256 and model["max_tokens"] == 32
    assert json.loads(request(server, "GET", "/health")[2])["status"] == "ok"
    status, ctype, body = request(server, "GET", "/?q=hi")
    assert status == 200 and ctype.startswith("text/html")
    assert "<textarea" in body and "/v1/chat/completions" in body


def test_api_streaming(server, chat_model):
    reply, n_out, n_in = expected_reply(chat_model, HELLO)
    req = {"messages": HELLO, "stream": True, "max_tokens": 32,
           "stream_options": {"include_usage": True}}
    status, ctype, body = request(server, "POST", "/v1/chat/completions", req)
    assert status == 200 and ctype.startswith("text/event-stream")
    chunks = events(body)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2]) == reply
    assert chunks[-2]["choices"][0] == {"index": 0, "delta": {},
                                        "finish_reason": "length" if n_out == 32 else "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == n_out


@pytest.mark.slow  # three choices, stops, nucleus and logprobs: some 10 s of compiles on 2 cores
def test_api_choices_stop_top_p_and_logprobs(server, chat_model):
    params, cfg, bt, _ = chat_model
    reply, n_out, _ = expected_reply(chat_model, HELLO)
    post = lambda **kw: json.loads(request(server, "POST", "/v1/chat/completions",
                                           {"messages": HELLO, **kw})[2])
    # the server's default temperature here is 0: three copies of the greedy reply, from one batch
    r = post(n=3)
    choices = [(c["index"], c["message"]["content"]) for c in r["choices"]]
    assert choices == [(0, reply), (1, reply), (2, reply)]
    assert r["usage"]["completion_tokens"] == 3 * n_out
    a, b = (post(n=4, temperature=1.0, seed=3)["choices"] for _ in range(2))
    # one seed, one batch; the rows differ
    assert a == b and len({c["message"]["content"] for c in a}) > 1
    stop = reply[6:9]
    r = post(stop=["never written", stop])["choices"][0]
    assert r["message"]["content"] == reply[:reply.index(stop)] and r["finish_reason"] == "stop"
    # one-token nucleus
    assert post(temperature=2.0, top_p=1e-6, seed=1)["choices"][0]["message"]["content"] == reply
    r = post(logprobs=True, top_logprobs=3)["choices"][0]
    lp = r["logprobs"]["content"]
    text = b"".join(bytes(e["bytes"]) for e in lp).decode(errors="replace")
    assert text == reply == r["message"]["content"]
    for e in lp:  # greedy: each token is the likeliest
        likeliest = [t["logprob"] for t in e["top_logprobs"]]
        assert likeliest == sorted(likeliest, reverse=True)
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["bytes"] == e["bytes"]
        assert e["logprob"] < 0
    first = jax.nn.log_softmax(forward(params, np.array([chat_prompt(bt, HELLO)]), cfg)[0, -1])
    assert lp[0]["bytes"] == list(bt.enc.decode_single_token_bytes(int(first.argmax())))
    assert lp[0]["logprob"] == pytest.approx(float(first.max()), abs=1e-4)
    chunks = events(request(server, "POST", "/v1/chat/completions",
                            {"messages": HELLO, "n": 2, "stream": True})[2])
    for i in range(2):
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"][0]["index"] == i) == reply
    assert [c["finish_reason"] for c in chunks[-1]["choices"]] == [r["finish_reason"]] * 2


@pytest.mark.slow  # a server soak: every shape compiled, then 20 requests
@pytest.mark.usefixtures("loopback")
def test_no_request_compiles(chat_model):
    """After warm_up, requests with any sampling settings, seed, number of choices and prompt length
    compile nothing: a client cannot stall the others by sending new values."""
    params, cfg, bt, _ = chat_model
    eng = chat.chat_engine(params, cfg, bt, slots=4)  # the server fixture's programs
    srv = chat.make_server(eng, bt, port=0, max_tokens=3)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    compiles = []
    listen = lambda event, *_, **__: compiles.append(event) if event == LOWERED else None
    try:
        assert json.loads(request(srv, "GET", "/health")[2])["compiled"] is False
        eng.start(warm_up=True)
        assert eng.warmed.wait(600)
        health = json.loads(request(srv, "GET", "/health")[2])
        assert health == {"status": "ok", "model": "nanochat", "compiled": True}
        jax.monitoring.register_event_duration_secs_listener(listen)
        rng = np.random.default_rng(0)
        for i in range(20):
            body = {"messages": [{"role": "user", "content": "x" * int(rng.integers(1, 240))}],
                    "stream": i % 2 == 1,
                    "top_k": int(rng.integers(0, 257)), "temperature": float(rng.uniform(0, 2)),
                    "top_p": float(rng.uniform(0.05, 1)), "seed": int(rng.integers(0, 2**40)),
                    "n": int(rng.integers(1, 9)),
                    "logprobs": i % 3 == 0, "top_logprobs": 2 if i % 3 == 0 else 0,
                    "stop": ["x"] * (i % 2)}
            assert request(srv, "POST", "/v1/chat/completions", body)[0] == 200
        assert compiles == []
        engine.generate(params, cfg, [1] * 100, engine.Sampling(max_tokens=3)).__next__()
        # the listener does see compiles: generate's prompt bucket 128 in a cache of 128 was never
        # compiled in this process (a 30-token prompt's bucket 32 in a cache of 64 is the
        # sixteen-clients test's too, which may run first in the same pytest worker)
        assert compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        srv.shutdown()
        srv.server_close()
    assert params is chat_model[0]


def test_official_openai_client(server, chat_model):
    import openai  # requirements-dev.txt

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1",
                           api_key="unused")
    reply, n_out, n_in = expected_reply(chat_model, HELLO)
    assert [m.id for m in client.models.list()] == ["nanochat"]
    r = client.chat.completions.create(model="nanochat", messages=HELLO)
    assert r.choices[0].message.content == reply
    assert r.choices[0].message.parts == [{"type": "text", "text": reply}]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_in, n_out)
    stream = client.chat.completions.create(model="nanochat", messages=HELLO, stream=True, n=2,
                                            stream_options={"include_usage": True})
    texts, finish = ["", ""], {}
    for c in stream:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        usage = c.usage  # the last chunk: usage only
    assert texts == [reply] * 2 and set(finish.values()) == {"length" if n_out == 32 else "stop"}
    assert usage.completion_tokens == 2 * n_out
    r = client.chat.completions.create(model="nanochat", messages=HELLO, stop=reply[4:7], top_p=0.5,
                                       temperature=1.0, seed=0, logprobs=True, top_logprobs=2,
                                       max_tokens=16)
    assert reply[4:7] not in r.choices[0].message.content
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="nanochat",
                                       messages=[{"role": "user", "content": "x" * 300}])


def test_api_seed_and_content_parts(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"},
                                          {"type": "text", "text": "lo"}]}]
    def reply(messages, seed):
        body = {"messages": messages, "temperature": 1.0, "seed": seed}
        answer = json.loads(request(server, "POST", "/v1/chat/completions", body)[2])
        return answer["choices"][0]["message"]["content"]

    # OpenAI's text parts are the same message
    assert reply(parts, 5) == reply(HI, 5) != reply(HI, 6)


@pytest.mark.parametrize("body, status, match", [
    ("{not json", 400, "not valid JSON"),
    ([1, 2], 400, "'messages'"),
    ({"messages": []}, 400, "'messages'"),
    ({"messages": [{"role": "user", "content": "hi"}] * 501}, 400, "1 to 500"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "last message"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, 400,
     "alternate"),
    ({"messages": [{"role": "user", "content": "  "}]}, 400, "empty"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "string"),
    ({"messages": HELLO, "max_tokens": 0}, 400, "'max_tokens'"),
    ({"messages": HELLO, "max_tokens": 5000}, 400, "'max_tokens'"),
    ({"messages": HELLO, "max_completion_tokens": 2.5}, 400, "'max_completion_tokens'"),
    ({"messages": HELLO, "temperature": 3}, 400, "'temperature'"),
    ({"messages": HELLO, "stream": "yes"}, 400, "'stream'"),
    ({"messages": HELLO, "n": 9}, 400, "'n'"),
    ({"messages": HELLO, "model": "gpt-4o"}, 404, "does not exist"),
    ({"messages": HELLO, "stop": ["a", ""]}, 400, "'stop'"),
    ({"messages": HELLO, "stop": ["a"] * 5}, 400, "'stop'"),
    ({"messages": HELLO, "top_p": 1.5}, 400, "'top_p'"),
    ({"messages": HELLO, "top_k": 257}, 400, "'top_k'"),
    ({"messages": HELLO, "logprobs": 1}, 400, "'logprobs'"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs'"),
    ({"messages": HELLO, "max_tokens": 250}, 400, "and max_tokens 250, the model's context 256"),
    ({"messages": HELLO, "stream_options": 5}, 400, "'stream_options'"),
    ({"messages": HELLO, "stream_options": [{"include_usage": True}]}, 400, "'stream_options'"),
    ({"messages": HELLO, "stream_options": {"include_usage": "yes"}}, 400, "'stream_options'"),
    pytest.param("[" * 100000, 400, "not valid JSON", id="nested-too-deep"),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, 400, "context"),
    ({"messages": [{"role": "user", "content": "x" * (1 << 20)}]}, 413, "limit"),
])
def test_api_errors(server, body, status, match):
    raw = body if isinstance(body, str) else json.dumps(body)
    got, ctype, text = request(server, "POST", "/v1/chat/completions", raw=raw)
    err = json.loads(text)["error"]
    assert got == status and ctype == "application/json" and re.search(match, err["message"]), err
    assert err["type"] == "invalid_request_error"


def test_api_bad_paths_and_headers(server):
    assert request(server, "GET", "/nope")[0] == 404
    assert request(server, "POST", "/v1/completions", {})[0] == 404
    # '²': isdigit()
    for length in (b"", b"Content-Length: \xb2\r\n", b"Content-Length: %s\r\n" % (b"9" * 5000)):
        conn = socket.create_connection(server.server_address, timeout=60)
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n%s\r\n" % length)
        assert conn.makefile("rb").readline().split()[1] == b"411"
        conn.close()
    assert request(server, "GET", "/v1/models")[0] == 200  # still serving


@pytest.mark.usefixtures("loopback")
def test_server_binds_localhost_by_default(chat_model):
    srv = chat.make_server(chat.chat_engine(*chat_model[:3]), chat_model[2], port=0)
    try:
        # unreachable from other machines unless --host says so
        assert srv.server_address[0] == "127.0.0.1"
    finally:
        srv.server_close()


def test_api_concurrent_streams_do_not_interleave(server, chat_model):
    convs = [[{"role": "user", "content": x}] for x in ("cats?", "the sea")]
    expect = [expected_reply(chat_model, c)[0] for c in convs]
    assert expect[0] != expect[1]
    results = [None, None]

    def go(i):
        results[i] = request(server, "POST", "/v1/chat/completions",
                             {"messages": convs[i], "stream": True})

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for (status, _, body), reply in zip(results, expect):
        chunks = events(body)
        assert status == 200 and len({c["id"] for c in chunks}) == 1
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == reply


@pytest.mark.slow  # a 16-slot engine of its own: its programs compile for this test
@pytest.mark.usefixtures("loopback")
def test_server_serves_sixteen_clients_at_once(chat_model):
    """Sixteen clients at once, half of them streaming: each gets its own prompt's greedy reply (no
    stream crossed with another), generated together rather than one after another."""
    srv = chat_server(chat_model, slots=16, max_tokens=24, temperature=0.0)
    try:
        convs = [[{"role": "user", "content": "tell me " + "abcdefghijklmnop"[:i + 1]}]
                 for i in range(16)]
        expect = [expected_reply(chat_model, c, 24)[0] for c in convs]
        assert len(set(expect)) > 8
        results = [None] * 16

        def go(i):
            results[i] = request(srv, "POST", "/v1/chat/completions",
                                 {"messages": convs[i], "stream": i % 2 == 0})

        threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        for i, (status, _, body) in enumerate(results):
            if i % 2 == 0:
                chunks = events(body)
                assert len({c["id"] for c in chunks}) == 1
                text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
            else:
                text = json.loads(body)["choices"][0]["message"]["content"]
            assert status == 200 and text == expect[i], i
        # one after another, 16 replies of up to 24 tokens take at least 32 chunks of 16 tokens
        assert srv.engine.stats["chunks"] < 16
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.usefixtures("loopback")
def test_server_line_full_is_503_and_an_engine_failure_500(chat_model, monkeypatch):
    """Past the waiting line a request gets a 503 with Retry-After at once; an exception inside
    the engine fails the requests it was serving with a 500 (or an error event in a stream) that
    says what happened, and the engine serves the next ones afresh."""
    params, cfg, bt, _ = chat_model
    eng = chat.chat_engine(params, cfg, bt, slots=4, waiting=1)
    srv = chat.make_server(eng, bt, port=0, max_tokens=8, temperature=0.0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    reply = expected_reply(chat_model, HELLO, 8)[0]
    try:
        first = []
        waiting = threading.Thread(target=lambda: first.append(
            request(srv, "POST", "/v1/chat/completions", {"messages": HELLO})))
        waiting.start()
        while not eng.inbox:  # the engine is not running yet: the request waits in line
            time.sleep(0.01)
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_address[1], timeout=60)
        conn.request("POST", "/v1/chat/completions", json.dumps({"messages": HELLO}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        assert r.status == 503 and r.getheader("Retry-After") == "1"
        assert "waiting" in error["message"] and error["type"] == "server_error"
        conn.close()
        eng.start()
        waiting.join(120)
        assert first[0][0] == 200
        assert json.loads(first[0][2])["choices"][0]["message"]["content"] == reply
        real = engine.decode_chunk
        injected = []

        def broken(*args, **kwargs):
            if len(injected) < 2:
                injected.append(1)
                raise RuntimeError("injected fault")
            return real(*args, **kwargs)
        monkeypatch.setattr(engine, "decode_chunk", broken)
        status, _, text = request(srv, "POST", "/v1/chat/completions", {"messages": HELLO})
        message = json.loads(text)["error"]["message"]
        assert status == 500 and "RuntimeError: injected fault" in message and "afresh" in message
        status, _, text = request(srv, "POST", "/v1/chat/completions",
                                  {"messages": HELLO, "stream": True})
        assert status == 200 and "injected fault" in events(text)[-1]["error"]["message"]
        status, _, text = request(srv, "POST", "/v1/chat/completions", {"messages": HELLO})
        assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == reply
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.slow  # a server soak: 50 connections, a timeout waited out
@pytest.mark.usefixtures("loopback")
def test_stalled_clients_cannot_hold_the_server(chat_model, capfd):
    """Clients that send half a request and stall: at most max_connections hold a thread (the next
    ones get a 503 at once), each only until request_timeout; normal requests are served after it,
    and nothing logs a traceback."""
    srv = chat_server(chat_model, max_connections=8, request_timeout=3.0, max_tokens=2)
    try:
        threads = threading.active_count()
        stalled = [socket.create_connection(srv.server_address, timeout=10) for _ in range(8)]
        # half a header line, or a body shorter than its Content-Length
        for i, s in enumerate(stalled):
            half_header = b"GET / HTTP/1.1\r\nHo"
            short_body = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            s.sendall(half_header if i % 2 else short_body)
        time.sleep(0.3)
        more = [socket.create_connection(srv.server_address, timeout=10) for _ in range(42)]
        assert threading.active_count() <= threads + 8
        assert all(s.recv(4096).startswith(b"HTTP/1.1 503 Service Unavailable") for s in more)
        time.sleep(3.5)  # the stalled ones time out and free their slots
        assert request(srv, "GET", "/v1/models")[0] == 200
        status, _, text = request(srv, "POST", "/v1/chat/completions", {"messages": HELLO})
        assert status == 200 and json.loads(text)["choices"][0]["message"]["role"] == "assistant"
        for s in stalled + more:
            s.close()
    finally:
        srv.shutdown()
        srv.server_close()
    assert "Traceback" not in capfd.readouterr().err


def test_server_refuses_other_hosts_origins_and_non_json(server, chat_model):
    """DNS rebinding (a Host that is not this loopback server), pages of other origins, and POST
    bodies that are not JSON (what a cross-origin form or text/plain fetch sends without a
    preflight) are refused; the page itself, API clients (no Origin) and --allow-origin origins are
    served."""
    port = server.server_address[1]
    post = lambda headers: request(server, "POST", "/v1/chat/completions",
                                   {"messages": HELLO, "max_tokens": 2},
                                   headers={"Content-Type": "application/json", **headers})
    status, _, text = request(server, "GET", "/", headers={"Host": f"evil.example:{port}"})
    assert status == 421 and "is not this server: open it as http://127.0.0.1:" in text
    assert request(server, "GET", "/", headers={"Host": f"localhost:{port}"})[0] == 200
    status, _, text = post({"Origin": "http://evil.example"})
    assert status == 403
    assert "serve with --allow-origin http://evil.example" in json.loads(text)["error"]["message"]
    assert post({"Origin": f"http://127.0.0.1:{port}"})[0] == 200  # the page's own origin
    status, _, text = request(server, "POST", "/v1/chat/completions",
                              raw=json.dumps({"messages": HELLO}),
                              headers={"Content-Type": "text/plain"})
    assert status == 415 and "Content-Type: application/json" in text
    server.origins.add("http://localhost:3000")
    assert post({"Origin": "http://localhost:3000"})[0] == 200


def test_api_disconnect_frees_the_model(server, chat_model, capsys):
    """A client gone mid-stream frees its slot (its generation stops); a request served beside it
    does not notice."""
    messages = [{"role": "user", "content": "go on"}]
    _, n_out, _ = expected_reply(chat_model, messages, 200)
    assert n_out == 200  # this model does not stop by itself: the disconnect must stop it
    beside = []
    other = [{"role": "user", "content": "and you?"}]
    thread = threading.Thread(target=lambda: beside.append(request(
        server, "POST", "/v1/chat/completions", {"messages": other, "max_tokens": 200,
                                                 "stream": True})))
    thread.start()
    body = json.dumps({"messages": messages, "stream": True, "max_tokens": 200}).encode()
    conn = socket.create_connection(server.server_address, timeout=60)
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    received = b""
    while b"data: " not in received:
        received += conn.recv(4096)
    conn.close()  # mid-stream
    # the lock is free
    status, _, text = request(server, "POST", "/v1/chat/completions", {"messages": HELLO})
    reply = json.loads(text)["choices"][0]["message"]["content"]
    assert status == 200 and reply == expected_reply(chat_model, HELLO)[0]
    log = capsys.readouterr().err
    n = int(re.search(r"client went away after (\d+) tokens", log)[1])
    assert n < 200
    thread.join(120)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in events(beside[0][2]))
    assert content == expected_reply(chat_model, other, 200)[0]


# --------------------------------------------------------------------------------------------------
# The page, in a real browser

def devtools_evaluate(chromium, url, user_data_dir, expression, timeout=90):
    """Open url in headless chromium and return the value of an awaited JS expression, in real time.
    Speaks the DevTools protocol over --remote-debugging-pipe (commands on fd 3, replies on fd 4,
    NUL-separated JSON); --virtual-time-budget would race ahead of a stream that a slow machine has
    not finished sending."""
    to_chrome, from_chrome = os.pipe(), os.pipe()
    proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_chrome[0]} 4>&{from_chrome[1]}',
                             "bash", chromium, "--headless", "--no-sandbox", "--disable-gpu",
                             "--no-first-run", "--disable-sync", "--disable-background-networking",
                             "--disable-component-update", "--disable-quic",
                             "--remote-debugging-pipe", f"--user-data-dir={user_data_dir}", url],
                            pass_fds=(to_chrome[0], from_chrome[1]), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    os.close(to_chrome[0]), os.close(from_chrome[1])
    writer, reader = os.fdopen(to_chrome[1], "wb"), os.fdopen(from_chrome[0], "rb")
    deadline, ids = time.monotonic() + timeout, itertools.count(1)

    def call(method, session=None, **params):
        n = next(ids)
        writer.write(json.dumps({"id": n, "method": method, "params": params}
                                | ({"sessionId": session} if session else {})).encode() + b"\0")
        writer.flush()
        buffer = b""
        while True:  # skip events and replies to other calls
            left = max(0.0, deadline - time.monotonic())
            assert select.select([reader], [], [], left)[0], "chromium timed out"
            chunk = reader.read1(1 << 16)
            assert chunk, "chromium exited: " + proc.stderr.read().decode()[-2000:]
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for message in map(json.loads, messages):
                if message.get("id") == n:
                    return message

    try:
        targets = call("Target.getTargets")["result"]["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        attached = call("Target.attachToTarget", targetId=page["targetId"], flatten=True)
        session = attached["result"]["sessionId"]
        # the first tries may land in about:blank, whose context the navigation destroys
        while True:
            r = call("Runtime.evaluate", session, expression=expression, awaitPromise=True,
                     returnByValue=True)
            if "result" in r and "exceptionDetails" not in r["result"]:
                return r["result"]["result"]["value"]
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
        writer.close(), reader.close()


@pytest.mark.slow  # a browser
def test_browser_streams_a_reply(server, chat_model, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium binary (apt-get install -y chromium)")
    # greedy, the server's -m (below half the context)
    reply = expected_reply(chat_model, HI, 32)[0]
    # compiled
    body = {"messages": HI, "stream": True}
    assert request(server, "POST", "/v1/chat/completions", body)[0] == 200
    # the page sends q as the first message
    url = f"http://127.0.0.1:{server.server_address[1]}/?q=hello"
    # the reply is finished when "typing" is gone
    done = """new Promise(resolve => { const poll = setInterval(() => {
      if (document.querySelector(".assistant") && !document.querySelector(".typing")) {
        clearInterval(poll);
        resolve([...document.querySelectorAll("#log .msg")].map(m => [m.className, m.textContent]));
      } }, 50); })"""
    bubbles = devtools_evaluate(chromium, url, tmp_path, done)
    assert bubbles == [["msg user", "hello"], ["msg assistant", reply]]  # streamed in full


@pytest.mark.slow  # a browser
def test_browser_holds_a_conversation(server, monkeypatch, tmp_path):
    """Five turns in the real page: a calculator step shows as "expr = result" (no special token);
    the page sends each reply back as its parts (the next prompt holds the model's own tokens, not
    their text); once the conversation outgrows what leaves half the context for the reply, the
    oldest turns go, with a note."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no chromium binary (apt-get install -y chromium)")
    bt = data.byte_tokenizer()
    sp, reply, prompts = bt.special, calculated(bt), []

    # the model: every turn the same calculator reply
    fake = FakeEngine(reply)
    monkeypatch.setattr(server, "engine", fake)
    # -m over half the context: the page asks for 128
    monkeypatch.setitem(server.defaults, "max_tokens", 512)
    talk = """(async () => {
      for (let i = 1; i <= 5; i++) {
        input.value = `What is 6 times 7? (${i})`;
        form.requestSubmit();
        await new Promise(resolve => { const poll = setInterval(() => {
          if (document.querySelectorAll(".assistant").length === i
              && !document.querySelector(".typing")) {
            clearInterval(poll);
            resolve();
          } }, 50); });
      }
      return [[...document.querySelectorAll("#log > *")].map(m => [m.className, m.textContent]),
              [...document.querySelectorAll(".assistant .step")].map(m => m.textContent)];
    })()"""
    shown, steps = devtools_evaluate(chromium, f"http://127.0.0.1:{server.server_address[1]}/",
                                     tmp_path, talk)
    user = lambda i: [sp["<|user_start|>"], *bt.encode(f"What is 6 times 7? ({i})"),
                      sp["<|user_end|>"]]
    # reply ends with <|assistant_end|>
    turn = lambda i: user(i) + [sp["<|assistant_start|>"]] + reply
    ask = lambda *turns: [bt.bos, *itertools.chain(*map(turn, turns[:-1])), *user(turns[-1]),
                          sp["<|assistant_start|>"]]
    # an exchange is 48 tokens and the page asks for 128 of the 256: from the fourth turn on, two
    # exchanges fit
    prompts = [call["prompt"] for call in fake.calls]
    assert prompts == [ask(1), ask(1, 2), ask(1, 2, 3), ask(2, 3, 4), ask(3, 4, 5)]
    answer = ["msg assistant", "So 6*7 = 42 it is 42."]  # the step is a span of its own
    note = lambda n: ["note", f"The {n} oldest messages no longer fit the model's 256-token "
                              "context: it does not see them."]
    q = lambda i: ["msg user", f"What is 6 times 7? ({i})"]
    assert shown == [q(1), answer, q(2), answer, q(3), answer, note(2), q(4), answer, note(4), q(5),
                     answer]
    assert steps == ["6*7 = 42"] * 5


# --------------------------------------------------------------------------------------------------
# scaling_fits.py: fits on synthetic data with known exponents, SVG plots

E0, A0, B0, ALPHA0, BETA0 = 1.7, 400.0, 410.0, 0.34, 0.28  # Chinchilla-like truth
SVG = "{http://www.w3.org/2000/svg}"


def chinchilla_rows(noise=0.003, seed=0):
    """IsoFLOP runs drawn from L = E + A/N^alpha + B/D^beta (C = 6ND), 7 sizes per budget around the
    optimum."""
    rng, rows = np.random.default_rng(seed), []
    G = (ALPHA0 * A0 / (BETA0 * B0)) ** (1 / (ALPHA0 + BETA0))
    for C in (1e17, 3e17, 1e18, 3e18):
        for f in np.geomspace(1 / 8, 8, 7):
            N = f * G * (C / 6) ** (BETA0 / (ALPHA0 + BETA0))
            D = C / (6 * N)
            L = (E0 + A0 / N**ALPHA0 + B0 / D**BETA0) * np.exp(rng.normal(0, noise))
            rows.append({"flops_budget": C, "params_transformer": N, "params_lm_head": 0.0,
                         "params_total": N, "tokens_trained": D, "val_bpb": L})
    return rows


def inside(x, ci):
    return ci[0] <= x <= ci[1]


def test_isoflop_recovers_exponents():
    rows = chinchilla_rows()
    iso = scaling_fits.fit_isoflop(rows)
    ci = scaling_fits.bootstrap(scaling_fits.fit_isoflop, rows, ["a", "b", "ratio"], 100, 0,
                                group=lambda r: r["flops_budget"])
    a_true = BETA0 / (ALPHA0 + BETA0)
    assert inside(a_true, ci["a"]) and inside(1 - a_true, ci["b"]), (ci, a_true)
    # D = C / 6N exactly
    assert abs(iso["a"] - a_true) < 0.02 and abs(iso["a"] + iso["b"] - 1) < 1e-6
    assert ci["ratio"][0] < iso["ratio"] < ci["ratio"][1]


def test_isoflop_parametric_bootstrap():
    """The fixed-design bootstrap: intervals around the truth, sigma near the noise put in, none
    without freedom."""
    rows = chinchilla_rows()
    iso = scaling_fits.fit_isoflop(rows)
    ci, sigma, dof = scaling_fits.parametric_bootstrap(scaling_fits.fit_isoflop, rows,
                                                      iso["fitted"], iso["n_params"], ["a", "b"],
                                                      n=100)
    a_true = BETA0 / (ALPHA0 + BETA0)
    assert inside(a_true, ci["a"]) and inside(1 - a_true, ci["b"]), ci
    assert ci["a"][1] - ci["a"][0] < 0.1, ci
    L = np.array([r["val_bpb"] for r in rows])
    # the noise put in (multiplicative, 0.3%)
    assert dof == 28 - 4 * 3 and 0.5 < sigma / (0.003 * L.mean()) < 2
    # 3 sizes per budget: a parabola each, exactly
    three = [r for i, r in enumerate(rows) if i % 7 in (2, 3, 4)]
    iso = scaling_fits.fit_isoflop(three)
    np.testing.assert_allclose(iso["fitted"], [r["val_bpb"] for r in three])
    ci, sigma, dof = scaling_fits.parametric_bootstrap(scaling_fits.fit_isoflop, three,
                                                      iso["fitted"], iso["n_params"], ["a"])
    assert dof == 0 and np.isnan(sigma) and np.isnan(ci["a"]).all()


def test_chinchilla_fit_recovers_parameters():
    rows = chinchilla_rows()
    N, D, L = (np.array([r[k] for r in rows])
               for k in ("params_total", "tokens_trained", "val_bpb"))
    starts = np.array(list(itertools.product([0, 5, 10], [0.5, 1.0], [0, 5, 10], [0.5, 1.0],
                                             [0.0, 0.5])), float)
    fit = scaling_fits.fit_chinchilla(N, D, L, starts=starts)
    refit = lambda rs: scaling_fits.fit_chinchilla([r["params_total"] for r in rs],
                                                   [r["tokens_trained"] for r in rs],
                                                   [r["val_bpb"] for r in rs],
                                                   starts=fit["theta"][None])
    ci = scaling_fits.bootstrap(refit, rows, ["alpha", "beta", "E"], 60, 0)
    for k, true in (("alpha", ALPHA0), ("beta", BETA0), ("E", E0)):
        assert inside(true, ci[k]) and inside(fit[k], ci[k]), (k, fit[k], ci[k])
    assert abs(fit["alpha"] - ALPHA0) < 0.03 and abs(fit["beta"] - BETA0) < 0.03
    # analyze's intervals: multiplicative
    pred = fit["E"] + fit["A"] / N ** fit["alpha"] + fit["B"] / D ** fit["beta"]
    ci, sigma, dof = scaling_fits.parametric_bootstrap(refit, rows, pred, 5, ["alpha", "beta", "E"],
                                                      60, 0, log=True)
    assert dof == 23 and 0.002 < sigma < 0.004  # the 0.3% noise the rows were drawn with
    # 90% intervals, 1.5x: about 98% under normality
    for k, true in (("alpha", ALPHA0), ("beta", BETA0), ("E", E0)):
        lo, hi = ci[k]
        widened = (lo - (hi - lo) / 4, hi + (hi - lo) / 4)
        assert inside(fit[k], ci[k]) and inside(true, widened), (k, fit[k], ci[k])


def test_chinchilla_fit_exact_on_noiseless_data():
    rows = chinchilla_rows(noise=0.0)
    N, D, L = (np.array([r[k] for r in rows])
               for k in ("params_total", "tokens_trained", "val_bpb"))
    starts = np.array([[5.0, 0.5, 5.0, 0.5, 0.0], [10.0, 1.0, 0.0, 0.5, 0.5]])
    fit = scaling_fits.fit_chinchilla(N, D, L, starts=starts)
    np.testing.assert_allclose([fit["E"], fit["alpha"], fit["beta"]], [E0, ALPHA0, BETA0],
                               rtol=1e-3)


def test_power_law_recovers_alpha():
    rng = np.random.default_rng(1)
    N = np.geomspace(1e5, 1e8, 8)
    L = (E0 + A0 * N**-ALPHA0) * np.exp(rng.normal(0, 0.003, 8))
    rows = [{"N": n, "L": l} for n, l in zip(N, L)]
    fit = scaling_fits.fit_power(N, L)
    refit = lambda rs: scaling_fits.fit_power([r["N"] for r in rs], [r["L"] for r in rs],
                                              starts=fit["theta"][None])
    ci = scaling_fits.bootstrap(refit, rows, ["alpha", "E"], 100, 0)
    assert inside(ALPHA0, ci["alpha"]) and inside(E0, ci["E"]), (fit, ci)


def test_fits_are_deterministic():
    rows = chinchilla_rows()
    f = lambda: scaling_fits.bootstrap(scaling_fits.fit_isoflop, rows, ["a"], 20, 3,
                                       group=lambda r: r["flops_budget"])
    assert f() == f()


def test_svg_is_well_formed(tmp_path):
    path = scaling_fits.svg_plot(str(tmp_path / "p.svg"), [
        {"x": [1e5, 1e6, 1e7], "y": [3.0, 2.5, 2.7], "label": "C = 1e12"},
        {"x": [1e5, 1e7], "y": [3.1, 2.8], "label": "C = <2e12> & more"},
        {"x": np.geomspace(1e5, 1e7, 20), "y": np.linspace(3, 2.6, 20), "kind": "line",
         "label": "fit"}],
        "title", "N", "bpb", logy=True)
    root = ET.parse(path).getroot()
    assert root.tag == SVG + "svg"
    assert len(root.findall(SVG + "polyline")) == 1 and len(root.findall(SVG + "circle")) == 5
    texts = [t.text for t in root.findall(SVG + "text")]
    # decade ticks, escaped legend
    assert "1e6" in texts and "C = <2e12> & more" in texts and "title" in texts


# --------------------------------------------------------------------------------------------------
# scaling.py: sweeps that resume, adaptive grids, seeds trained together, the corpora

@pytest.mark.parametrize("flags", [["--depths", "0"], ["--budgets", "-1"],
                                   ["--sweep", "scale_d", "--tokens", "0"],
                                   ["--adaptive", "--width", "2"], ["--jobs", "-1"],
                                   ["--repeat", "-1"]])
def test_sweep_bad_sizes_are_refused(flags, tmp_path, capsys):
    with pytest.raises(SystemExit):
        scaling.main([*flags, "--out", str(tmp_path)])
    assert "must be 1 or more" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.slow  # a real sweep's runs: four trainings
def test_seeds_trained_together_equal_one_by_one(train_root, tmp_path):
    """scaling.train_together: three runs (two seeds, two matrix learning rates) vmapped in one
    program give the losses and val bits per byte that train.run_stage gives each alone (fp32:
    batched matmuls sum in another order)."""
    runs = [(0, 0.02), (1, 0.02), (1, 0.04)]
    evals = dict(eval_every=5, eval_steps=2)
    alone = [run_base(fresh_root(train_root, tmp_path / f"s{seed}_{lr}"), 5, seed,
                      optim=dict(matrix_lr=lr), evals=evals)
             for seed, lr in runs]
    tok = data.Tokenizer.load(os.path.join(fresh_root(train_root, tmp_path / "together"),
                                           "tokenizer.json"))
    cfg = train.model_config(tok.n_vocab, **TINY_MODEL)
    stages = [train.base_stage(cfg, data.corpus(None, "train", seed=s), jax.random.key(s), 5)
              for s, _ in runs]
    lrs = [train.learning_rates(train.Optim(matrix_lr=lr)) for _, lr in runs]
    cfg, steps, losses, bpb = scaling.train_together(stages, tok, 4, train.Optim(**TINY_OPTIM),
                                                   data.corpus(None, "val"), 2, lrs)
    assert cfg == alone[0][1] and steps == 5 and losses.shape == (5, 3)
    np.testing.assert_allclose(losses, np.array([r[2] for r in alone]).T, rtol=2e-5)
    np.testing.assert_allclose(bpb, [r[3]["val_bpb"] for r in alone], rtol=2e-5)
    assert len({tuple(c) for c in losses.T}) == 3  # seeds and learning rates really differ


def test_sweep_resume_skips_finished_runs(tmp_path):
    csv_path, calls = str(tmp_path / "scale_c.csv"), []

    def fake(specs):  # a runner trains one spec's seeds in a call
        assert len({scaling_fits.run_key(dict(s, seed=0)) for s in specs}) == 1
        calls.extend(specs)
        return [{"depth": s["depth"], "model_dim": s["model_dim"],
                 "params_transformer": 1000 * s["depth"], "params_lm_head": 10,
                 "params_total": 2000, "tokens_trained": 1e4, "val_bpb": 3.0 / s["depth"],
                 "train_time_sec": 1.0}
                for s in specs]

    specs = scaling.plan("scale_c", [2, 3, 4], budgets=[1e10, 2e10])
    assert len(specs) == 6 and all(s["num_iterations"] >= 1 for s in specs)
    rows = scaling.run_sweep(specs, csv_path, fake, seeds=[0])
    assert len(calls) == 6 and len(rows) == 6 and set(rows[0]) == set(scaling_fits.COLUMNS)
    scaling.run_sweep(specs, csv_path, fake, seeds=[0])
    assert len(calls) == 6  # everything done: nothing reruns
    with open(csv_path) as f:
        lines = f.readlines()
    with open(csv_path, "w") as f:  # an interrupted sweep: the last row never got written
        f.writelines(lines[:-1])
    scaling.run_sweep(specs, csv_path, fake, seeds=[0])
    assert len(calls) == 7 and calls[-1]["depth"] == specs[-1]["depth"]
    # another seed is another run; seed 0 is done
    scaling.run_sweep(specs, csv_path, fake, seeds=[0, 1])
    assert len(calls) == 13 and len(scaling_fits.read_results(csv_path)) == 12
    assert {c["seed"] for c in calls[7:]} == {1}
    # a multi-host run's other processes
    scaling.run_sweep(specs[:1], csv_path, fake, seeds=[2], write=False)
    assert len(calls) == 14 and len(scaling_fits.read_results(csv_path)) == 12


def test_worker_starts_no_run_after_ctrl_c(monkeypatch):
    """A --jobs worker interrupted in a run (which saved it) or between runs starts none of the runs
    queued to it."""
    calls = []

    def run(specs):
        calls.append(specs)
        if specs == ["a"]:
            raise KeyboardInterrupt("interrupted: saved")
        return ["row"]
    monkeypatch.setattr(scaling, "_WORKER", {"stopped": False, "run": run})
    assert scaling._worker_run(["b"]) == ["row"]
    with pytest.raises(KeyboardInterrupt, match="saved"):
        scaling._worker_run(["a"])
    with pytest.raises(KeyboardInterrupt, match="not started"):
        scaling._worker_run(["c"])
    assert calls == [["b"], ["a"]]
    monkeypatch.setattr(scaling, "_WORKER", {"stopped": False, "run": run})
    with pytest.raises(KeyboardInterrupt):
        scaling._interrupted()  # Ctrl-C between runs
    with pytest.raises(KeyboardInterrupt, match="not started"):
        scaling._worker_run(["d"])


def test_sweep_ctrl_c_says_how_to_resume(monkeypatch, tmp_path):
    """Ctrl-C in a sweep's run (which saved it) ends the sweep with one line that says to run the
    same command again, not the run's own `--resume` advice, which is train.py's."""
    def runner(specs):
        raise KeyboardInterrupt("interrupted: saved runs/d2/base/step_000003; "
                                "continue with --resume")
    monkeypatch.setattr(scaling, "train_runner", lambda **kwargs: runner)
    with pytest.raises(KeyboardInterrupt) as e:
        scaling.main(["--no-adaptive", "--depths", "2", "--budgets", "1e11", "--jobs", "1",
                      "--corpus", "docstrings", "--out", str(tmp_path)])
    assert str(e.value) == ("interrupted: the runs in progress saved a checkpoint; "
                            "the same command resumes the sweep")


@pytest.mark.parametrize("width", [3, 4])
def test_adaptive_sweep_keeps_each_optimum_inside_its_grid(tmp_path, width):
    """On losses from known Chinchilla exponents: each budget's grid is centred on the running
    estimate of N*(C) and widened until its optimum (the vertex of its isoFLOP parabola) has runs on
    either side, whatever the first guess; a resumed sweep retrains nothing; the isoFLOP fit then
    recovers a."""
    sizes = {d: 3000.0 * d**3 for d in range(2, 80)}
    csv_path, calls = str(tmp_path / "scale_c.csv"), []

    def fake(specs):
        calls.extend(specs)
        rows = []
        for s in specs:
            N = sizes[s["depth"]]
            D = s["flops_budget"] / (6 * N)
            rows.append({"depth": s["depth"], "model_dim": 16 * s["depth"], "params_transformer": N,
                         "params_lm_head": 0.0, "params_total": N, "tokens_trained": D,
                         "train_time_sec": 1.0, "val_bpb": E0 + A0 / N**ALPHA0 + B0 / D**BETA0})
        return rows

    spec_of = lambda d, c: {"flops_budget": c, "depth": d, "model_dim": 16 * d, "num_iterations": 1}
    budgets = [1e15, 1e16, 1e17, 5e17]
    rows = scaling.adaptive_sweep(budgets, csv_path, fake, spec_of, sizes, width=width)
    for c in budgets:
        here = [r for r in rows if r["flops_budget"] == c]
        n_star = scaling_fits.fit_isoflop(here)["optima"][0, 1]
        sizes_here = [sizes[r["depth"]] for r in here]
        # runs on both sides of the optimum
        assert min(sizes_here) < n_star < max(sizes_here), (c, here)
        assert len(here) <= 6  # the grid follows N*(C): it does not sweep every size
    n = len(calls)
    resumed = scaling.adaptive_sweep(budgets, csv_path, fake, spec_of, sizes, width=width)
    assert resumed == rows and len(calls) == n
    assert abs(scaling_fits.fit_isoflop(rows)["a"] - BETA0 / (ALPHA0 + BETA0)) < 0.1
    # a second seed:
    more = scaling.adaptive_sweep(budgets, csv_path, fake, spec_of, sizes, width=width, repeat=2)
    # at the two best sizes of every budget up to a tenth of the largest, nothing else trained again
    for c in budgets:
        here = {r["depth"]: r["val_bpb"] for r in rows if r["flops_budget"] == c}
        again = sorted(r["depth"] for r in more if r["flops_budget"] == c and r["seed"] == 1)
        assert again == (sorted(sorted(here, key=here.get)[:2]) if c <= 5e16 else [])
    assert len(calls) == n + 2 * 2 and more[:len(rows)] == rows


@pytest.mark.parametrize("bpb, trained", [
    # best on the edge, vertex inside: noise
    ({1: 3.0, 2: 2.151, 3: 2.163, 4: 2.352, 5: 2.610}, [2, 3, 4, 5]),
    # vertex below d2
    ({d: 2 + 0.5 * (3 * np.log10(d / 1.5)) ** 2 for d in range(1, 6)}, [1, 2, 3, 4, 5]),
    # curving down: the best run's edge decides
    ({1: 2.3, 2: 2.0, 3: 2.2, 4: 2.35, 5: 2.45}, [1, 2, 3, 4, 5])])
def test_adaptive_sweep_widens_for_the_vertex_not_for_an_edge_run(tmp_path, capsys, bpb, trained):
    """A grid grows only while its parabola's vertex (the N* the isoFLOP fit reports) lies outside
    it, or, where the runs do not curve upward, while its best run sits on an edge; a best run on
    the edge of a flat bottom is not enough (the first bpb are a real budget's: d2 best by 0.012,
    the vertex between d2 and d3)."""
    sizes = {d: 3000.0 * d**3 for d in range(1, 10)}
    fake = lambda specs: [{"depth": s["depth"], "params_transformer": sizes[s["depth"]],
                           "params_lm_head": 0.0,
                           "tokens_trained": 1.0, "val_bpb": bpb[s["depth"]]} for s in specs]
    spec_of = lambda d, c: {"flops_budget": c, "depth": d, "model_dim": d, "num_iterations": 1}
    rows = scaling.adaptive_sweep([120 * sizes[3] ** 2], str(tmp_path / "scale_c.csv"), fake,
                                  spec_of, sizes)
    # the first grid: d2-d5, around d3 = (C / 120)^0.5
    assert sorted(r["depth"] for r in rows) == trained
    assert "smallest" not in capsys.readouterr().out


def test_adaptive_sweep_never_reads_past_the_corpus(tmp_path, capsys):
    """A run whose tokens the corpus does not hold is never trained: the grid stops at the smallest
    size that fits, and the sweep says its optimum may lie on the edge, as it does when the best run
    is the smallest size there is."""
    sizes = {d: 3000.0 * d**3 for d in range(2, 80)}
    fake = lambda specs: [{"depth": s["depth"], "params_transformer": sizes[s["depth"]],
                           "params_lm_head": 0.0,
                           # smaller: better
                           "tokens_trained": s["tokens"], "val_bpb": s["depth"] / 100}
                          for s in specs]
    tokens = lambda d, c: c / (6 * sizes[d])
    every = lambda d, c: {"flops_budget": c, "depth": d, "model_dim": d, "num_iterations": 1,
                          "tokens": tokens(d, c)}
    spec_of = lambda d, c: every(d, c) if tokens(d, c) <= 1e6 else None
    rows = scaling.adaptive_sweep([1e15], str(tmp_path / "scale_c.csv"), fake, spec_of, sizes)
    fits = [d for d in sizes if tokens(d, 1e15) <= 1e6]
    assert max(r["tokens_trained"] for r in rows) <= 1e6
    assert min(r["depth"] for r in rows) == min(fits) > 2
    said = capsys.readouterr().out
    assert f"d{min(fits)}, is the smallest whose tokens fit in the corpus" in said
    # every size fits: the best is d2
    scaling.adaptive_sweep([1e15], str(tmp_path / "all.csv"), fake, every, sizes)
    assert "the smallest run, d2, is the smallest model there is" in capsys.readouterr().out
    with pytest.raises(SystemExit,
                       match="3 sizes have runs that fit in the corpus, a grid needs 4"):
        scaling.adaptive_sweep([1e15], str(tmp_path / "small.csv"), fake, spec_of,
                               {d: sizes[d] for d in range(2, 42)})


@pytest.mark.slow  # a real sweep's runs
def test_corpus_room_is_what_a_run_reads_once(tmp_path):
    """corpus_room is exact: a run of room / batch steps reads every token at most once (data_epoch
    0), one step more reads the corpus's first documents again."""
    path = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)
    words = ["spam", "eggs", "ham", "x = 1"]
    # more documents than the loader's buffer holds
    texts = (" ".join(rng.choice(words, n)) for n in rng.integers(3, 12, 3000))
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    shape = scaling.Shape(batch=128, vocab_size=270, aspect_ratio=32, head_dim=32, T=32)
    settings = scaling.RunSettings(str(tmp_path), shape=shape, device_batch_size=4, eval_steps=1,
                                   data_paths=[str(path)])
    runner = scaling.train_runner(settings)
    room = scaling.corpus_room(data.Tokenizer.load(str(tmp_path / "tokenizer.json")), [str(path)],
                               4, 32)
    steps = room // 128
    rows = runner([{"depth": 1, "num_iterations": n, "seed": 0} for n in (steps, steps + 1)])
    assert steps > 10 and [r["data_epoch"] for r in rows] == [0, 1]


@pytest.mark.slow  # a real sweep's corpus: 45 MB of source read and written
def test_python_source_corpus(tmp_path):
    path = scaling.python_source(str(tmp_path))
    docs = [json.loads(line)["text"] for line in open(path)]
    # this Python's, numpy's and jax's source
    assert len(docs) > 150_000 and sum(map(len, docs)) > 45_000_000
    assert len(set(docs)) == len(docs) and all(docs)  # repeats dropped
    assert np.percentile([len(d) for d in docs], 90) < 400  # about one 128-token row each
    mtime = os.path.getmtime(path)
    # written once
    assert scaling.python_source(str(tmp_path)) == path and os.path.getmtime(path) == mtime
    train_docs = list(itertools.islice(data.corpus([path], "train")(0), 2000))
    val_docs = list(itertools.islice(data.corpus([path], "val")(0), 100))
    assert train_docs[0] == docs[0] and not set(train_docs) & set(val_docs)


@pytest.mark.slow  # a real sweep, in two worker processes too
def test_tiny_real_sweep(tmp_path, monkeypatch):
    for name, value in OFF_CHIP.items():  # the --jobs workers, spawned with this environment
        monkeypatch.setenv(name, value)

    def sweep(out, *depths, extra=()):
        scaling.main(["--sweep", "scale_c", "--no-adaptive", "--corpus", "docstrings",
                      "--jobs", "1", "--depths", *depths, "--budgets", "1.5e9", "--out", out,
                      "--batch", "512", "--seq-len", "32", "--vocab-size", "300",
                      "--aspect-ratio", "32", "--head-dim", "32", *extra, "--bootstrap", "5",
                      "--train-args",
                      "--tokenizer-max-chars 200000 --eval-steps 2 --compile-cache="])
        return scaling_fits.read_results(os.path.join(out, "scale_c.csv"))

    out, jobs = str(tmp_path / "res"), ("--jobs", "2")
    rows = sweep(out, "1", "2", extra=jobs)  # two worker processes, a core each
    assert [r["depth"] for r in rows] == [1, 2] and all(np.isfinite(r["val_bpb"]) for r in rows)
    assert all(r["num_iterations"] >= 2 and r["tokens_trained"] == 512 * r["num_iterations"]
               for r in rows)
    ET.parse(os.path.join(out, "isoflop.svg"))
    mtime = os.path.getmtime(os.path.join(out, "scale_c.csv"))
    sweep(out, "1", "2", extra=jobs)  # resumed: both runs are in the CSV, nothing trains
    assert os.path.getmtime(os.path.join(out, "scale_c.csv")) == mtime
    # one vmapped program in this process; its seed 0 is the worker's run (not bit for bit: the
    # worker, pinned to one core, runs XLA on fewer threads, and batched matmuls sum in another
    # order)
    seeds = sweep(str(tmp_path / "together"), "1", extra=("--seeds", "2", "--together"))
    assert [r["seed"] for r in seeds] == [0, 1]
    assert seeds[0]["val_bpb"] == pytest.approx(rows[0]["val_bpb"], rel=1e-4)
    assert seeds[1]["val_bpb"] != seeds[0]["val_bpb"]


# --------------------------------------------------------------------------------------------------
# bench.py: memory per device, step and decode timings, nanochat's infer_bench schema

# wide and short: the weights outweigh the activations
MEMORY_CFG = config(sequence_len=16, vocab_size=256, n_layer=4, n_embd=256)
MEMORY_CHILD = """
import json, bench, test_nanochat as t
out = {mode: bench.step_memory(t.MEMORY_CFG, 4, 1, mode, attention="plain")
       for mode in ("none", "optimizer", "full")}
one, two = (bench.step_memory(t.MEMORY_CFG, 4, b, "full", attention="plain")["total_bytes"]
            for b in (1, 2))
bench.bench_memory(t.MEMORY_CFG, 4, 1, "full", False, "plain",
                   fit=(one / 2e9, one / 1e9, two / 1e9))
print(json.dumps(out))
"""


@pytest.mark.slow  # a child of 4 emulated devices, 8 compiles
def test_bench_memory():
    """bench.py memory's numbers on 4 emulated devices: the state bytes are sharding.memory's,
    the arguments alias the params and optimizer state (donated), the total adds XLA's parts;
    from none to optimizer to full the total falls, and full's temporaries are at most 0.7 of
    none's (0.52 measured; with whole stacks gathered for each layer, 0.91). --fit doubles the
    batch while it fits and names the largest power of two for each budget; the README's
    command parses."""
    out, stdout = emulated_devices(4, "-c", MEMORY_CHILD)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"bench"')]
    params = nc.param_shapes(MEMORY_CFG)
    opt = jax.eval_shape(lambda p: muon.init(p, *nc.param_groups(p)), params)
    for mode, r in out.items():
        state = sharding.memory(params, opt, 4, mode)
        assert [r["params_bytes"], r["grads_bytes"], r["optimizer_bytes"]] == \
            [state["params"], state["grads"], state["optimizer"]], mode
        assert r["aliased_bytes"] == state["params"] + state["optimizer"], mode
        assert r["arguments_bytes"] >= r["aliased_bytes"] + 2 * 4 * 16 * 4 // 4  # + the rows
        assert r["total_bytes"] == (r["arguments_bytes"] + r["outputs_bytes"]
                                    - r["aliased_bytes"] + r["temporaries_bytes"])
    assert out["none"]["total_bytes"] > out["optimizer"]["total_bytes"] > out["full"]["total_bytes"]
    assert out["full"]["temporaries_bytes"] < 0.7 * out["none"]["temporaries_bytes"]
    *measured, summary = lines
    totals = {r["device_batch_size"]: r["total_bytes"] for r in measured}
    assert list(totals) == [1, 2, 4] and totals[1] == out["full"]["total_bytes"]
    assert totals[1] < totals[2] < totals[4]  # it stopped past the largest budget
    assert list(summary["fits"].values()) == [0, 1, 2] and summary["shard"] == "full"
    import bench
    args = bench.parse_args(["memory", "--depth", "26", "--shard", "full", "--remat", "--fit",
                             "16", "32", "80"])
    assert (args.depth, args.devices, args.max_seq_len, args.fit) == (26, 8, 2048, [16, 32, 80])


@pytest.mark.slow  # a bench.py process, then a step and an engine compiled for the benchmark alone
def test_bench_json_lines():
    """bench.py: `accel` says in one JSON line that it needs an accelerator and exits 0; the timing
    helpers it and `decode` / `train` print from give their fields."""
    r = subprocess.run([sys.executable, "bench.py", "accel"], cwd=pathlib.Path(__file__).parent,
                       capture_output=True, text=True, timeout=300, env=child_env())
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1]) == {
        "bench": "accel",
        "skipped": "no GPU or TPU here; run it where one is (CPU: bench.py train)"}
    import bench
    g = bench.generate_timing(random_params(TINY, 0), TINY, 2, prompt_len=5, new=4, repeats=1)
    assert g["batch"] == 2 and g["new_tokens"] == 4
    assert g["decode_tok_per_s"] > 0 and g["prefill_ms"] > 0
    t = bench.train_step_timing(TINY, 2, steps=1, warmup=1)
    assert np.isfinite(t["loss"]) and 0 < t["step_s"] and t["first_call_s"] > 0


# nanochat's scripts/infer_bench.py writes these keys (commit 92d63d4): ours must too
INFER_BENCH_KEYS = {
    "source", "step", "model_config", "gpu", "peak_bandwidth_bytes_per_sec", "total_vram_bytes",
    "num_params", "param_dtypes", "weight_bytes", "kv_bytes_per_token", "kv_read_bytes_per_step",
    "context_mid", "peak_flops_per_sec", "decode_flops_per_token", "ceiling_bs1_tok_per_sec",
    "max_full_context_rows", "prompt_tokens", "decode_tokens", "temperature", "sweep", "prefill"}
INFER_BENCH_SWEEP_KEYS = {"batch_size", "ttft_sec", "tpot_sec", "tok_per_sec", "mbu_percent",
                          "mfu_percent", "peak_vram_bytes", "decode_steps"}


@pytest.mark.slow  # engines of their own for a tiny model
def test_bench_serve_and_infer_bench(monkeypatch, capsys, tmp_path):
    """bench.py serve: streams through the engine report their tokens and latencies; its
    --infer-bench ends with one JSON document of nanochat's infer_bench schema, whose MBU and MFU
    follow nanochat's formulas from the document's own numbers."""
    import bench, bench_serving
    eng = engine.Engine(random_params(TINY, 0), TINY, slots=4, kmax=4)
    r = bench_serving.serve_streams(eng, [[1, 2, 3], [4, 5]], 10)
    assert r["streams"] == 2 and r["tokens"] == 20 and 0 < r["ttft_ms_p50"] <= r["ttft_ms_p95"]
    assert r["device_calls_per_token"] < 0.5 and r["host_hops_per_token"] == 0
    monkeypatch.setitem(bench_serving.CONFIGS, "tiny", TINY)
    bench_serving.bench_infer("tiny", batch_sizes=(1, 2), decode_tokens=8, kmax=4)
    *lines, doc = map(json.loads, capsys.readouterr().out.splitlines())
    assert set(doc) == INFER_BENCH_KEYS and doc["prompt_tokens"] == 56
    assert [set(row) for row in doc["sweep"]] == [INFER_BENCH_SWEEP_KEYS] * 2
    assert set(doc["prefill"]) == {"tok_per_sec", "mfu_percent", "time_sec"}
    # TINY: 3 layers, K*D = 16 channels of k and of v, fp32; every window past context 60
    assert doc["kv_bytes_per_token"] == 3 * 2 * 16 * 4
    # an int8 cache: a byte a value, a 4-byte scale each of the 2 heads
    assert bench_serving.decode_costs(TINY, 60, "int8")[1] == 3 * 2 * (16 + 2 * 4)
    assert doc["kv_read_bytes_per_step"] == 2 * 16 * 4 * (60 + 60 + 60)
    # the physical floor: the matmuls' weights (TINY's blocks, smear gate and lm_head), fp32
    shapes = nc.param_shapes(TINY)
    floor = 4 * sum(nc.count(shapes[name]) for name in ("h", "smear_gate", "lm_head"))
    for line, row in zip(lines, doc["sweep"]):
        moved = doc["weight_bytes"] + row["batch_size"] * doc["kv_read_bytes_per_step"]
        read = floor + row["batch_size"] * doc["kv_read_bytes_per_step"]
        # the document holds tpot to the microsecond and MBU to a hundredth: bound both roundings
        bandwidth = doc["peak_bandwidth_bytes_per_sec"]
        for key, nbytes in (("mbu_percent", moved), ("physical_mbu_percent", read)):
            slowest, fastest = (100 * nbytes / (row["tpot_sec"] + d) / bandwidth
                                for d in (5e-7, -5e-7))
            assert slowest - 0.005 <= line[key] <= fastest + 0.005
        assert line["mbu_percent"] == row["mbu_percent"] and row["decode_steps"] == 7
    # the seconds each batch's engine took to start: batch 2's compiled programs of 2 slots
    assert lines[0]["start_s"] >= 0 and lines[1]["start_s"] > 0
    # --chat-traffic: requests at once through an engine after its warm-up (TINY's context 64:
    # replies of 32 tokens, prompts of 31)
    bench_serving.bench_chat_traffic("tiny", 3, kmax=4)
    line = json.loads(capsys.readouterr().out)
    assert line["streams"] == line["slots"] == 3 and line["tokens"] == 3 * 32
    assert line["compiles_after_warm_up"] == 0 and line["reply_tokens"] == 32
    assert 0 < line["ttft_ms_p50"] <= line["ttft_ms_p95"]
    assert 0 < line["tpot_ms_p50"] <= line["tpot_ms_p95"]
    # pages of 16 tokens (a quarter of 64): 4 a conversation, all held at once
    assert line["pages"] == line["pages_peak"] == 3 * 4
    assert line["cache_bytes"] == engine.state_bytes(TINY, 3, None, 12)
    # --decode-chunk: one chunk program alone; every row decodes every step of 3 calls
    bench_serving.bench_decode_chunk("tiny", 3, positions=(10, 20), kmax=4, calls=2)
    line = json.loads(capsys.readouterr().out)
    assert line["tokens"] == 3 * 4 * 3 and 10 <= line["positions"][0] <= line["positions"][1] <= 20
    assert line["start_s"] >= 0 and line["compile_s"] > 0  # (a CPU's engine checks no memory)
    assert line["view"] == 64 and line["tok_per_s"] == pytest.approx(3e3 / line["step_ms"], 1e-2)
    with pytest.raises(SystemExit, match="no room for 6 chunks of 16 tokens; pass a smaller"):
        bench_serving.bench_decode_chunk("tiny", 3)
    # one row owns fewer pages than a context's, the fewest an engine holds
    bench_serving.bench_decode_chunk("tiny", 1, positions=(10, 20), kmax=4, calls=2)
    assert json.loads(capsys.readouterr().out)["tokens"] == 1 * 4 * 3
    # --profile: as many calls again traced; a step's ops run once a step (the while loop's body)
    bench_serving.bench_decode_chunk("tiny", 2, positions=(10, 20), kmax=4, calls=2,
                                     profile=str(tmp_path))
    timed, traced = map(json.loads, capsys.readouterr().out.splitlines())
    (ops,) = traced["ops"].values()  # one process on a CPU
    assert traced["view"] == timed["view"] and len(ops) == 20
    assert all(ms > 0 for _, ms, _ in ops) and any(runs == 1 for _, _, runs in ops)
    assert [ms for _, ms, _ in ops] == sorted((ms for _, ms, _ in ops), reverse=True)
    # and from the command line: its rows, positions, kmax and cache
    calls = []
    monkeypatch.setattr(bench_serving, "bench_decode_chunk", lambda *a, **k: calls.append((a, k)))
    bench_serving.serve(bench.parse_args(["serve", "--decode-chunk", "d20", "--rows", "3",
                                          "--positions", "1690", "1872", "--kv-cache", "int8"]))
    assert calls == [(("d20", 3, (1690, 1872)), {"kmax": 16, "kv_cache": "int8", "profile": None})]


@pytest.mark.usefixtures("fp32_matmuls")
def test_bench_agreement_counts_the_replies_that_differ(tmp_path, nanochat_d2, monkeypatch,
                                                       capsys):
    """bench.py serve --agreement: held-out questions (3 here) greedy through the engine
    at once against each one's reply alone; in fp32 all equal but the one whose reply alone is
    made to differ at its third token, which it names."""
    import bench_serving
    params, cfg, tok = nanochat_d2
    meta = {"stage": "sft", "step": 1, "config": dataclasses.asdict(cfg),
            "tokenizer": "tokenizer.json"}
    step_dir = checkpoint.save_checkpoint(str(tmp_path / "sft"), 1, params, None, meta)
    tok.save(os.path.join(step_dir, "tokenizer.json"))
    generate = engine.generate
    calls = []

    def one_altered(*args, **kwargs):  # the second question's third token, one id higher
        for i, (column, mask) in enumerate(generate(*args, **kwargs)):
            yield ([column[0] + 1] if len(calls) == 1 and i == 2 else column), mask
        calls.append(1)
    monkeypatch.setattr(engine, "generate", one_altered)
    questions = tasks.load_questions
    monkeypatch.setattr(tasks, "load_questions", lambda path: questions(path)[:3])
    bench_serving.bench_agreement(str(tmp_path / "sft"), max_tokens=4, slots=2)
    line = json.loads(capsys.readouterr().out)
    assert len(calls) == line["replies"] == 3
    assert line["equal"] == 2 and line["first_differences"] == [2]


# --------------------------------------------------------------------------------------------------
# The documented commands: docs/pieces.md's snippets, and every `python <script>.py ...` of
# README.md and docs/*.md runs or parses

@pytest.mark.slow  # the snippets run op by op: some 300 compiles (each piece has a quick test too)
def test_readme_snippets_run():
    """docs/pieces.md: block, attention, Muon on another model, the train step and CORE, each
    alone."""
    section = (pathlib.Path(__file__).parent / "docs" / "pieces.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", section, re.S)
    # each checks its own result
    assert len(snippets) == 5 and all("assert " in s for s in snippets)
    for code in snippets:
        exec(compile(code, "docs/pieces.md", "exec"), {})


DOCS = [pathlib.Path(__file__).parent / "README.md",
        *sorted((pathlib.Path(__file__).parent / "docs").glob("*.md"))]
# Run word for word (the others need data, a network, an accelerator or minutes), in a directory
# whose checkpoints/base holds testdata's nanochat checkpoint saved as ours: what `python train.py`
# leaves, in small.
CHEAP_COMMANDS = [
    'python chat.py -p "What is 12*34?"',
    "python evaluate.py --eval-bundle testdata/core_eval/eval_bundle --checkpoint checkpoints/base",
    "python evaluate.py --eval-bundle testdata/core_eval/eval_bundle "
    "--nanochat-checkpoint testdata/nanochat_checkpoint",
    "python checkpoint.py export checkpoints ~/nanochat_out",
]


def python_commands(line):
    """The argv (the script first) of each `python x.py ...` in a shell line, and in its quoted
    arguments (ssh --command="cd x && python train.py ...")."""
    import shlex
    found, cmd = [], []
    for word in [*shlex.split(line, comments=True), "&&"]:
        if word in ("&&", "||", ";", "|"):
            if len(cmd) > 1 and cmd[0] == "python" and cmd[1].endswith(".py"):
                found.append(cmd[1:])
            cmd = []
        elif re.search(r"(^|\s)python \w+\.py", word) and len(word.split()) > 1:
            found += python_commands(word)
        else:
            cmd.append(word)
    return found


def documented_commands():
    """(doc file, argv) of each python command in the docs' ```bash blocks: backslash-continued
    lines joined, shell variables ($RANK) given the value 0."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\$\{?[A-Za-z_]\w*\}?", "0", line)
                found += [(path.name, argv) for argv in python_commands(line)]
    return found


def test_documented_commands_parse():
    """Every documented command's flags parse with its script's own parser (a --help prints and
    exits 0)."""
    import shlex
    import bench
    parsers = {"train.py": train.parse_args, "evaluate.py": evaluate.parse_args,
               "chat.py": chat.parse_args, "checkpoint.py": checkpoint.parse_args,
               "bench.py": bench.parse_args, "scaling.py": scaling.parse_args}
    commands = documented_commands()
    # each script is documented, and no other
    assert {argv[0] for _, argv in commands} == set(parsers)
    assert {name for name, _ in commands} >= {"README.md", "evaluations.md", "scaling-out.md",
                                              "scaling-laws.md"}
    for name, argv in commands:
        try:
            parsers[argv[0]](argv[1:])
        except SystemExit as e:
            command = shlex.join(["python", *argv])
            assert e.code == 0 and "--help" in argv, f"{name}: `{command}` does not parse"


@pytest.mark.slow  # a chat.py, two evaluate.py and a checkpoint.py process
def test_documented_commands_run(tmp_path, nanochat_d2):
    """The cheap documented commands run as written: a chat reply, nanochat's CORE of its
    checkpoint, read from its .pt and from a stage folder of ours (evaluate.py --checkpoint
    checkpoints/base), and that folder exported to nanochat's format."""
    import shlex
    documented = [argv for _, argv in documented_commands()]
    params, cfg, tok = nanochat_d2
    meta = {"stage": "base", "step": 100, "config": dataclasses.asdict(cfg),
            "tokenizer": "tokenizer.json"}
    step_dir = checkpoint.save_checkpoint(str(tmp_path / "checkpoints/base"), 100, params, None,
                                          meta)
    tok.save(os.path.join(step_dir, "tokenizer.json"))
    (tmp_path / "testdata").symlink_to(TESTDATA)
    # the compile cache under tmp_path
    env = child_env(HOME=str(tmp_path), PYTHONIOENCODING="utf-8")
    expected = json.loads((TESTDATA / "core_eval/expected.json").read_text())["core_metric"]
    for command in CHEAP_COMMANDS:
        argv = shlex.split(command)[1:]
        assert argv in documented, f"{command!r} is no longer documented: update CHEAP_COMMANDS"
        args = [str(tmp_path) + a[1:] if a.startswith("~/") else a for a in argv[1:]]  # as a shell
        r = subprocess.run([sys.executable, str(pathlib.Path(__file__).parent / argv[0]), *args],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{command}:\n{r.stderr[-2000:]}"
        if argv[0] == "evaluate.py":
            core = json.loads(r.stdout.splitlines()[-1])["core"]
            assert core["core_metric"] == pytest.approx(expected, abs=1e-6)
            scored = "checkpoints/base/step_000100" if "--checkpoint" in argv else argv[-1]
            assert r.stdout.startswith(f"{scored}: Config("), r.stdout[:200]  # says what it scored
        else:
            assert r.stdout.strip(), command
    # the export is testdata's checkpoint again, as nanochat's scripts would find it
    exported, _, _ = checkpoint.load_nanochat(str(tmp_path / "nanochat_out"))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, exported, params)))


# --------------------------------------------------------------------------------------------------
# The accelerator tier: what only a chip does, against the fp32 math (skipped on a CPU)

@pytest.mark.accelerator
def test_bf16_step_close_to_fp32():
    """One training step in bf16 as train.py runs it on a chip (attention_fn's route: splash on a
    TPU), against the fp32 step (the plain attention, full matmul precision) from the same params
    and batch. bf16 keeps 8 bits (3 digits): the step's loss, a mean over 1024 tokens, agrees within
    0.02 (2e-3 measured emulating bf16 on a CPU), and the params it leaves score within 0.05 of the
    fp32 step's (1e-2 measured), a small part of the step's drop (0.65)."""
    cfg = config(sequence_len=256, vocab_size=512, n_layer=2, n_head=2, n_kv_head=1, n_embd=256)
    bf16 = dataclasses.replace(cfg, compute_dtype="bfloat16")
    assert cfg.head_dim == 128 and nc.window_sizes(cfg) == [128, 256]
    params = jax.device_get(random_params(cfg, 30))  # on the host: the step donates its inputs
    x = jax.random.randint(jax.random.key(31), (1, 4, 256), 0, cfg.vocab_size)
    y = jnp.roll(x, -1, axis=2)
    got, _, m16 = train.jit_train_step(params, init_opt(params), (x, y), 0, FLAT, LRS, cfg=bf16,
                                       attn=kernels.attention_fn())
    with jax.default_matmul_precision("highest"):
        want, _, m32 = train.jit_train_step(params, init_opt(params), (x, y), 0, FLAT, LRS,
                                            cfg=cfg)
        before, after, after16 = (float(loss_fn(p, x[0], y[0], cfg)) for p in (params, want, got))
    assert abs(float(m16["loss"]) - float(m32["loss"])) < 0.02
    assert before - after > 0.5 and abs(after16 - after) < 0.05, (before, after, after16)


@functools.partial(jax.jit, static_argnames=("route", "window"))
def attention_and_grads(q, k, v, w, route, window):
    """Attention through a route of kernels.ROUTES, and the gradients in q, k, v of its sum
    weighted by w."""
    y, pullback = jax.vjp(attention_in_bthd(route, window), q, k, v)
    return y, pullback(w.astype(y.dtype))


@pytest.mark.accelerator
@pytest.mark.parametrize("T, window", [(256, 100), (256, 256), (1024, 300), (1024, 1024)])
def test_splash_attention_on_the_chip(T, window):
    """The splash kernel compiled for the chip (tiles of 128 at T 256, of 512 at T 1024) in bf16,
    GQA, with a binding window and without: its outputs and gradients against the plain attention
    in fp32 of the same bf16 inputs (full matmul precision). bf16 keeps 8 bits: outputs (up to 3)
    within 0.02 (7e-3 measured with the kernel interpreted on a CPU; the plain attention in bf16:
    1e-2), gradients within 2% of their largest (0.6%; plain in bf16: 0.4%)."""
    if jax.default_backend() != "tpu":
        pytest.skip("splash is a TPU kernel")
    keys = jax.random.split(jax.random.key(15), 4)
    q, k, v = (jax.random.normal(key, (2, T, h, 128)).astype(jnp.bfloat16)
               for key, h in zip(keys, (4, 2, 2)))
    w = jax.random.normal(keys[3], (2, T, 4, 128))
    y, grads = attention_and_grads(q, k, v, w, "splash", window)
    assert y.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    with jax.default_matmul_precision("highest"):
        fp32 = [a.astype(jnp.float32) for a in (q, k, v)]
        want_y, want_grads = attention_and_grads(*fp32, w, "plain", window)
    np.testing.assert_allclose(y.astype(jnp.float32), want_y, rtol=0, atol=0.02)
    for g, h in zip(grads, want_grads):
        np.testing.assert_allclose(g.astype(jnp.float32), h, rtol=0,
                                   atol=0.02 * float(jnp.abs(h).max()))


@pytest.mark.accelerator
def test_chunked_loss_at_d12_shapes():
    """The loss head of nanochat's d12 (width 768, vocab 32768) over 4 rows of T 2048 in bf16, as
    the chip trains it: in chunks of 2048 rows (the default, LOGITS_PER_CHUNK) and of 1000 (a
    padded last chunk) against all 8192 rows at once. Each row's logits are the same matmul
    either way: the mean agrees to fp32 summation order (1e-5); lm_head's gradient is summed
    over the chunks of bf16 products, each rounded to 8 bits, so within 1% of its largest."""
    cfg = nc.config_for_depth(12, 32768, compute_dtype="bfloat16")
    assert (cfg.n_embd, nc.LOGITS_PER_CHUNK // cfg.vocab_size) == (768, 2048)
    keys = jax.random.split(jax.random.key(50), 3)
    x = jax.random.normal(keys[0], (4 * 2048, 768)).astype(jnp.bfloat16)
    head = {"lm_head": 0.02 * jax.random.normal(keys[1], (768, cfg.padded_vocab))}
    targets = jax.random.randint(keys[2], (4 * 2048,), -1, cfg.vocab_size)

    @functools.partial(jax.jit, static_argnums=3)
    def loss_and_grads(head, x, targets, chunk):
        mean = lambda head, x: jnp.mean(nc.chunked_nll(head, x, targets, cfg, chunk))
        return jax.value_and_grad(mean, argnums=(0, 1))(head, x)
    whole, (head_grad, x_grad) = loss_and_grads(head, x, targets, 4 * 2048)
    for chunk in (None, 1000):
        loss, (h, g) = loss_and_grads(head, x, targets, chunk)
        assert float(loss) == pytest.approx(float(whole), rel=1e-5)
        np.testing.assert_allclose(h["lm_head"], head_grad["lm_head"], rtol=0,
                                   atol=1e-2 * float(jnp.abs(head_grad["lm_head"]).max()))
        np.testing.assert_allclose(g.astype(jnp.float32), x_grad.astype(jnp.float32), rtol=0,
                                   atol=1e-2 * float(jnp.abs(x_grad.astype(jnp.float32)).max()))
