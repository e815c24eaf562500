"""Scaling laws for nanochat in JAX: sweeps run in-process through train.py, fits and plots in plain numpy.

    python scaling.py                                    # scale_c: 1.5 decades of budgets, grids around N*(C), fits
    python scaling.py --sweep scale_n --tokens 2e6       # loss vs parameters at fixed tokens, L(N) = E + A N^-alpha
    python scaling.py --sweep scale_d --depths 3 --tokens 2.5e5 5e5 1e6 2e6
    python scaling.py --fit-only --params-convention total
    python scaling.py --no-adaptive --depths 2 3 4 5 6   # nanochat's grid: every depth at every budget

- Sweeps (nanochat's runs/scaling_laws.sh): scale_c trains depths at FLOP budgets C with
  num_iterations = round(C / (estimate_flops(cfg) * batch tokens)); scale_n and scale_d train a grid of depths x
  token counts. Each run calls `train.run_stage` with args from `train.parse_args`, in its own checkpoint root
  under --out/runs, and appends one row to --out/<sweep>.csv (nanochat's columns plus seed). Rows already there
  are skipped and half-done runs continue from their checkpoint, so an interrupted sweep resumes.
- Parameter count N: "kaplan" (nanochat's default: transformer matrices + lm_head), "total" (Chinchilla's
  convention: everything, embeddings included) or "transformer" (matrices only). D = tokens trained.
- IsoFLOP fit (nanochat's dev/scaling_analysis.ipynb, Hoffmann et al. approach 2): per budget a parabola in log10 N
  through val bpb gives N*(C); D*(C) and D/N are interpolated from the actual runs in log N; then
  N* ~ C^a and D* ~ C^b by polyfit in log-log, and the optimal D/N at the geometric-mean budget.
- Parametric fit (Chinchilla, arXiv 2203.15556 approach 3): L(N, D) = E + A/N^alpha + B/D^beta, minimizing the
  Huber loss (delta 1e-3) of LSE(a - alpha log N, b - beta log D, e) - log L from a grid of starts. The optimizer
  is a batched Levenberg-Marquardt on the Huber's IRLS weights (every start at once); a = beta / (alpha + beta).
  The same machinery fits L(N) = E + A N^-alpha (scale_n) and L(D) = E + B D^-beta (scale_d).
- 90% intervals: the isoFLOP and Chinchilla fits by the fixed-design bootstrap (parametric_bootstrap: every run
  kept, its bpb redrawn around the fit with the residuals' spread, which includes the seeds' where runs repeat:
  --repeat, the default sweep's second seed at the small budgets' two best depths, or --seeds N); the scale_n /
  scale_d fits by resampling runs.
- --together trains a run's seeds as one program (`train_together`: params, optimizer states and data streams
  stacked, the train step vmapped; tested equal to the runs one by one). On the 2-core CPU it is slower than one
  by one (three seeds of d2 take 4.5x one seed's step time, of d6 3.0x: the vmapped backward pass is the cost),
  so it is off by default; it is for accelerators, where one tiny model leaves the chip idle.
- The default scale_c: budgets 4e11 to 1.27e13 FLOPs (4, half a decade apart: 1.5 decades; at 4e11 the optimum
  is already near d2, the smallest model nanochat's smear gate allows at this aspect ratio), aspect ratio 12 and
  head_dim 12 (d2 = 23K to d8 = 0.9M kaplan params), T = 128, vocab 384, 2,048 tokens per step, on the
  python-source corpus.
  adaptive_sweep picks each budget's depths: --width (4) around the running estimate of N*(C), widened a depth at
  a time until the parabola's vertex (the fit's N*) is inside. --no-adaptive trains every --depths at every budget
  instead.
- --jobs (worker_pool): runs trained at once, each process on its share of the cores (default: one per core on a
  CPU), since one tiny model keeps about one core busy.
- --corpus python-source (default): the standard library's source and the installed numpy's and jax's (~49M
  characters, python_source); adaptive_sweep trains no run longer than one pass of the loader over it
  (corpus_room), so no run reads a token twice (each row records the loader's data_epoch); docstrings: train.py's
  2M-character corpus.
- Weight decay: nanochat scales the Muon weight decay as 0.28 sqrt(B / 2^19) D_REF / D (calibrated at d12 with
  half-million-token batches). For the default sizes that is wd 1.6 (d8) to 65 (d2): Muon's lr * wd reaches 1.3,
  where a decay step shrinks a weight past zero. The sweep trains without it by default (--weight-decay 0.28
  restores it).
- Plots are SVG written here (log axes, ticks, legend): isoflop.svg, optima.svg, loss_vs_params.svg,
  loss_vs_tokens.svg.
"""

import argparse
import concurrent.futures
import contextlib
import csv
import functools
import itertools
import json
import math
import multiprocessing
import os
import signal
import sys
import time
import warnings
import xml.sax.saxutils

import numpy as np

COLUMNS = ["flops_budget", "depth", "model_dim", "params_wte", "params_value_embeds", "params_lm_head",
           "params_transformer", "params_scalars", "params_total", "num_iterations", "tokens_trained", "val_bpb",
           "train_time_sec", "seed", "data_epoch"]  # data_epoch: the loader's pass at the end (0: nothing read twice)
CONVENTIONS = {"kaplan": ("params_transformer", "params_lm_head"), "total": ("params_total",),
               "transformer": ("params_transformer",)}

# ------------------------------------------------------------------------------------------------ results CSV


def read_results(path):
    """Rows of a results CSV as dicts of floats (empty cells NaN; [] if the file does not exist)."""
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        return [{k: float(v) if v else math.nan for k, v in row.items()} for row in csv.DictReader(f)]


def append_result(path, row):
    """Append one run's row, writing the header first if the file is new."""
    new = not os.path.isfile(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def run_key(row):
    """What identifies a run in a sweep: budget, size, steps and seed (formatted, so CSV round trips match)."""
    return tuple(f"{float(row[k]):.6g}" for k in ("flops_budget", "depth", "model_dim", "num_iterations", "seed"))


def effective_params(rows, convention="kaplan"):
    """N of each row under a parameter-count convention (see CONVENTIONS)."""
    return np.array([sum(r[k] for k in CONVENTIONS[convention]) for r in rows], float)

# ------------------------------------------------------------------------------------------------ fits


def parabola_min(x, y):
    """The parabola in x through (x, y) (zeros for fewer than 3 distinct x) and where its minimum lies: the vertex,
    or the lowest point where it does not open upward."""
    p = np.polyfit(x, y, 2) if len(np.unique(x)) >= 3 else np.zeros(3)
    return p, -p[1] / (2 * p[0]) if p[0] > 0 else x[np.argmin(y)]


def fit_isoflop(rows, convention="kaplan"):
    """nanochat's isoFLOP analysis: per-budget optima (C, N*, D*, D/N, bpb*) and power laws N* ~ C^a, D* ~ C^b."""
    N, D = effective_params(rows, convention), np.array([r["tokens_trained"] for r in rows], float)
    L, C = np.array([r["val_bpb"] for r in rows], float), np.array([r["flops_budget"] for r in rows], float)
    budgets, optima, parabolas, fitted, n_params = np.unique(C), [], [], np.array(L), 0
    for c in budgets:
        m = C == c
        x, y, d = np.log10(N[m]), L[m], np.log10(D[m])
        o = np.argsort(x)
        x, y, d = x[o], y[o], d[o]
        p, xs = parabola_min(x, y)
        if p[0]:
            fitted[m], n_params = np.polyval(p, np.log10(N[m])), n_params + 3
        else:  # too few sizes for a parabola: the runs stand for themselves
            n_params += m.sum()
        xs = float(np.clip(xs, x[0], x[-1]))  # an optimum outside the runs is an extrapolation: pin it to the edge
        ys = float(np.polyval(p, xs)) if p[0] > 0 else float(y.min())
        ds = float(np.interp(xs, x, d))
        optima.append((c, 10**xs, 10**ds, 10 ** (ds - xs), ys))
        parabolas.append(p)
    opt = np.array(optima)  # (budgets, 5): C, N*, D*, D/N, bpb*
    lc = np.log10(opt[:, 0])
    a, log_kn = np.polyfit(lc, np.log10(opt[:, 1]), 1) if len(opt) > 1 else (np.nan, np.nan)
    b, log_kd = np.polyfit(lc, np.log10(opt[:, 2]), 1) if len(opt) > 1 else (np.nan, np.nan)
    c_mid = lc.mean()  # the geometric-mean budget
    ratio = 10 ** ((b - a) * c_mid + log_kd - log_kn) if len(opt) > 1 else opt[0, 3]
    return {"optima": opt, "parabolas": parabolas, "a": a, "b": b, "log_kn": log_kn, "log_kd": log_kd,
            "ratio": ratio, "ratio_mean": opt[:, 3].mean(), "ratio_std": opt[:, 3].std(), "fitted": fitted,
            "n_params": n_params}


def _huber(r, delta):
    return np.where(np.abs(r) <= delta, 0.5 * r**2, delta * (np.abs(r) - 0.5 * delta))


def fit_lse(xs, y, starts, delta=1e-3, iters=300, keep=64):
    """Minimize sum Huber(LSE_k(a_k - alpha_k x_k, e) - y) over theta = (a_1, alpha_1, ..., e), from every start.

    xs: (K, n) log features (log N, log D, ...), y: (n,) log losses, starts: (S, 2K + 1). Batched Levenberg-Marquardt
    on the Huber's IRLS weights: each start keeps its own damping and only takes steps that lower its objective.
    After 30 iterations only the `keep` best starts continue. Returns (best theta, its objective).
    """
    xs, y = np.atleast_2d(np.asarray(xs, float)), np.asarray(y, float)
    th = np.array(starts, float)
    K, S = len(xs), len(th)

    def terms(th):  # (S, n, K + 1) log terms, and the objective per start
        t = np.concatenate([th[:, 0:2 * K:2, None] - th[:, 1:2 * K:2, None] * xs[None],
                            np.broadcast_to(th[:, -1:, None], (S, 1, len(y)))], 1).transpose(0, 2, 1)
        m = t.max(-1, keepdims=True)
        pred = (m + np.log(np.exp(t - m).sum(-1, keepdims=True)))[..., 0]
        return t, pred, _huber(pred - y, delta).sum(-1)

    t, pred, obj = terms(th)
    lam = np.full(S, 1e-3)
    for i in range(iters):
        if i == 30 and S > keep:  # prune to the most promising starts once they have settled
            o = np.argsort(np.where(np.isfinite(obj), obj, np.inf))[:keep]
            th, t, pred, obj, lam, S = th[o], t[o], pred[o], obj[o], lam[o], keep
        p = np.exp(t - pred[..., None])  # (S, n, K + 1) softmax: d pred / d(a_k, e)
        J = np.empty((S, len(y), 2 * K + 1))
        J[..., 0:2 * K:2], J[..., 1:2 * K:2], J[..., -1] = p[..., :K], -p[..., :K] * xs.T[None], p[..., K]
        r = pred - y
        w = np.minimum(1.0, delta / np.maximum(np.abs(r), 1e-300))  # Huber as reweighted least squares
        H = np.einsum("sni,sn,snj->sij", J, w, J)
        g = np.einsum("sni,sn->si", J, w * r)
        H = H + lam[:, None, None] * np.eye(2 * K + 1) * (np.diagonal(H, 0, 1, 2)[:, None] + 1e-12)
        step = np.linalg.solve(H, -g[..., None])[..., 0]
        t2, pred2, obj2 = terms(th + step)
        ok = np.isfinite(obj2) & (obj2 < obj)
        gain = np.where(ok, obj - obj2, 0.0)
        th[ok], t[ok], pred[ok], obj[ok] = th[ok] + step[ok], t2[ok], pred2[ok], obj2[ok]
        lam = np.clip(np.where(ok, lam / 3, lam * 4), 1e-9, 1e9)
        if i > 30 and np.all((gain <= 1e-12 * (obj + 1e-30)) & ((lam >= 1e6) | ok)):
            break  # every start has stalled
    best = np.nanargmin(obj)
    return th[best], obj[best]


def chinchilla_starts():
    """Hoffmann et al.'s grid of initializations (thinned): (a, alpha, b, beta, e)."""
    grid = itertools.product([0, 5, 10, 15, 20, 25], [0.0, 0.5, 1.0, 1.5, 2.0], [0, 5, 10, 15, 20, 25],
                             [0.0, 0.5, 1.0, 1.5, 2.0], [-1.0, -0.5, 0.0, 0.5, 1.0])
    return np.array(list(grid), float)


def fit_chinchilla(N, D, L, starts=None, delta=1e-3):
    """L(N, D) = E + A/N^alpha + B/D^beta (Chinchilla approach 3); also the implied a = beta/(alpha+beta), b."""
    starts = chinchilla_starts() if starts is None else starts
    th, _ = fit_lse(np.log([N, D]), np.log(L), starts, delta)
    a, alpha, b, beta, e = th
    with np.errstate(over="ignore", invalid="ignore"):  # a degenerate bootstrap resample can send A or B to infinity
        E, A, B = np.exp([e, a, b])
        fitted = E + A / np.asarray(N, float) ** alpha + B / np.asarray(D, float) ** beta
    return {"E": E, "A": A, "alpha": alpha, "B": B, "beta": beta, "fitted": fitted,
            "a": beta / (alpha + beta), "b": alpha / (alpha + beta), "theta": th}


def fit_power(X, L, starts=None, delta=1e-3):
    """L(X) = E + A X^-alpha (X = N for scale_n, D for scale_d), with the same Huber fit in log space."""
    if starts is None:
        starts = np.array(list(itertools.product([0, 5, 10, 15, 20, 25], [0.0, 0.5, 1.0, 1.5, 2.0],
                                                 [-1.0, -0.5, 0.0, 0.5, 1.0])), float)
    th, _ = fit_lse(np.log([X]), np.log(L), starts, delta)
    with np.errstate(over="ignore"):
        E, A = np.exp([th[2], th[0]])
    return {"E": E, "A": A, "alpha": th[1], "theta": th}


def bootstrap(fit, rows, keys, n=200, seed=0, group=None):
    """Percentile 90% intervals of fit(rows)[k] for k in keys, resampling rows (within `group(row)` if given)."""
    rng = np.random.default_rng(seed)
    groups = {}
    for i, r in enumerate(rows):
        groups.setdefault(group(r) if group else 0, []).append(i)
    samples = []
    for _ in range(n):
        idx = [j for g in groups.values() for j in rng.choice(g, len(g))]
        res = fit([rows[j] for j in idx])
        samples.append([res[k] for k in keys])
    return _intervals(samples, keys)


def _intervals(samples, keys):
    """{key: (5th, 95th percentile)} over the resampled fits' values (rows of samples, in keys' order)."""
    with warnings.catch_warnings():  # a fit undefined on this data (e.g. one budget) gives an all-NaN interval
        warnings.simplefilter("ignore", RuntimeWarning)
        lo, hi = np.nanpercentile(np.array(samples, float), [5, 95], axis=0)
    return {k: (l, h) for k, l, h in zip(keys, lo, hi)}

def parametric_bootstrap(fit, rows, fitted, n_params, keys, n=200, seed=0, log=False):
    """Percentile 90% intervals of fit(rows)[k] by the fixed-design bootstrap: every resample keeps every run, its
    val bpb the fitted value plus N(0, sigma^2) noise (times exp(noise) if log), sigma pooled from the fit's residuals
    over len(rows) - n_params degrees of freedom (the seeds' spread included). A few degrees of freedom pin sigma
    loosely, so each resample draws its own, sigma sqrt(dof / chi2(dof)) (its posterior: t-like intervals, not ones
    that trust a lucky small sigma). Resampling the runs instead leaves a budget of 3 or 4 sizes too few distinct
    sizes for its parabola in most resamples: that measures the resampling, not the runs. Returns (intervals, sigma,
    degrees of freedom); NaN intervals where there are none."""
    L, dof = np.array([r["val_bpb"] for r in rows], float), len(rows) - n_params
    if dof < 1:
        return {k: (math.nan, math.nan) for k in keys}, math.nan, dof
    sigma = float(np.sqrt(np.sum((np.log(L / fitted) if log else L - fitted) ** 2) / dof))
    rng, samples = np.random.default_rng(seed), []
    for _ in range(n):
        e = rng.normal(0, sigma * np.sqrt(dof / rng.chisquare(dof)), len(rows))
        res = fit([dict(r, val_bpb=v) for r, v in zip(rows, fitted * np.exp(e) if log else fitted + e)])
        samples.append([res[k] for k in keys])
    return _intervals(samples, keys), sigma, dof


# ------------------------------------------------------------------------------------------------ SVG plots

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def _ticks(lo, hi, log):
    """Tick positions (in axis units: log10 for log axes) and labels spanning [lo, hi]."""
    if log:
        mults = [1] if hi - lo > 2.5 else [1, 2, 5] if hi - lo > 0.8 else [1, 1.5, 2, 3, 5, 7]
        ticks = [(math.log10(m) + k, f"{m:g}e{k}" if abs(k) > 2 else f"{m * 10.0**k:g}")
                 for k in range(math.floor(lo), math.ceil(hi) + 1) for m in mults]
        ticks = [(v, lab) for v, lab in ticks if lo - 1e-9 <= v <= hi + 1e-9]
        if len(ticks) >= 2:
            return ticks
        return [(math.log10(v), lab) for v, lab in _ticks(10**lo, 10**hi, False) if v > 0]  # under a decade
    step = 10 ** math.floor(math.log10((hi - lo) / 5 or 1))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= 7)
    return [(v, f"{v:.4g}") for v in np.arange(math.ceil(lo / step) * step, hi + step / 2, step)]


def svg_plot(path, series, title, xlabel, ylabel, logx=True, logy=False, w=820, h=460):
    """Write a line/scatter plot: series = [{"label", "x", "y", "kind": "points" | "line"}] -> one <polyline> per
    line series, one <circle> per point, a legend entry per labelled series."""
    tx = (lambda v: np.log10(v)) if logx else (lambda v: np.asarray(v, float))
    ty = (lambda v: np.log10(v)) if logy else (lambda v: np.asarray(v, float))
    xs = np.concatenate([tx(s["x"]) for s in series])
    ys = np.concatenate([ty(s["y"]) for s in series])
    x0, x1, y0, y1 = xs.min(), xs.max(), ys.min(), ys.max()
    px, py = 0.05 * (x1 - x0 or 1), 0.08 * (y1 - y0 or 1)
    x0, x1, y0, y1 = x0 - px, x1 + px, y0 - py, y1 + py
    L, R, T, B = 80, w - 200, 40, h - 60  # plot area; the legend goes right of it
    X = lambda v: L + (v - x0) / (x1 - x0) * (R - L)
    Y = lambda v: B - (v - y0) / (y1 - y0) * (B - T)
    esc = xml.sax.saxutils.escape
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{esc(title)}</text>']
    for v, lab in _ticks(x0, x1, logx):
        out += [f'<line x1="{X(v):.1f}" y1="{T}" x2="{X(v):.1f}" y2="{B}" stroke="#e5e5e5"/>',
                f'<text x="{X(v):.1f}" y="{B + 16}" text-anchor="middle">{lab}</text>']
    for v, lab in _ticks(y0, y1, logy):
        out += [f'<line x1="{L}" y1="{Y(v):.1f}" x2="{R}" y2="{Y(v):.1f}" stroke="#e5e5e5"/>',
                f'<text x="{L - 6}" y="{Y(v) + 4:.1f}" text-anchor="end">{lab}</text>']
    out += [f'<rect x="{L}" y="{T}" width="{R - L}" height="{B - T}" fill="none" stroke="black"/>',
            f'<text x="{(L + R) / 2}" y="{h - 18}" text-anchor="middle">{esc(xlabel)}</text>',
            f'<text x="18" y="{(T + B) / 2}" text-anchor="middle" transform="rotate(-90 18 {(T + B) / 2})">'
            f'{esc(ylabel)}</text>']
    legend = []
    for i, s in enumerate(series):
        color = s.get("color", COLORS[i % len(COLORS)])
        pts = list(zip(X(tx(s["x"])), Y(ty(s["y"]))))
        if s.get("kind", "points") == "line":
            dash = ' stroke-dasharray="6 4"' if s.get("dashed") else ""
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="'
                       + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
        else:
            out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="4" fill="{color}"/>' for a, b in pts]
        if s.get("label"):
            legend.append((s["label"], color, s.get("kind", "points")))
    for j, (label, color, kind) in enumerate(legend):  # swatches are <rect>s, so element counts stay exact
        y = T + 10 + 18 * j
        hgt = 3 if kind == "line" else 8
        out += [f'<rect x="{R + 14}" y="{y - hgt / 2 - 4:.1f}" width="18" height="{hgt}" fill="{color}"/>',
                f'<text x="{R + 38}" y="{y}">{esc(label)}</text>']
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return path

# ------------------------------------------------------------------------------------------------ sweeps


def model_row(cfg):
    """The CSV's model columns for a config (nanochat's names)."""
    import nanochat as nc  # imported here so the fits and plots need numpy only
    p = nc.num_scaling_params(cfg)
    return {"depth": cfg.n_layer, "model_dim": cfg.n_embd, "params_wte": p["wte"],
            "params_value_embeds": p["value_embeds"], "params_lm_head": p["lm_head"],
            "params_transformer": p["transformer_matrices"], "params_scalars": p["scalars"], "params_total": p["total"]}


def plan(sweep, depths, budgets=(), tokens=(), batch=2048, vocab_size=384, aspect_ratio=12, head_dim=12, T=128):
    """Run specs {flops_budget, depth, model_dim, num_iterations} of a sweep: scale_c crosses depths with FLOP budgets
    (num_iterations = C / (flops per token x batch)); scale_n and scale_d cross depths with token counts."""
    import nanochat as nc
    specs = []
    for d in depths:
        cfg = nc.config_for_depth(d, vocab_size, aspect_ratio, head_dim, sequence_len=T)
        f = nc.estimate_flops(cfg)
        if sweep == "scale_c":
            specs += [{"flops_budget": c, "depth": d, "model_dim": cfg.n_embd,
                       "num_iterations": max(1, round(c / (f * batch)))} for c in budgets]
        else:
            specs += [{"flops_budget": f * batch * max(1, round(t / batch)), "depth": d, "model_dim": cfg.n_embd,
                       "num_iterations": max(1, round(t / batch))} for t in tokens]
    return specs


def run_sweep(specs, csv_path, runner, seeds=(0,), write=True, pool=None):
    """Run every (spec, seed) whose row is not yet in csv_path, the seeds of a spec in one runner call (with a pool,
    worker_pool's, several specs at once), appending the rows in order as they finish (if write: one process of a
    multi-host run writes); returns all rows."""
    done = {run_key(r) for r in read_results(csv_path)}
    todo = [[dict(spec, seed=seed) for seed in seeds if run_key(dict(spec, seed=seed)) not in done] for spec in specs]
    for i, (spec, runs) in enumerate(zip(specs, todo)):
        print(f"[{i + 1}/{len(specs)}] {'run' if runs else 'skip (done)'}: {spec}, seeds "
              f"{[r['seed'] for r in runs] or list(seeds)}", flush=True)
    todo = [runs for runs in todo if runs]
    for runs, rows in zip(todo, (pool.map if pool else map)(runner, todo)):
        for run, row in zip(runs, rows):
            if write:
                append_result(csv_path, dict(run, **row))
    return read_results(csv_path)


def adaptive_sweep(budgets, csv_path, runner, spec_of, sizes, seeds=(0,), write=True, width=4, pool=None, repeat=0):
    """scale_c with the grid chosen from the data: the budgets in increasing order, each trained at `width` depths
    around the running estimate of N*(C) (before any optimum: Chinchilla's D = 20 N; after one: N* ~ C^0.5 from it;
    after two or more: the isoFLOP fit's N* ~ C^a), extended a depth at a time while the optimum lies outside the grid:
    the vertex of the parabola through the runs (mean over seeds), as the isoFLOP fit finds it, or where the runs do not
    curve upward the best run, on an edge. So every budget has runs on both sides of its optimum (a best run on an
    edge with the vertex inside is the seeds' noise on a flat bottom, not a reason to train one more size). Then the
    `repeat` best runs of every budget up to a tenth of the largest get one more seed, so that the fits' residuals
    hold the seeds' spread, measured where runs are cheap (the larger budgets cost most of a sweep). The choices
    follow from the CSV, so a resumed sweep makes the same ones. spec_of(depth, C) -> spec, or None where the run
    would read past the corpus; sizes: {depth: N}."""
    budgets, more = sorted(budgets), [max(seeds) + 1]
    for C in budgets:
        before = [r for r in read_results(csv_path) if r["flops_budget"] < C * (1 - 1e-9)]
        optima = fit_isoflop(before)["optima"] if before else np.zeros((0, 5))
        if len(optima) >= 2:
            a, log_k = np.polyfit(np.log10(optima[:, 0]), np.log10(optima[:, 1]), 1)
            n_star = 10 ** (a * np.log10(C) + log_k)
        else:
            n_star = optima[-1, 1] * (C / optima[-1, 0]) ** 0.5 if len(optima) else (C / 120) ** 0.5  # C = 6 N 20 N
        depths = [d for d in sorted(sizes) if spec_of(d, C)]  # the sizes whose run fits in the corpus
        if len(depths) < width:
            raise SystemExit(f"C = {C:.3g}: {len(depths)} sizes have runs that fit in the corpus, a grid needs "
                             f"{width}; give smaller --budgets or a larger corpus")
        centre = min(range(len(depths)), key=lambda i: abs(math.log(sizes[depths[i]] / n_star)))
        lo = max(0, min(centre - (width - 1) // 2, len(depths) - width))  # an even grid: one more above
        grid = depths[lo:lo + width]
        while True:
            rows = [r for r in run_sweep([spec_of(d, C) for d in grid], csv_path, runner, seeds, write, pool)
                    if abs(r["flops_budget"] / C - 1) < 1e-6 and r["depth"] in grid and int(r["seed"]) in seeds]
            bpb = {d: np.mean([r["val_bpb"] for r in rows if r["depth"] == d]) for d in grid}
            x, y = np.log10([sizes[d] for d in grid]), np.array([bpb[d] for d in grid])
            vertex = parabola_min(x, y)[1]  # the isoFLOP fit's N* before fit_isoflop pins it inside the runs
            i = depths.index(grid[0])
            if vertex <= x[0] and i > 0:
                grid.insert(0, depths[i - 1])
            elif vertex >= x[-1] and grid[-1] != depths[-1]:
                grid.append(depths[depths.index(grid[-1]) + 1])
            else:
                break
        if vertex <= x[0]:  # no smaller size to widen to
            why = ("is the smallest model there is; the optimum may lie below it (give larger --budgets)"
                   if grid[0] == min(sizes) else "is the smallest whose tokens fit in the corpus; the optimum may lie "
                   "below it (give a larger corpus or smaller --budgets)")
            print(f"C = {C:.3g}: the smallest run, d{grid[0]}, {why}", flush=True)
        if C <= budgets[-1] / 10 * (1 + 1e-9) and repeat:
            run_sweep([spec_of(d, C) for d in sorted(bpb, key=bpb.get)[:repeat]], csv_path, runner, more, write, pool)
    return read_results(csv_path)


def python_source(out, min_chars=100, max_chars=250):
    """The scaling corpus, written once to out/python_source.jsonl: this Python's standard library source and the
    source of the numpy and jax it runs on (their .py files, tests included, ~49M characters: the default corpus's
    docstrings are inside it, so it replaces that corpus rather than joining it), cut at blank lines into documents
    of min_chars to max_chars (about one 128-token row), exact repeats dropped. Offline and the same on every machine
    with the same Python and requirements.txt; a sweep's runs then read each token at most once."""
    import sysconfig
    import jax
    path = os.path.join(out, "python_source.jsonl")
    if os.path.isfile(path):
        return path
    stdlib, docs = sysconfig.get_paths()["stdlib"], {}
    files = sorted(os.path.join(d, f) for root in (stdlib, os.path.dirname(np.__file__), os.path.dirname(jax.__file__))
                   for d, _, fs in os.walk(root) if root != stdlib or "site-packages" not in d
                   for f in fs if f.endswith(".py"))
    for name in files:
        doc, n = [], 0
        with open(name, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines(keepends=True) + ["\n"]
        for line in lines:
            doc.append(line)
            n += len(line)
            if n >= max_chars or not line.strip() and n >= min_chars:
                docs.setdefault("".join(doc).strip(), None)  # a dict: repeats dropped, first-seen order kept
                doc, n = [], 0
    docs = [d for d in docs if d]
    with open(path + ".tmp", "w") as f:  # shuffled once: every run reads the same mix from the start
        f.writelines(json.dumps({"text": docs[i]}) + "\n" for i in np.random.default_rng(0).permutation(len(docs)))
    os.replace(path + ".tmp", path)
    return path


def corpus_room(tok, paths, B, T):
    """Tokens a run can train on before train.py's loader (paths as its --data, B rows of T + 1 tokens a batch)
    reads a document a second time: one pass of the loader, counted. Best-fit packing crops what does not fit in a
    row and drops the rest (a third of the standard library's source at T = 128), so a corpus's token count
    overstates it."""
    import data
    for n, (_, _, state) in enumerate(data.pretrain_batches(tok, data.corpus(paths, "train"), B, T)):
        if state["epoch"] > 0:  # this batch's buffer holds the first documents again; the batches before it do not
            return n * B * T


def train_runner(out, batch=2048, device_batch_size=16, vocab_size=384, aspect_ratio=12,
                 head_dim=12, T=128, eval_steps=16, data_paths=(), optim=None,
                 tokenizer_max_chars=2e9, compile_cache="", together=False, restart=False):
    """A runner for run_sweep: one spec's seeds trained by train.run_stage in-process one by one,
    each in its own checkpoint root under out/runs (an interrupted run resumes from it), or with
    together=True as one vmapped program (train_together; an interrupted group starts over).
    optim: train.plan's keyword values (the batch is `batch`); restart: kernels.tune_process's."""
    import jax
    import checkpoint
    import data
    import kernels
    import train
    kernels.tune_process(compile_cache, restart)  # as train.main: a resumed sweep skips compiles
    train.init_distributed()  # (a sweep on a pod: every host runs it, process 0 writes results)
    tok = data.tokenizer_for(out, data_paths, vocab_size, tokenizer_max_chars,
                             write=jax.process_index() == 0)  # one tokenizer for every run
    optim = {**(optim or {}), "total_batch_size": batch}

    def run_of(spec):
        """(the run's checkpoint root, its stage, its warmup steps)"""
        d, n, seed = int(spec["depth"]), int(spec["num_iterations"]), int(spec["seed"])
        name = f"d{d}_ar{aspect_ratio}_hd{head_dim}_v{vocab_size}_T{T}_b{batch}_n{n}_s{seed}"
        cfg = train.model_config(tok.n_vocab, d, aspect_ratio, head_dim, T)
        docs = data.corpus(data_paths, "train", seed=seed)
        stage = train.base_stage(cfg, docs, jax.random.key(seed), n)
        return os.path.join(out, "runs", name), stage, min(40, n // 5)

    def one(spec):
        t = time.perf_counter()
        root, stage, warmup = run_of(spec)
        evals = dict(val_docs=data.corpus(data_paths, "val"), eval_every=stage["iterations"],
                     eval_steps=eval_steps, sample_every=0)
        _, cfg, _, info = train.run_stage("base", stage, tok, root, device_batch_size,
                                          {**optim, "warmup_steps": warmup}, evals, resume=True,
                                          keep=1)
        with open(os.path.join(checkpoint.latest_checkpoint(root, ("base",)), "meta.json")) as f:
            epoch = max(s["epoch"] for s in json.load(f)["data_states"])
        return dict(model_row(cfg), num_iterations=info["steps"],
                    tokens_trained=info["steps"] * batch, val_bpb=info["val_bpb"],
                    train_time_sec=time.perf_counter() - t, data_epoch=epoch)

    def run(specs):
        if not (together and len(specs) > 1):
            return [one(spec) for spec in specs]
        t = time.perf_counter()
        stages = [run_of(spec)[1] for spec in specs]
        warmup = run_of(specs[0])[2]
        cfg, steps, _, bpb = train_together(stages, tok, device_batch_size,
                                            {**optim, "warmup_steps": warmup},
                                            data.corpus(data_paths, "val"), eval_steps)
        return [dict(model_row(cfg), num_iterations=steps, tokens_trained=steps * batch,
                     val_bpb=b, train_time_sec=(time.perf_counter() - t) / len(specs))
                for b in bpb]
    return run


def worker_pool(jobs, **runner_kwargs):
    """`jobs` worker processes for run_sweep, each pinned to its share of this process's CPU cores (before XLA sizes
    its thread pool) and running a train_runner(**runner_kwargs): the sweep's tiny models keep about one core busy,
    so on 2 cores two runs at once take ~1.25x the time of one (measured: d4, 9.5e11 FLOPs, 37 s vs 30 s)."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of a process running JAX's threads
    cores = ctx.Queue()
    for share in np.array_split(sorted(os.sched_getaffinity(0)), jobs):
        cores.put({int(c) for c in share})
    return concurrent.futures.ProcessPoolExecutor(jobs, ctx, initializer=_start_worker, initargs=(cores, runner_kwargs))


_WORKER = {"stopped": False}  # a worker process's runner, and whether it has seen a Ctrl-C


def _start_worker(cores, runner_kwargs):
    os.sched_setaffinity(0, cores.get())
    signal.signal(signal.SIGINT, _interrupted)  # outside a run's training loop, which saves first
    _WORKER["run"] = train_runner(**runner_kwargs)


def _interrupted(*_):
    _WORKER["stopped"] = True
    raise KeyboardInterrupt


def _worker_run(specs):
    """The worker's runner on specs; after a Ctrl-C it starts none (the pool hands a worker its next one early)."""
    if _WORKER["stopped"]:
        raise KeyboardInterrupt("not started: the sweep was interrupted")
    try:
        return _WORKER["run"](specs)
    except KeyboardInterrupt:
        _WORKER["stopped"] = True
        raise


def train_together(stages, tok, device_batch_size, optim, val_docs, eval_steps, lrs=None):
    """Train one model size under several seeds as one compiled program: the runs' params,
    optimizer states and data streams (train.base_stage's, which must agree on all but the seed)
    stacked on a leading axis, train.train_step vmapped over it; lrs: one train.learning_rates
    dict per run, to train several learning rates together. Returns (cfg, steps, each run's
    losses (steps, runs), each run's final val bits per byte), as train.run_stage would give them
    one by one."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import data
    import evaluate
    import kernels
    import muon
    import nanochat as nc
    import train
    cfg = stages[0]["cfg"]
    T, rows = cfg.sequence_len, device_batch_size * jax.device_count()
    sched, base_lrs, batch, _ = train.plan(cfg, rows, stages[0]["iterations"], **optim)

    def stack(trees):
        return jax.tree.map(lambda *x: jnp.stack(x), *trees)
    lrs = stack(lrs or [base_lrs] * len(stages))  # {name: (runs,)}
    inits = [s["init"]() for s in stages]
    params, opt_state = stack(inits), stack([muon.init(p, *nc.param_groups(p)) for p in inits])
    split = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P(None, "data"))
    streams = [train.sharded_batches(tok, s, batch // (rows * T), rows, T, split)[0]
               for s in stages]
    step = functools.partial(train.train_step, cfg=cfg, attn=kernels.attention())
    step_fn = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None, None, 0)), donate_argnums=(0, 1))
    losses = []
    for i in range(sched["num_iterations"]):
        inputs, targets = zip(*(next(stream)[0] for stream in streams))
        batch_i = (jnp.stack(inputs), jnp.stack(targets))
        params, opt_state, m = step_fn(params, opt_state, batch_i, i, sched, lrs)
        losses.append(np.asarray(m["loss"]))
        if not np.asarray(m["finite"]).all():
            raise FloatingPointError(f"step {i}: a loss is not finite ({losses[-1]}); lower the "
                                     "learning rates")
    token_bytes = jnp.asarray(tok.token_bytes())
    bpb = [evaluate.evaluate_bpb(jax.tree.map(lambda x: x[i], params), cfg,
                                 data.pretrain_batches(tok, val_docs, device_batch_size, T),
                                 token_bytes, eval_steps) for i in range(len(stages))]
    return cfg, sched["num_iterations"], np.array(losses), bpb

# ------------------------------------------------------------------------------------------------ analysis


def _fmt(name, value, ci):
    return f"  {name:<22} {value:10.4g}   90% CI [{ci[0]:.4g}, {ci[1]:.4g}]"


def analyze(sweep, rows, out, convention="kaplan", n_boot=200, seed=0):
    """Fit, print (with 90% bootstrap intervals) and plot a sweep's rows; returns the fits as a dict."""
    N = effective_params(rows, convention)
    D, L = (np.array([r[k] for r in rows], float) for k in ("tokens_trained", "val_bpb"))
    unit = {"kaplan": "transformer matrices + lm_head", "total": "all params", "transformer": "transformer only"}
    print(f"{sweep}: {len(rows)} runs, N = {unit[convention]} ({convention}), D = tokens trained")
    if twice := sum(r.get("data_epoch", 0) > 0 for r in rows):
        print(f"  ({twice} of them read part of the corpus twice: data_epoch > 0 in the CSV)")
    fit = analyze_isoflop if sweep == "scale_c" else functools.partial(analyze_power, sweep)
    return fit(rows, N, D, L, out, convention, n_boot, seed)


def analyze_isoflop(rows, N, D, L, out, convention, n_boot, seed):
    """scale_c: isoFLOP parabolas, their optima's power laws, and the Chinchilla fit once there are 8 runs."""
    iso = fit_isoflop(rows, convention)
    ci, sigma, dof = parametric_bootstrap(lambda rs: fit_isoflop(rs, convention), rows, iso["fitted"],
                                          iso["n_params"], ["a", "b", "ratio"], n_boot, seed)
    print(f"  {'C':>10} {'N*':>10} {'D*':>10} {'D/N':>7} {'bpb*':>7}")
    for c, n, d, q, l in iso["optima"]:
        print(f"  {c:10.3g} {n:10.3g} {d:10.3g} {q:7.2f} {l:7.4f}")
    print(_fmt("N* ~ C^a: a", iso["a"], ci["a"]))
    print(_fmt("D* ~ C^b: b", iso["b"], ci["b"]))
    print(_fmt("optimal D/N", iso["ratio"], ci["ratio"]) + f"   (per-budget mean {iso['ratio_mean']:.2f} "
          f"+- {iso['ratio_std']:.2f})")
    print(f"  (intervals: the parabolas + N(0, {sigma:.4f}^2) bpb, from their residuals over {dof} degrees of "
          "freedom)" if dof > 0 else "  (no intervals: every budget has exactly 3 sizes; --width 4 or --seeds 2)")
    if len(rows) < 8:
        print("  (the Chinchilla fit needs 8 runs or more)")
    ch = fit_chinchilla(N, D, L) if len(rows) >= 8 else None
    cfit = lambda rs: fit_chinchilla(effective_params(rs, convention), [r["tokens_trained"] for r in rs],
                                     [r["val_bpb"] for r in rs], starts=ch["theta"][None])
    if ch:
        cci, csigma, cdof = parametric_bootstrap(cfit, rows, ch["fitted"], 5, ["alpha", "beta", "E", "a", "b"],
                                                 n_boot, seed, log=True)
        print("  Chinchilla L(N, D) = E + A/N^alpha + B/D^beta (Huber in log space):")
        for k in ("alpha", "beta", "E", "a", "b"):
            print(_fmt(k if k not in "ab" else f"implied {k}", ch[k], cci[k]))
        print(f"  (intervals: the fit x exp(N(0, {csigma:.4f}^2)), from its residuals over {cdof} degrees of freedom)")
    res = {"isoflop": iso, "isoflop_ci": ci, "isoflop_sigma": sigma, "chinchilla": ch,
           "chinchilla_ci": cci if ch else None}
    budgets, series = np.unique([r["flops_budget"] for r in rows]), []
    for i, (c, p) in enumerate(zip(budgets, iso["parabolas"])):
        m = np.array([r["flops_budget"] for r in rows]) == c
        xs = np.linspace(np.log10(N[m]).min(), np.log10(N[m]).max(), 50)
        series.append({"x": N[m], "y": L[m], "label": f"C = {c:.3g}", "color": COLORS[i % 8]})
        if p[0] > 0:  # a parabola with a minimum (3+ sizes)
            series.append({"x": 10**xs, "y": np.polyval(p, xs), "kind": "line", "color": COLORS[i % 8]})
    series.append({"x": iso["optima"][:, 1], "y": iso["optima"][:, 4], "label": "optimum N*", "color": "black"})
    svg_plot(os.path.join(out, "isoflop.svg"), series, "IsoFLOP curves", f"N ({convention} params)", "val bpb")
    C = iso["optima"][:, 0]
    if len(C) < 2:
        return res
    cs = np.geomspace(C.min(), C.max(), 20)
    svg_plot(os.path.join(out, "optima.svg"), [
        {"x": C, "y": iso["optima"][:, 1], "label": f"N*  (a = {iso['a']:.2f})", "color": COLORS[0]},
        {"x": cs, "y": 10 ** (iso["a"] * np.log10(cs) + iso["log_kn"]), "kind": "line", "color": COLORS[0]},
        {"x": C, "y": iso["optima"][:, 2], "label": f"D*  (b = {iso['b']:.2f})", "color": COLORS[1]},
        {"x": cs, "y": 10 ** (iso["b"] * np.log10(cs) + iso["log_kd"]), "kind": "line", "color": COLORS[1]}],
        "Compute-optimal N* and D*", "C (training FLOPs)", "N* (params), D* (tokens)", logy=True)
    return res


def analyze_power(sweep, rows, N, D, L, out, convention, n_boot, seed):
    """scale_n / scale_d: L = E + A X^-alpha per group of the other variable, with 3 runs or more."""
    res = {}
    X, xname, group = (N, "N", D) if sweep == "scale_n" else (D, "D", N)
    series = []
    for i, g in enumerate(np.unique(group)):
        m = group == g
        series.append({"x": X[m], "y": L[m], "color": COLORS[i % 8],
                       "label": f"{'D' if sweep == 'scale_n' else 'N'} = {g:.3g}"})
        if m.sum() >= 3:
            sub = [r for r, k in zip(rows, m) if k]
            xf = lambda rs: (effective_params(rs, convention) if sweep == "scale_n"
                             else np.array([r["tokens_trained"] for r in rs], float))
            fit = fit_power(X[m], L[m])
            ci = bootstrap(lambda rs: fit_power(xf(rs), [r["val_bpb"] for r in rs],
                                                starts=fit["theta"][None]), sub, ["alpha", "E"], n_boot, seed)
            print(f"  L({xname}) = E + A {xname}^-alpha at {series[-1]['label']}:")
            print(_fmt("alpha", fit["alpha"], ci["alpha"]))
            print(_fmt("E", fit["E"], ci["E"]))
            res[float(g)] = {"fit": fit, "ci": ci}
            xs = np.geomspace(X[m].min(), X[m].max(), 40)
            series.append({"x": xs, "y": fit["E"] + fit["A"] * xs ** -fit["alpha"], "kind": "line",
                           "color": COLORS[i % 8], "label": f"fit: alpha = {fit['alpha']:.2f}"})
    name, xl = (("loss_vs_params.svg", f"N ({convention} params)") if sweep == "scale_n"
                else ("loss_vs_tokens.svg", "D (tokens trained)"))
    svg_plot(os.path.join(out, name), series, f"val bpb vs {xname}", xl, "val bpb")
    return res

# ------------------------------------------------------------------------------------------------ main

DEFAULTS = {"scale_c": {"depths": [2, 3, 4, 5, 6], "budgets": [4e11, 1.27e12, 4e12, 1.27e13],
                        "tokens": []},
            "scale_n": {"depths": [2, 3, 4, 5, 6], "budgets": [], "tokens": [1e6]},
            "scale_d": {"depths": [2], "budgets": [], "tokens": [1.25e5, 2.5e5, 5e5, 1e6, 2e6]}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", default="scale_c", choices=list(DEFAULTS))
    p.add_argument("--depths", type=int, nargs="*", help="model sizes (default per sweep, see DEFAULTS)")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="scale_c: choose each budget's depths (among --depths, if given) around the running estimate "
                   "of N*(C), widening the grid until the optimum is inside it (adaptive_sweep); --no-adaptive: "
                   "every depth at every budget")
    p.add_argument("--width", type=int, default=4, help="--adaptive: depths per budget before any widening")
    p.add_argument("--repeat", type=int, default=2, help="--adaptive: the best runs of every budget up to a tenth of "
                   "the largest trained with one more seed, so that the intervals hold the seeds' spread")
    p.add_argument("--corpus", default="python-source", choices=["docstrings", "python-source"],
                   help="docstrings: train.py's default corpus (2M chars); python-source: the standard library's, "
                   "numpy's and jax's source (49M chars), so that large budgets never read a token twice")
    p.add_argument("--budgets", type=float, nargs="*", help="scale_c: training FLOP budgets C")
    p.add_argument("--tokens", type=float, nargs="*", help="scale_n / scale_d: tokens per run")
    p.add_argument("--seed", type=int, default=0, help="training seed (init, data order) and bootstrap seed")
    p.add_argument("--seeds", type=int, default=1, help="train each run with this many seeds: --seed, --seed+1, ...")
    p.add_argument("--jobs", type=int, default=0, help="runs trained at once, each in its own process on its share of "
                   "the cores (default: one per core on a CPU, else 1)")
    p.add_argument("--together", action="store_true", help="train a run's seeds as one vmapped program (slower "
                   "than one by one on a CPU, see the README; for accelerators)")
    p.add_argument("--params-convention", default="kaplan", choices=list(CONVENTIONS),
                   help="N for the fits: kaplan = transformer matrices + lm_head (nanochat), total, transformer")
    p.add_argument("--out", default="scaling_results", help="results CSV, plots and one checkpoint root per run")
    p.add_argument("--batch", type=int, default=2048, help="tokens per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=384)
    p.add_argument("--aspect-ratio", type=int, default=12, help="model_dim = depth x aspect ratio")
    p.add_argument("--head-dim", type=int, default=12)
    p.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for the 90%% intervals")
    p.add_argument("--fit-only", action="store_true", help="fit and plot the existing CSV, train nothing")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="train.py's --weight-decay (nanochat: 0.28), scaled by nanochat's rule; see the notes above")
    p.add_argument("--train-args", default="", help="extra train.py flags for every run, e.g. '--matrix-lr 0.03'")
    a = p.parse_args(argv)
    d = DEFAULTS[a.sweep]
    depths, budgets, tokens = a.depths or d["depths"], a.budgets or d["budgets"], a.tokens or d["tokens"]
    if a.sweep == "scale_c" and not budgets or a.sweep != "scale_c" and not tokens:
        p.error(f"--sweep {a.sweep} needs {'--budgets' if a.sweep == 'scale_c' else '--tokens'}")
    if min(depths) < 1 or min(budgets + tokens) <= 0 or a.width < 3 or a.jobs < 0 or a.repeat < 0:
        p.error("--depths must be 1 or more, --budgets and --tokens positive, --width 3 or more (a parabola), "
                "--jobs and --repeat 0 or more")
    os.makedirs(a.out, exist_ok=True)
    csv_path = os.path.join(a.out, f"{a.sweep}.csv")
    t = time.perf_counter()
    if not a.fit_only:
        shape = (a.batch, a.vocab_size, a.aspect_ratio, a.head_dim, a.seq_len)
        corpus = ["--data", python_source(a.out)] if a.corpus == "python-source" else []
        import shlex
        import train
        sweep_flags = ["--eval-steps", "16", "--weight-decay", str(a.weight_decay)]  # then the user's
        targs = train.parse_args([*sweep_flags, *shlex.split(a.train_args)])
        kwargs = dict(out=a.out, batch=a.batch, device_batch_size=min(16, a.batch // a.seq_len), vocab_size=shape[1],
                      aspect_ratio=shape[2], head_dim=shape[3], T=shape[4], eval_steps=targs.eval_steps,
                      data_paths=corpus[1:], optim={k: getattr(targs, k) for k in train.OPTIM},
                      tokenizer_max_chars=targs.tokenizer_max_chars, compile_cache=targs.compile_cache,
                      together=a.together)
        runner = train_runner(**kwargs, restart=argv is None)  # here: the tokenizer, trained once for every run
        import jax  # after train_runner, which joins a multi-host run
        jobs = a.jobs or (len(os.sched_getaffinity(0)) if jax.default_backend() == "cpu" and not a.together else 1)
        if jobs > 1 and jax.process_count() > 1:
            p.error("--jobs is for one process: a multi-host sweep trains each run on every host")
        seeds, write = range(a.seed, a.seed + a.seeds), jax.process_index() == 0
        pool = worker_pool(jobs, **kwargs) if jobs > 1 else None
        try:
            runner = _worker_run if pool else runner
            if not (a.adaptive and a.sweep == "scale_c"):
                run_sweep(plan(a.sweep, depths, budgets, tokens, *shape), csv_path, runner, seeds, write, pool)
            elif jax.process_count() > 1:
                p.error("--adaptive is for one process: its choices follow from results only process 0 writes")
            else:
                import data
                import nanochat as nc
                sizes = {}
                for d in a.depths or range(1, 25):
                    with contextlib.suppress(ValueError):  # too narrow for this aspect ratio
                        row = model_row(nc.config_for_depth(d, *shape[1:4], sequence_len=a.seq_len))
                        sizes[d] = effective_params([row], a.params_convention)[0]
                tok = data.Tokenizer.load(os.path.join(a.out, "tokenizer.json"))  # train_runner's
                room = corpus_room(tok, corpus[1:], kwargs["device_batch_size"], a.seq_len)
                print(f"corpus: {room / 1e6:.1f}M tokens to train on before any repeats", flush=True)

                def spec_of(d, c):  # None where the run would read past the corpus
                    spec = plan("scale_c", [d], [c], (), *shape)[0]
                    return spec if spec["num_iterations"] * a.batch <= room else None
                adaptive_sweep(budgets, csv_path, runner, spec_of, sizes, seeds, width=a.width, pool=pool,
                               repeat=a.repeat)
        except KeyboardInterrupt:  # a run's "continue with --resume" is for train.py: the sweep resumes its runs
            raise KeyboardInterrupt("interrupted: the runs in progress saved a checkpoint; the same command resumes "
                                    "the sweep") from None
        finally:  # on Ctrl-C (which every worker also gets, and saves its run) the queued runs never start
            if pool:
                pool.shutdown(cancel_futures=True)
        if jax.process_index():
            return None  # process 0 writes, fits and plots
    rows = read_results(csv_path)
    if not rows:
        p.error(f"no results in {csv_path}: run without --fit-only first")
    res = analyze(a.sweep, rows, a.out, a.params_convention, a.bootstrap, a.seed)
    print(f"wrote {csv_path} and plots to {a.out}/ in {(time.perf_counter() - t) / 60:.1f} min")
    return res


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, ImportError) as e:  # bad input (a path, a size): one line, no traceback
        sys.exit(f"error: {e}")
    except KeyboardInterrupt as e:  # Ctrl-C: where to go on from
        sys.exit(str(e) or "interrupted")
