"""Tests for nanochat-jax, CPU-only and offline: `python -m pytest -q test_nanochat.py`.

Golden numbers in testdata/ come from the real PyTorch nanochat (see ../shared/golden/README.md for how they
were made); tolerances are the ones that README justifies from fp32-vs-fp64 reruns.
"""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import muon
import nanochat as nc

TESTDATA = pathlib.Path(__file__).parent / "testdata"
GOLDEN_CFG = nc.Config(sequence_len=512, vocab_size=300, n_layer=4, n_head=2, n_kv_head=1, n_embd=64,
                       window_pattern="SL")
TINY = nc.Config(sequence_len=64, vocab_size=100, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, window_pattern="SL")
forward = jax.jit(nc.forward, static_argnames="cfg")
loss_fn = jax.jit(nc.loss_fn, static_argnames=("cfg", "reduction"))
value_and_grad = jax.jit(jax.value_and_grad(nc.loss_fn), static_argnames="cfg")


@pytest.fixture(scope="session")
def golden():
    return np.load(TESTDATA / "nanochat_golden.npz")


def golden_tree(golden, prefix):
    """A golden state_dict (params, grads, ...) under `prefix/` converted to our params layout."""
    n = len(prefix) + 1
    return nc.from_nanochat_state_dict({k[n:]: golden[k] for k in golden.files if k.startswith(prefix + "/")},
                                       GOLDEN_CFG)


def assert_matches_golden(params, golden, prefix, atol):
    sd = nc.to_nanochat_state_dict(params, GOLDEN_CFG)
    keys = [k for k in sd if f"{prefix}/{k}" in golden.files]
    assert keys
    for k in keys:
        np.testing.assert_allclose(sd[k], golden[f"{prefix}/{k}"], rtol=0, atol=atol, err_msg=k)


# ---------------------------------------------------------------------------------------------------------------
# The model against PyTorch nanochat

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


@pytest.mark.parametrize("batch", ["", "2"])
def test_golden_gradients(golden, batch):
    params = golden_tree(golden, "after1" if batch else "param")  # grad2 was taken at nanochat's after1
    loss, grads = value_and_grad(params, golden["tokens" + batch], golden["targets" + batch], GOLDEN_CFG)
    np.testing.assert_allclose(loss, golden["loss" + batch], rtol=0, atol=1e-5)
    sd = nc.to_nanochat_state_dict(grads, GOLDEN_CFG)
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


@pytest.mark.parametrize("depth, width, heads, groups, flops", [
    # nanochat's own numbers at vocab 32768, head_dim 128, T 2048, "SSSL" (nanochat_spec.md section 1.7)
    (12, 768, 6, dict(wte=25.17, value_embeds=150.99, lm_head=25.17, transformer_matrices=84.94, total=286.26),
     7.597e8),
    (20, 1280, 10, dict(wte=41.94, value_embeds=419.43, lm_head=41.94, transformer_matrices=393.22, total=896.53),
     2.886e9),
    (26, 1664, 13, dict(wte=54.53, value_embeds=708.84, lm_head=54.53, transformer_matrices=863.90, total=1681.79),
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
    assert 850_000 <= nc.num_scaling_params(nc.NANO)["total"] <= 1_000_000
    assert nc.window_sizes(nc.Config(sequence_len=2048, n_layer=8)) == [512, 512, 512, 2048] * 2
    assert nc.window_sizes(nc.Config(sequence_len=1024, n_layer=3, window_pattern="sl")) == [256, 1024, 1024]


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_embd=100, n_head=3), "heads"),
    (dict(n_head=6, n_kv_head=4), "multiple"),
    (dict(window_pattern="SXL"), "S and L"),
    (dict(n_embd=16, n_head=2, n_kv_head=2), "at least"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        nc.Config(**kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Model invariants

@pytest.fixture(scope="session")
def tiny_params():
    return nc.init_params(TINY, jax.random.key(0))


def test_init_follows_nanochat(tiny_params):
    p, C = tiny_params, TINY.n_embd
    s = 3**0.5 / C**0.5
    assert abs(float(p["wte"].std()) - 0.8) < 0.03
    assert abs(float(p["lm_head"].std()) - 0.001) < 1e-4
    for name in ("c_q", "c_k", "c_v"):
        w = p["h"]["attn"][name]
        assert float(w.min()) >= -s and float(w.max()) <= s and float(w.max()) > 0.9 * s
    assert float(jnp.abs(p["h"]["mlp"]["c_fc"]).max()) <= 0.4 * s
    assert not p["h"]["attn"]["c_proj"].any() and not p["h"]["mlp"]["c_proj"].any()
    assert 0 <= float(p["h"]["attn"]["ve_gate"].min()) and float(p["h"]["attn"]["ve_gate"].max()) <= 0.02
    np.testing.assert_allclose(p["resid_lambdas"], [1.15, 1.10, 1.05], atol=1e-6)
    np.testing.assert_allclose(p["x0_lambdas"], [0.20, 0.125, 0.05], atol=1e-6)
    assert float(p["smear_lambda"][0]) == 0 and float(p["backout_lambda"][0]) == pytest.approx(0.2)
    again = nc.init_params(TINY, jax.random.key(0))
    other = nc.init_params(TINY, jax.random.key(1))
    assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, tiny_params, again)))
    assert not jnp.array_equal(tiny_params["wte"], other["wte"])


def perturbed(params, key):
    """Params with every path alive (nanochat's init zeroes the projections and the smear)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [w + 0.1 * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)])


def test_causality(tiny_params):
    params = perturbed(tiny_params, jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 48), 0, TINY.vocab_size)
    changed = tokens.at[:, 30:].set((tokens[:, 30:] + 7) % TINY.vocab_size)
    a, b = forward(params, tokens, TINY), forward(params, changed, TINY)
    np.testing.assert_array_equal(a[:, :30], b[:, :30])
    assert float(jnp.abs(a[:, 30:] - b[:, 30:]).max()) > 1e-3


def test_sliding_window_limits_context():
    cfg = nc.Config(sequence_len=512, vocab_size=100, n_layer=1, n_head=2, n_kv_head=2, n_embd=32,
                    window_pattern="S")
    assert nc.window_sizes(cfg) == [512]  # a single layer is the last layer: always full context
    mask = nc.attention_mask(jnp.arange(300), jnp.arange(300), 128)
    assert int(mask.sum(1)[-1]) == 129 and int(mask.sum(1)[5]) == 6 and not mask[10, 11]
    decode = nc.attention_mask(jnp.array([200]), jnp.arange(256), 128)  # one query against a cache
    assert np.flatnonzero(decode[0]).tolist() == list(range(72, 201))


def test_jit_equals_no_jit(tiny_params):
    params = perturbed(tiny_params, jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (1, 12), 0, TINY.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(-1)
    jitted = loss_fn(params, tokens, targets, TINY, reduction="none")
    with jax.disable_jit():  # op by op, as train.py --debug runs it
        eager = nc.loss_fn(params, tokens, targets, TINY, reduction="none")
    np.testing.assert_allclose(jitted, eager, rtol=1e-5, atol=1e-6)
    assert float(jitted.sum()) > 0


def test_bf16_close_to_fp32(golden):
    params = golden_tree(golden, "param")
    bf16 = nc.Config(**{**GOLDEN_CFG.__dict__, "compute_dtype": "bfloat16"})
    logits = forward(params, golden["tokens"], bf16)
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
    assert float(jnp.abs(logits - golden["logits"]).max()) < 0.1  # logits reach 1.85
    loss, grads = value_and_grad(params, golden["tokens"], golden["targets"], bf16)
    assert abs(float(loss) - float(golden["loss"])) < 0.01
    chex.assert_tree_all_finite(grads)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))  # fp32 masters get fp32 grads


def test_state_dict_round_trip(tiny_params):
    sd = nc.to_nanochat_state_dict(tiny_params, TINY)
    assert sd["transformer.h.0.attn.c_k.weight"].shape == (16, 32)  # (out, in)
    assert sd["lm_head.weight"].shape == (128, 32) and "value_embeds.1.weight" not in sd
    back = nc.from_nanochat_state_dict({"_orig_mod." + k: v for k, v in sd.items()}, TINY)
    assert all(jax.tree.leaves(jax.tree.map(jnp.array_equal, back, tiny_params)))
    again = nc.to_nanochat_state_dict(back, TINY)
    assert all(np.array_equal(again[k], sd[k]) for k in sd)


def test_state_dict_errors(tiny_params):
    sd = nc.to_nanochat_state_dict(tiny_params, TINY)
    with pytest.raises(ValueError, match="missing .*lm_head"):
        nc.from_nanochat_state_dict({k: v for k, v in sd.items() if k != "lm_head.weight"}, TINY)
    with pytest.raises(ValueError, match="shape"):
        nc.from_nanochat_state_dict({**sd, "transformer.wte.weight": np.zeros((64, 32))}, TINY)


# ---------------------------------------------------------------------------------------------------------------
# MuonAdamW against PyTorch nanochat (fed nanochat's own gradients: see the golden README's warning)

def test_golden_optimizer_two_steps(golden):
    step = jax.jit(muon.update)
    params = golden_tree(golden, "param")
    params, state = step(golden_tree(golden, "grad"), muon.init(params), params)
    assert_matches_golden(params, golden, "after1", atol=1e-5)
    params, state = step(golden_tree(golden, "grad2"), state, params)
    assert_matches_golden(params, golden, "after2", atol=1e-5)
    assert int(state["step"]) == 2


def test_golden_optimizer_cautious_weight_decay(golden):
    params = golden_tree(golden, "param")
    new, _ = jax.jit(muon.update)(golden_tree(golden, "grad"), muon.init(params), params, weight_decay=0.2)
    assert_matches_golden(new, golden, "after1_wd", atol=1e-5)


def test_schedules_do_not_recompile(tiny_params):
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(grads, state, params, lr_mult, momentum, weight_decay):
        return muon.update(grads, state, params, lr_mult=lr_mult, momentum=momentum, weight_decay=weight_decay)

    params, state = tiny_params, muon.init(tiny_params)
    grads = perturbed(jax.tree.map(jnp.zeros_like, tiny_params), jax.random.key(5))
    for i in range(3):
        params, state = step(grads, state, params, 1.0 - 0.1 * i, 0.85 + 0.05 * i, 0.1 * i)
    chex.assert_tree_all_finite(params)


def test_polar_express_orthogonalizes():
    x = jax.random.normal(jax.random.key(6), (3, 64, 160))
    for m in (x, x.mT, x[:, :, :64]):  # wide, tall, square
        u = muon.polar_express(m)
        s = jnp.linalg.svd(u, compute_uv=False)
        assert 0.7 < float(s.min()) and float(s.max()) < 1.25, m.shape
        # and it is the polar factor: aligned with U V^T of the SVD
        uu, _, vt = jnp.linalg.svd(m, full_matrices=False)
        cos = jnp.sum(u * (uu @ vt), axis=(-2, -1)) / (jnp.linalg.norm(u, axis=(-2, -1)) * min(m.shape[1:]) ** 0.5)
        assert float(cos.min()) > 0.99
    np.testing.assert_allclose(muon.polar_express(x.mT), muon.polar_express(x).mT, atol=1e-5)


def test_muon_stacks_do_not_mix():
    """Batching same-shape matrices is only an efficiency device: each matrix steps alone."""
    k = jax.random.split(jax.random.key(7), 4)
    p, g, buf = (jax.random.normal(kk, (3, 48, 16)) for kk in k[:3])
    buf2 = jnp.abs(jax.random.normal(k[3], (3, 48, 1)))
    step = jax.jit(muon.muon_step)
    together = step(p, g, buf, buf2, 0.02, 0.9, 0.1)
    alone = [step(p[i:i + 1], g[i:i + 1], buf[i:i + 1], buf2[i:i + 1], 0.02, 0.9, 0.1) for i in range(3)]
    for j in range(3):
        np.testing.assert_allclose(together[j], jnp.concatenate([a[j] for a in alone]), atol=1e-6)


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
        jp, jm, jv = muon.adamw_step(jp, jnp.asarray(g), jm, jv, t, lr, b1, b2, wd)
    np.testing.assert_allclose(jp, p, rtol=0, atol=1e-6)


def test_optimizer_routes_by_name(tiny_params):
    state = muon.init(tiny_params)
    assert state["var"]["h"]["attn"]["c_q"].shape == (3, 32, 1)  # (K, out, in): out >= in, per-row moment
    assert state["var"]["h"]["mlp"]["c_proj"].shape == (3, 1, 128)  # wide in torch terms: per-column
    assert state["var"]["h"]["attn"]["ve_gate"].shape == (2, 1, 12)  # Muon even for the tiny (2, 12) ve_gate
    assert state["var"]["value_embeds"].shape == tiny_params["value_embeds"].shape  # AdamW, though 3-D
    assert set(muon.ADAMW_GROUPS) | {"h"} == set(tiny_params)
