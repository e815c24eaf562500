"""Scaling-law fits and plots of scaling.py's results, in numpy and the standard library only.

- The results CSV: one row per run, nanochat's columns plus seed and data_epoch; run_key is what
  identifies a run, so a resumed sweep skips the runs already there.
- Parameter count N: "kaplan" (nanochat's default: transformer matrices + lm_head), "total"
  (Chinchilla's convention: everything, embeddings included) or "transformer" (matrices only).
  D = tokens trained.
- IsoFLOP fit (nanochat's dev/scaling_analysis.ipynb, Hoffmann et al. approach 2): per budget a
  parabola in log10 N through val bpb gives N*(C); D*(C) and D/N are interpolated from the actual
  runs in log N; then N* ~ C^a and D* ~ C^b by polyfit in log-log, and the optimal D/N at the
  geometric-mean budget.
- Parametric fit (Chinchilla, arXiv 2203.15556 approach 3): L(N, D) = E + A/N^alpha + B/D^beta,
  minimizing the Huber loss (delta 1e-3) of LSE(a - alpha log N, b - beta log D, e) - log L from a
  grid of starts. The optimizer is a batched Levenberg-Marquardt on the Huber's IRLS weights (every
  start at once); a = beta / (alpha + beta). The same machinery fits L(N) = E + A N^-alpha
  (scale_n) and L(D) = E + B D^-beta (scale_d).
- 90% intervals: the isoFLOP and Chinchilla fits by the fixed-design bootstrap
  (parametric_bootstrap: every run kept, its bpb redrawn around the fit with the residuals' spread,
  which includes the seeds' where runs repeat); the scale_n / scale_d fits by resampling runs
  (bootstrap).
- Plots are SVG written here (log axes, ticks, legend): isoflop.svg, optima.svg,
  loss_vs_params.svg, loss_vs_tokens.svg.
"""

import csv
import functools
import itertools
import math
import os
import warnings
import xml.sax.saxutils

import numpy as np

COLUMNS = ["flops_budget", "depth", "model_dim", "params_wte", "params_value_embeds",
           "params_lm_head", "params_transformer", "params_scalars", "params_total",
           "num_iterations", "tokens_trained", "val_bpb", "train_time_sec", "seed",
           "data_epoch"]  # data_epoch: the loader's pass at the end (0: nothing read twice)
CONVENTIONS = {"kaplan": ("params_transformer", "params_lm_head"), "total": ("params_total",),
               "transformer": ("params_transformer",)}

# ---------------------------------------------------------------------------------- results CSV


def read_results(path):
    """Rows of a results CSV as dicts of floats (empty cells NaN; [] if the file does not exist)."""
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        return [{k: float(v) if v else math.nan for k, v in row.items()}
                for row in csv.DictReader(f)]


def append_result(path, row):
    """Append one run's row, writing the header first if the file is new."""
    new = not os.path.isfile(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow(row)


def run_key(row):
    """What identifies a run in a sweep: budget, size, steps and seed (formatted, so CSV round
    trips match)."""
    keys = ("flops_budget", "depth", "model_dim", "num_iterations", "seed")
    return tuple(f"{float(row[k]):.6g}" for k in keys)


def effective_params(rows, convention="kaplan"):
    """N of each row under a parameter-count convention (see CONVENTIONS)."""
    return np.array([sum(r[k] for k in CONVENTIONS[convention]) for r in rows], float)

# ---------------------------------------------------------------------------------- fits


def parabola_min(x, y):
    """The parabola in x through (x, y) (zeros for fewer than 3 distinct x) and where its minimum
    lies: the vertex, or the lowest point where it does not open upward."""
    p = np.polyfit(x, y, 2) if len(np.unique(x)) >= 3 else np.zeros(3)
    return p, -p[1] / (2 * p[0]) if p[0] > 0 else x[np.argmin(y)]


def fit_isoflop(rows, convention="kaplan"):
    """nanochat's isoFLOP analysis: per-budget optima (C, N*, D*, D/N, bpb*) and power laws
    N* ~ C^a, D* ~ C^b."""
    N, D = effective_params(rows, convention), np.array([r["tokens_trained"] for r in rows], float)
    L = np.array([r["val_bpb"] for r in rows], float)
    C = np.array([r["flops_budget"] for r in rows], float)
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
        # an optimum outside the runs is an extrapolation: pin it to the edge
        xs = float(np.clip(xs, x[0], x[-1]))
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
    return {"optima": opt, "parabolas": parabolas, "a": a, "b": b, "log_kn": log_kn,
            "log_kd": log_kd, "ratio": ratio, "ratio_mean": opt[:, 3].mean(),
            "ratio_std": opt[:, 3].std(), "fitted": fitted, "n_params": n_params}


def _huber(r, delta):
    return np.where(np.abs(r) <= delta, 0.5 * r**2, delta * (np.abs(r) - 0.5 * delta))


def fit_lse(xs, y, starts, delta=1e-3, iters=300, keep=64):
    """Minimize sum Huber(LSE_k(a_k - alpha_k x_k, e) - y) over theta = (a_1, alpha_1, ..., e),
    from every start.

    xs: (K, n) log features (log N, log D, ...), y: (n,) log losses, starts: (S, 2K + 1). Batched
    Levenberg-Marquardt on the Huber's IRLS weights: each start keeps its own damping and only
    takes steps that lower its objective. After 30 iterations only the `keep` best starts
    continue. Returns (best theta, its objective).
    """
    xs, y = np.atleast_2d(np.asarray(xs, float)), np.asarray(y, float)
    th = np.array(starts, float)
    K, S = len(xs), len(th)

    def terms(th):  # (S, n, K + 1) log terms, and the objective per start
        t = np.concatenate([th[:, 0:2 * K:2, None] - th[:, 1:2 * K:2, None] * xs[None],
                            np.broadcast_to(th[:, -1:, None], (S, 1, len(y)))], 1)
        t = t.transpose(0, 2, 1)
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
        J[..., 0:2 * K:2], J[..., 1:2 * K:2] = p[..., :K], -p[..., :K] * xs.T[None]
        J[..., -1] = p[..., K]
        r = pred - y
        w = np.minimum(1.0, delta / np.maximum(np.abs(r), 1e-300))  # Huber as reweighted LSQ
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
    grid = itertools.product([0, 5, 10, 15, 20, 25], [0.0, 0.5, 1.0, 1.5, 2.0],
                             [0, 5, 10, 15, 20, 25], [0.0, 0.5, 1.0, 1.5, 2.0],
                             [-1.0, -0.5, 0.0, 0.5, 1.0])
    return np.array(list(grid), float)


def fit_chinchilla(N, D, L, starts=None, delta=1e-3):
    """L(N, D) = E + A/N^alpha + B/D^beta (Chinchilla approach 3); also the implied
    a = beta/(alpha+beta), b."""
    starts = chinchilla_starts() if starts is None else starts
    th, _ = fit_lse(np.log([N, D]), np.log(L), starts, delta)
    a, alpha, b, beta, e = th
    # a degenerate bootstrap resample can send A or B to infinity
    with np.errstate(over="ignore", invalid="ignore"):
        E, A, B = np.exp([e, a, b])
        fitted = E + A / np.asarray(N, float) ** alpha + B / np.asarray(D, float) ** beta
    return {"E": E, "A": A, "alpha": alpha, "B": B, "beta": beta, "fitted": fitted,
            "a": beta / (alpha + beta), "b": alpha / (alpha + beta), "theta": th}


def fit_power(X, L, starts=None, delta=1e-3):
    """L(X) = E + A X^-alpha (X = N for scale_n, D for scale_d), with the same Huber fit in log
    space."""
    if starts is None:
        grid = itertools.product([0, 5, 10, 15, 20, 25], [0.0, 0.5, 1.0, 1.5, 2.0],
                                 [-1.0, -0.5, 0.0, 0.5, 1.0])
        starts = np.array(list(grid), float)
    th, _ = fit_lse(np.log([X]), np.log(L), starts, delta)
    with np.errstate(over="ignore"):
        E, A = np.exp([th[2], th[0]])
    return {"E": E, "A": A, "alpha": th[1], "theta": th}


def bootstrap(fit, rows, keys, n=200, seed=0, group=None):
    """Percentile 90% intervals of fit(rows)[k] for k in keys, resampling rows (within
    `group(row)` if given)."""
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
    """{key: (5th, 95th percentile)} over the resampled fits' values (rows of samples, in keys'
    order)."""
    # a fit undefined on this data (e.g. one budget) gives an all-NaN interval
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lo, hi = np.nanpercentile(np.array(samples, float), [5, 95], axis=0)
    return {k: (l, h) for k, l, h in zip(keys, lo, hi)}


def parametric_bootstrap(fit, rows, fitted, n_params, keys, n=200, seed=0, log=False):
    """Percentile 90% intervals of fit(rows)[k] by the fixed-design bootstrap: every resample
    keeps every run, its val bpb the fitted value plus N(0, sigma^2) noise (times exp(noise) if
    log), sigma pooled from the fit's residuals over len(rows) - n_params degrees of freedom (the
    seeds' spread included). A few degrees of freedom pin sigma loosely, so each resample draws its
    own, sigma sqrt(dof / chi2(dof)) (its posterior: t-like intervals, not ones that trust a lucky
    small sigma). Resampling the runs instead leaves a budget of 3 or 4 sizes too few distinct
    sizes for its parabola in most resamples: that measures the resampling, not the runs. Returns
    (intervals, sigma, degrees of freedom); NaN intervals where there are none."""
    L, dof = np.array([r["val_bpb"] for r in rows], float), len(rows) - n_params
    if dof < 1:
        return {k: (math.nan, math.nan) for k in keys}, math.nan, dof
    sigma = float(np.sqrt(np.sum((np.log(L / fitted) if log else L - fitted) ** 2) / dof))
    rng, samples = np.random.default_rng(seed), []
    for _ in range(n):
        e = rng.normal(0, sigma * np.sqrt(dof / rng.chisquare(dof)), len(rows))
        bpb = fitted * np.exp(e) if log else fitted + e
        res = fit([dict(r, val_bpb=v) for r, v in zip(rows, bpb)])
        samples.append([res[k] for k in keys])
    return _intervals(samples, keys), sigma, dof


# ---------------------------------------------------------------------------------- SVG plots

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
        # under a decade: linear ticks, placed on the log axis
        return [(math.log10(v), lab) for v, lab in _ticks(10**lo, 10**hi, False) if v > 0]
    step = 10 ** math.floor(math.log10((hi - lo) / 5 or 1))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= 7)
    return [(v, f"{v:.4g}") for v in np.arange(math.ceil(lo / step) * step, hi + step / 2, step)]


def _legend(legend, R, T):
    """SVG swatches and labels right of the plot area; swatches are <rect>s, so that element
    counts (circles, polylines) stay the data's."""
    out = []
    for j, (label, color, kind) in enumerate(legend):
        y = T + 10 + 18 * j
        hgt = 3 if kind == "line" else 8
        out += [f'<rect x="{R + 14}" y="{y - hgt / 2 - 4:.1f}" width="18" height="{hgt}" '
                f'fill="{color}"/>',
                f'<text x="{R + 38}" y="{y}">{xml.sax.saxutils.escape(label)}</text>']
    return out


def svg_plot(path, series, title, xlabel, ylabel, logx=True, logy=False, w=820, h=460):
    """Write a line/scatter plot: series = [{"label", "x", "y", "kind": "points" | "line"}] -> one
    <polyline> per line series, one <circle> per point, a legend entry per labelled series."""
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
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{esc(title)}</text>']
    for v, lab in _ticks(x0, x1, logx):
        out += [f'<line x1="{X(v):.1f}" y1="{T}" x2="{X(v):.1f}" y2="{B}" stroke="#e5e5e5"/>',
                f'<text x="{X(v):.1f}" y="{B + 16}" text-anchor="middle">{lab}</text>']
    for v, lab in _ticks(y0, y1, logy):
        out += [f'<line x1="{L}" y1="{Y(v):.1f}" x2="{R}" y2="{Y(v):.1f}" stroke="#e5e5e5"/>',
                f'<text x="{L - 6}" y="{Y(v) + 4:.1f}" text-anchor="end">{lab}</text>']
    out += [f'<rect x="{L}" y="{T}" width="{R - L}" height="{B - T}" fill="none" stroke="black"/>',
            f'<text x="{(L + R) / 2}" y="{h - 18}" text-anchor="middle">{esc(xlabel)}</text>',
            f'<text x="18" y="{(T + B) / 2}" text-anchor="middle" '
            f'transform="rotate(-90 18 {(T + B) / 2})">{esc(ylabel)}</text>']
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
    out += _legend(legend, R, T)
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return path

# ---------------------------------------------------------------------------------- analysis


def _fmt(name, value, ci):
    return f"  {name:<22} {value:10.4g}   90% CI [{ci[0]:.4g}, {ci[1]:.4g}]"


def analyze(sweep, rows, out, convention="kaplan", n_boot=200, seed=0):
    """Fit, print (with 90% bootstrap intervals) and plot a sweep's rows; returns the fits as a
    dict."""
    N = effective_params(rows, convention)
    D, L = (np.array([r[k] for r in rows], float) for k in ("tokens_trained", "val_bpb"))
    unit = {"kaplan": "transformer matrices + lm_head", "total": "all params",
            "transformer": "transformer only"}
    print(f"{sweep}: {len(rows)} runs, N = {unit[convention]} ({convention}), D = tokens trained")
    if twice := sum(r.get("data_epoch", 0) > 0 for r in rows):
        print(f"  ({twice} of them read part of the corpus twice: data_epoch > 0 in the CSV)")
    fit = analyze_isoflop if sweep == "scale_c" else functools.partial(analyze_power, sweep)
    return fit(rows, N, D, L, out, convention, n_boot, seed)


def analyze_isoflop(rows, N, D, L, out, convention, n_boot, seed):
    """scale_c: isoFLOP parabolas, their optima's power laws, and the Chinchilla fit once there
    are 8 runs."""
    iso = fit_isoflop(rows, convention)
    ci, sigma, dof = parametric_bootstrap(lambda rs: fit_isoflop(rs, convention), rows,
                                          iso["fitted"], iso["n_params"], ["a", "b", "ratio"],
                                          n_boot, seed)
    print(f"  {'C':>10} {'N*':>10} {'D*':>10} {'D/N':>7} {'bpb*':>7}")
    for c, n, d, q, l in iso["optima"]:
        print(f"  {c:10.3g} {n:10.3g} {d:10.3g} {q:7.2f} {l:7.4f}")
    print(_fmt("N* ~ C^a: a", iso["a"], ci["a"]))
    print(_fmt("D* ~ C^b: b", iso["b"], ci["b"]))
    print(_fmt("optimal D/N", iso["ratio"], ci["ratio"])
          + f"   (per-budget mean {iso['ratio_mean']:.2f} +- {iso['ratio_std']:.2f})")
    print(f"  (intervals: the parabolas + N(0, {sigma:.4f}^2) bpb, from their residuals over {dof} "
          "degrees of freedom)" if dof > 0
          else "  (no intervals: every budget has exactly 3 sizes; --width 4 or --seeds 2)")
    if len(rows) < 8:
        print("  (the Chinchilla fit needs 8 runs or more)")
    ch = fit_chinchilla(N, D, L) if len(rows) >= 8 else None
    cfit = lambda rs: fit_chinchilla(effective_params(rs, convention),
                                     [r["tokens_trained"] for r in rs],
                                     [r["val_bpb"] for r in rs], starts=ch["theta"][None])
    if ch:
        keys = ["alpha", "beta", "E", "a", "b"]
        cci, csigma, cdof = parametric_bootstrap(cfit, rows, ch["fitted"], 5, keys, n_boot, seed,
                                                 log=True)
        print("  Chinchilla L(N, D) = E + A/N^alpha + B/D^beta (Huber in log space):")
        for k in keys:
            print(_fmt(k if k not in "ab" else f"implied {k}", ch[k], cci[k]))
        print(f"  (intervals: the fit x exp(N(0, {csigma:.4f}^2)), from its residuals over {cdof} "
              "degrees of freedom)")
    plot_isoflop(out, rows, N, L, iso, convention)
    return {"isoflop": iso, "isoflop_ci": ci, "isoflop_sigma": sigma, "chinchilla": ch,
            "chinchilla_ci": cci if ch else None}


def plot_isoflop(out, rows, N, L, iso, convention):
    """isoflop.svg (each budget's runs and parabola, the optima) and, with 2 budgets or more,
    optima.svg (N* and D* against C, with their power laws)."""
    budgets, series = np.unique([r["flops_budget"] for r in rows]), []
    for i, (c, p) in enumerate(zip(budgets, iso["parabolas"])):
        m = np.array([r["flops_budget"] for r in rows]) == c
        xs = np.linspace(np.log10(N[m]).min(), np.log10(N[m]).max(), 50)
        series.append({"x": N[m], "y": L[m], "label": f"C = {c:.3g}", "color": COLORS[i % 8]})
        if p[0] > 0:  # a parabola with a minimum (3+ sizes)
            series.append({"x": 10**xs, "y": np.polyval(p, xs), "kind": "line",
                           "color": COLORS[i % 8]})
    opt = iso["optima"]
    series.append({"x": opt[:, 1], "y": opt[:, 4], "label": "optimum N*", "color": "black"})
    svg_plot(os.path.join(out, "isoflop.svg"), series, "IsoFLOP curves",
             f"N ({convention} params)", "val bpb")
    C = opt[:, 0]
    if len(C) < 2:
        return
    cs = np.geomspace(C.min(), C.max(), 20)
    svg_plot(os.path.join(out, "optima.svg"), [
        {"x": C, "y": opt[:, 1], "label": f"N*  (a = {iso['a']:.2f})", "color": COLORS[0]},
        {"x": cs, "y": 10 ** (iso["a"] * np.log10(cs) + iso["log_kn"]), "kind": "line",
         "color": COLORS[0]},
        {"x": C, "y": opt[:, 2], "label": f"D*  (b = {iso['b']:.2f})", "color": COLORS[1]},
        {"x": cs, "y": 10 ** (iso["b"] * np.log10(cs) + iso["log_kd"]), "kind": "line",
         "color": COLORS[1]}],
        "Compute-optimal N* and D*", "C (training FLOPs)", "N* (params), D* (tokens)", logy=True)


def analyze_power(sweep, rows, N, D, L, out, convention, n_boot, seed):
    """scale_n / scale_d: L = E + A X^-alpha per group of the other variable, with 3 runs or
    more."""
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
            refit = lambda rs: fit_power(xf(rs), [r["val_bpb"] for r in rs],
                                         starts=fit["theta"][None])
            ci = bootstrap(refit, sub, ["alpha", "E"], n_boot, seed)
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
