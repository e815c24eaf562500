"""Scaling-law fits and plots of scaling.py's results, in numpy and the standard library
only.

- The results CSV: one row per run, nanochat's columns plus seed and data_epoch;
  run_key is what identifies a run, so a resumed sweep skips the runs already there.
- N: "kaplan" (nanochat's: transformer matrices + lm_head), "total" (Chinchilla's) or
  "transformer"; D: the tokens trained.
- IsoFLOP fit (nanochat's dev/scaling_analysis.ipynb, Hoffmann et al.'s approach 2):
  per budget a parabola in log10 N through val bpb gives N*(C); then N* ~ C^a, D* ~ C^b.
- Parametric fit (Chinchilla, arXiv 2203.15556 approach 3): L(N, D) = E + A/N^alpha +
  B/D^beta by the Huber loss in log space, a batched Levenberg-Marquardt (`fit_lse`);
  the same machinery fits L(N) (scale_n) and L(D) (scale_d).
- 90% intervals: a fixed-design bootstrap (`parametric_bootstrap`), or resampled runs
  (`bootstrap`). Plots are SVG written here (`svg_plot`). docs/scaling-laws.md tells
  the method.
"""

import csv
import functools
import itertools
import math
import os
import warnings
import xml.sax.saxutils

import numpy as np

# data_epoch: the loader's pass at the end (0: nothing read twice)
COLUMNS = ["flops_budget", "depth", "model_dim", "params_wte", "params_value_embeds",
           "params_lm_head", "params_transformer", "params_scalars", "params_total",
           "num_iterations", "tokens_trained", "val_bpb", "train_time_sec", "seed",
           "data_epoch"]
CONVENTIONS = {"kaplan": ("params_transformer", "params_lm_head"),
               "total": ("params_total",),
               "transformer": ("params_transformer",)}

# --------------------------------------------------------------------------- results CSV


def read_results(path):
    """Rows of a results CSV as dicts of floats (empty cells NaN; [] if the file does not
    exist)."""
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        return [{k: float(v) if v else math.nan for k, v in row.items()}
                for row in csv.DictReader(f)]


def append_result(path, row):
    """Append one run's row, writing the header first if the file is new."""
    new = not os.path.isfile(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


def run_key(row):
    """What identifies a run in a sweep: budget, size, steps and seed (formatted, so CSV
    round trips match)."""
    keys = ("flops_budget", "depth", "model_dim", "num_iterations", "seed")
    return tuple(f"{float(row[k]):.6g}" for k in keys)


def effective_params(rows, convention="kaplan"):
    """N of each row under a parameter-count convention (see CONVENTIONS)."""
    counts = [sum(r[k] for k in CONVENTIONS[convention]) for r in rows]
    return np.array(counts, float)

# ---------------------------------------------------------------------------------- fits


def parabola_min(x, y):
    """The parabola in x through (x, y) (zeros for fewer than 3 distinct x) and where its
    minimum lies: the vertex, or the lowest point where it does not open upward."""
    if len(np.unique(x)) >= 3:
        p = np.polyfit(x, y, 2)
    else:
        p = np.zeros(3)
    if p[0] > 0:
        return p, -p[1] / (2 * p[0])
    return p, x[np.argmin(y)]


def fit_isoflop(rows, convention="kaplan"):
    """nanochat's isoFLOP analysis: per-budget optima (C, N*, D*, D/N, bpb*) and power
    laws N* ~ C^a, D* ~ C^b."""
    N = effective_params(rows, convention)
    D = np.array([r["tokens_trained"] for r in rows], float)
    L = np.array([r["val_bpb"] for r in rows], float)
    C = np.array([r["flops_budget"] for r in rows], float)
    budgets = np.unique(C)
    optima = []
    parabolas = []
    fitted = np.array(L)  # each run's bpb on its budget's parabola
    n_params = 0  # the parameters the fits took, for the residuals' degrees of freedom
    for c in budgets:
        # 1. the budget's runs in order of size, and its parabola
        here = C == c
        order = np.argsort(np.log10(N[here]))
        log_n = np.log10(N[here])[order]
        bpb = L[here][order]
        log_d = np.log10(D[here])[order]
        p, log_n_star = parabola_min(log_n, bpb)
        if p[0]:
            fitted[here] = np.polyval(p, np.log10(N[here]))
            n_params = n_params + 3
        else:  # too few sizes for a parabola: the runs stand for themselves
            n_params += here.sum()
        # 2. its optimum; outside the runs it is an extrapolation: pinned to the edge
        log_n_star = float(np.clip(log_n_star, log_n[0], log_n[-1]))
        if p[0] > 0:
            bpb_star = float(np.polyval(p, log_n_star))
        else:
            bpb_star = float(bpb.min())
        log_d_star = float(np.interp(log_n_star, log_n, log_d))
        ratio = 10 ** (log_d_star - log_n_star)
        optima.append((c, 10**log_n_star, 10**log_d_star, ratio, bpb_star))
        parabolas.append(p)
    # 3. the optima's power laws, and the ratio D/N at the geometric-mean budget
    opt = np.array(optima)  # (budgets, 5): C, N*, D*, D/N, bpb*
    lc = np.log10(opt[:, 0])
    a = np.nan
    log_kn = np.nan
    b = np.nan
    log_kd = np.nan
    ratio = opt[0, 3]
    if len(opt) > 1:
        a, log_kn = np.polyfit(lc, np.log10(opt[:, 1]), 1)
        b, log_kd = np.polyfit(lc, np.log10(opt[:, 2]), 1)
        c_mid = lc.mean()
        ratio = 10 ** ((b - a) * c_mid + log_kd - log_kn)
    return {"optima": opt, "parabolas": parabolas, "a": a, "b": b, "log_kn": log_kn,
            "log_kd": log_kd, "ratio": ratio, "ratio_mean": opt[:, 3].mean(),
            "ratio_std": opt[:, 3].std(), "fitted": fitted, "n_params": n_params}


def _huber(r, delta):
    # quadratic within delta, linear beyond: a run far off the curve pulls it less
    quadratic = 0.5 * r**2
    linear = delta * (np.abs(r) - 0.5 * delta)
    return np.where(np.abs(r) <= delta, quadratic, linear)


def _lse_terms(th, xs, y, delta):
    """fit_lse's (S, n, K + 1) log terms of every start th (S, 2K + 1), their
    log-sum-exp (S, n) and the objective per start (S,)."""
    K = len(xs)
    # a_k - alpha_k x_k for each feature, and e
    a = th[:, 0:2 * K:2, None]
    alpha = th[:, 1:2 * K:2, None]
    linear = a - alpha * xs[None]
    constant = np.broadcast_to(th[:, -1:, None], (len(th), 1, len(y)))
    t = np.concatenate([linear, constant], 1)
    t = t.transpose(0, 2, 1)
    # the log-sum-exp over the terms, from their max
    m = t.max(-1, keepdims=True)
    sums = np.exp(t - m).sum(-1, keepdims=True)
    pred = (m + np.log(sums))[..., 0]
    return t, pred, _huber(pred - y, delta).sum(-1)


def _lm_step(t, pred, xs, y, lam, delta):
    """fit_lse's Levenberg-Marquardt step of every start: damped Gauss-Newton (damping
    lam (S,)) on the Huber as reweighted least squares."""
    S, n, _ = t.shape
    K = len(xs)
    # 1. the Jacobian of pred: the terms' softmax weights, d pred / d(a_k, e)
    p = np.exp(t - pred[..., None])  # (S, n, K + 1)
    J = np.empty((S, n, 2 * K + 1))
    J[..., 0:2 * K:2] = p[..., :K]
    J[..., 1:2 * K:2] = -p[..., :K] * xs.T[None]
    J[..., -1] = p[..., K]
    # 2. the Huber's weights, and the damped normal equations
    r = pred - y
    w = np.minimum(1.0, delta / np.maximum(np.abs(r), 1e-300))
    H = np.einsum("sni,sn,snj->sij", J, w, J)
    g = np.einsum("sni,sn->si", J, w * r)
    diagonal = np.diagonal(H, 0, 1, 2)[:, None] + 1e-12
    H = H + lam[:, None, None] * np.eye(2 * K + 1) * diagonal
    return np.linalg.solve(H, -g[..., None])[..., 0]


def fit_lse(xs, y, starts, delta=1e-3, iters=300, keep=64):
    """Minimize sum Huber(LSE_k(a_k - alpha_k x_k, e) - y) over theta = (a_1, alpha_1,
    ..., e), from every start.

    xs: (K, n) log features (log N, log D, ...), y: (n,) log losses, starts: (S, 2K +
    1). Batched Levenberg-Marquardt on the Huber's IRLS weights: each start keeps its
    own damping and only takes steps that lower its objective. After 30 iterations only
    the `keep` best starts continue. Returns (best theta, its objective).
    """
    xs = np.atleast_2d(np.asarray(xs, float))
    y = np.asarray(y, float)
    th = np.array(starts, float)
    t, pred, obj = _lse_terms(th, xs, y, delta)
    lam = np.full(len(th), 1e-3)
    for i in range(iters):
        # 1. prune to the most promising starts once they have settled
        if i == 30 and len(th) > keep:
            finite = np.where(np.isfinite(obj), obj, np.inf)
            kept = np.argsort(finite)[:keep]
            th = th[kept]
            t = t[kept]
            pred = pred[kept]
            obj = obj[kept]
            lam = lam[kept]
        # 2. a step, taken where it lowers the objective; the damping follows
        step = _lm_step(t, pred, xs, y, lam, delta)
        t2, pred2, obj2 = _lse_terms(th + step, xs, y, delta)
        ok = np.isfinite(obj2) & (obj2 < obj)
        gain = np.where(ok, obj - obj2, 0.0)
        th[ok] = th[ok] + step[ok]
        t[ok] = t2[ok]
        pred[ok] = pred2[ok]
        obj[ok] = obj2[ok]
        lam = np.clip(np.where(ok, lam / 3, lam * 4), 1e-9, 1e9)
        # 3. until every start has stalled
        if i > 30:
            stalled = (gain <= 1e-12 * (obj + 1e-30)) & ((lam >= 1e6) | ok)
            if np.all(stalled):
                break
    best = np.nanargmin(obj)
    return th[best], obj[best]


def chinchilla_starts():
    """Hoffmann et al.'s grid of initializations (thinned): (a, alpha, b, beta, e)."""
    grid = itertools.product([0, 5, 10, 15, 20, 25],  # a
                             [0.0, 0.5, 1.0, 1.5, 2.0],  # alpha
                             [0, 5, 10, 15, 20, 25],  # b
                             [0.0, 0.5, 1.0, 1.5, 2.0],  # beta
                             [-1.0, -0.5, 0.0, 0.5, 1.0])  # e
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
        n_term = A / np.asarray(N, float) ** alpha
        d_term = B / np.asarray(D, float) ** beta
        fitted = E + n_term + d_term
    return {"E": E, "A": A, "alpha": alpha, "B": B, "beta": beta, "fitted": fitted,
            "a": beta / (alpha + beta), "b": alpha / (alpha + beta), "theta": th}


def fit_power(X, L, starts=None, delta=1e-3):
    """L(X) = E + A X^-alpha (X = N for scale_n, D for scale_d), with the same Huber fit
    in log space."""
    if starts is None:
        grid = itertools.product([0, 5, 10, 15, 20, 25],  # a
                                 [0.0, 0.5, 1.0, 1.5, 2.0],  # alpha
                                 [-1.0, -0.5, 0.0, 0.5, 1.0])  # e
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
        # each group's rows drawn with replacement, as many as it has
        idx = []
        for members in groups.values():
            idx += list(rng.choice(members, len(members)))
        res = fit([rows[j] for j in idx])
        samples.append([res[k] for k in keys])
    return _intervals(samples, keys)


def _intervals(samples, keys):
    """{key: (5th, 95th percentile)} over the resampled fits' values (rows of samples, in
    keys' order)."""
    # a fit undefined on this data (e.g. one budget) gives an all-NaN interval
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lo, hi = np.nanpercentile(np.array(samples, float), [5, 95], axis=0)
    return {k: (low, high) for k, low, high in zip(keys, lo, hi)}


def parametric_bootstrap(fit, rows, fitted, n_params, keys, n=200, seed=0, log=False):
    """Percentile 90% intervals of fit(rows)[k] by the fixed-design bootstrap: every
    resample keeps every run, its val bpb the fitted value plus N(0, sigma^2) noise
    (times exp(noise) if log), sigma pooled from the fit's residuals over len(rows) -
    n_params degrees of freedom (the seeds' spread included), each resample drawing its
    own sigma sqrt(dof / chi2(dof)) (its posterior: few degrees of freedom pin sigma
    loosely). docs/scaling-laws.md says why not resample the runs. Returns (intervals,
    sigma, degrees of freedom); NaN intervals where there are none."""
    L = np.array([r["val_bpb"] for r in rows], float)
    dof = len(rows) - n_params
    if dof < 1:
        return {k: (math.nan, math.nan) for k in keys}, math.nan, dof
    # the residuals' spread: multiplicative if log
    residuals = np.log(L / fitted) if log else L - fitted
    sigma = float(np.sqrt(np.sum(residuals ** 2) / dof))
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        scale = sigma * np.sqrt(dof / rng.chisquare(dof))
        noise = rng.normal(0, scale, len(rows))
        bpb = fitted * np.exp(noise) if log else fitted + noise
        res = fit([dict(r, val_bpb=v) for r, v in zip(rows, bpb)])
        samples.append([res[k] for k in keys])
    return _intervals(samples, keys), sigma, dof

# --------------------------------------------------------------------------- SVG plots

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
          "#17becf"]


def _ticks(lo, hi, log):
    """Tick positions (in axis units: log10 for log axes) and labels spanning [lo,
    hi]."""
    if log:
        # 1. log axes: 1, 2, 5 (or more) times each power of ten, as the span allows
        if hi - lo > 2.5:
            mults = [1]
        elif hi - lo > 0.8:
            mults = [1, 2, 5]
        else:
            mults = [1, 1.5, 2, 3, 5, 7]
        ticks = []
        for k in range(math.floor(lo), math.ceil(hi) + 1):
            for m in mults:
                label = f"{m:g}e{k}" if abs(k) > 2 else f"{m * 10.0**k:g}"
                ticks.append((math.log10(m) + k, label))
        ticks = [(v, label) for v, label in ticks if lo - 1e-9 <= v <= hi + 1e-9]
        if len(ticks) >= 2:
            return ticks
        # under a decade: linear ticks, placed on the log axis
        linear = _ticks(10**lo, 10**hi, False)
        return [(math.log10(v), label) for v, label in linear if v > 0]
    # 2. linear axes: a step of 1, 2, 5 or 10 times a power of ten, 7 ticks at most
    step = 10 ** math.floor(math.log10((hi - lo) / 5 or 1))
    step *= next(m for m in (1, 2, 5, 10) if (hi - lo) / (step * m) <= 7)
    first = math.ceil(lo / step) * step
    return [(v, f"{v:.4g}") for v in np.arange(first, hi + step / 2, step)]


def _legend(legend, right, top):
    """SVG swatches and labels right of the plot area; swatches are <rect>s, so that
    element counts (circles, polylines) stay the data's."""
    out = []
    for j, (label, color, kind) in enumerate(legend):
        y = top + 10 + 18 * j
        hgt = 3 if kind == "line" else 8
        out += [f'<rect x="{right + 14}" y="{y - hgt / 2 - 4:.1f}" width="18" '
                f'height="{hgt}" fill="{color}"/>',
                f'<text x="{right + 38}" y="{y}">{xml.sax.saxutils.escape(label)}'
                '</text>']
    return out


def _axis_units(log):
    """Data to axis units: log10 on a log axis."""
    if log:
        return lambda v: np.log10(v)
    return lambda v: np.asarray(v, float)


def _marks(series, to_pixels, legend):
    """Each series' SVG elements: a <polyline> for a line, a <circle> per point; its
    legend entry appended to legend. to_pixels(series) -> its points in pixels."""
    out = []
    for i, s in enumerate(series):
        color = s.get("color", COLORS[i % len(COLORS)])
        pts = to_pixels(s)
        if s.get("kind", "points") == "line":
            dash = ' stroke-dasharray="6 4"' if s.get("dashed") else ""
            points = " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} '
                       f'points="{points}"/>')
        else:
            out += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="4" fill="{color}"/>'
                    for a, b in pts]
        if s.get("label"):
            legend.append((s["label"], color, s.get("kind", "points")))
    return out


def svg_plot(path, series, title, xlabel, ylabel, logx=True, logy=False, w=820, h=460):
    """Write a line/scatter plot: series = [{"label", "x", "y", "kind": "points" |
    "line"}] -> one <polyline> per line series, one <circle> per point, a legend entry
    per labelled series."""
    axis_x = _axis_units(logx)
    axis_y = _axis_units(logy)
    # 1. the data's extent in axis units, padded: 5% in x, 8% in y
    xs = np.concatenate([axis_x(s["x"]) for s in series])
    ys = np.concatenate([axis_y(s["y"]) for s in series])
    pad_x = 0.05 * (xs.max() - xs.min() or 1)
    pad_y = 0.08 * (ys.max() - ys.min() or 1)
    x0 = xs.min() - pad_x
    x1 = xs.max() + pad_x
    y0 = ys.min() - pad_y
    y1 = ys.max() + pad_y
    # 2. the plot area (the legend goes right of it), and axis units to pixels
    left = 80
    right = w - 200
    top = 40
    bottom = h - 60

    def pixel_x(v):
        return left + (v - x0) / (x1 - x0) * (right - left)

    def pixel_y(v):
        return bottom - (v - y0) / (y1 - y0) * (bottom - top)

    def to_pixels(s):
        return list(zip(pixel_x(axis_x(s["x"])), pixel_y(axis_y(s["y"]))))
    # 3. the title, the grid lines and their ticks, the frame, the axes' labels
    esc = xml.sax.saxutils.escape
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{esc(title)}'
           '</text>']
    for v, label in _ticks(x0, x1, logx):
        x = f"{pixel_x(v):.1f}"
        out += [f'<line x1="{x}" y1="{top}" x2="{x}" y2="{bottom}" stroke="#e5e5e5"/>',
                f'<text x="{x}" y="{bottom + 16}" text-anchor="middle">{label}</text>']
    for v, label in _ticks(y0, y1, logy):
        y = f"{pixel_y(v):.1f}"
        out += [f'<line x1="{left}" y1="{y}" x2="{right}" y2="{y}" stroke="#e5e5e5"/>',
                f'<text x="{left - 6}" y="{pixel_y(v) + 4:.1f}" text-anchor="end">'
                f'{label}</text>']
    middle = (top + bottom) / 2
    out += [f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
            'fill="none" stroke="black"/>',
            f'<text x="{(left + right) / 2}" y="{h - 18}" text-anchor="middle">'
            f'{esc(xlabel)}</text>',
            f'<text x="18" y="{middle}" text-anchor="middle" '
            f'transform="rotate(-90 18 {middle})">{esc(ylabel)}</text>']
    # 4. the series, then the legend
    legend = []
    out += _marks(series, to_pixels, legend)
    out += _legend(legend, right, top)
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return path

# ---------------------------------------------------------------------------- analysis


def _fmt(name, value, ci):
    return f"  {name:<22} {value:10.4g}   90% CI [{ci[0]:.4g}, {ci[1]:.4g}]"


def analyze(sweep, rows, out, convention="kaplan", n_boot=200, seed=0):
    """Fit, print (with 90% bootstrap intervals) and plot a sweep's rows; returns the
    fits as a dict."""
    N = effective_params(rows, convention)
    D = np.array([r["tokens_trained"] for r in rows], float)
    L = np.array([r["val_bpb"] for r in rows], float)
    unit = {"kaplan": "transformer matrices + lm_head", "total": "all params",
            "transformer": "transformer only"}
    print(f"{sweep}: {len(rows)} runs, N = {unit[convention]} ({convention}), "
          "D = tokens trained")
    if twice := sum(r.get("data_epoch", 0) > 0 for r in rows):
        print(f"  ({twice} of them read part of the corpus twice: data_epoch > 0 in the "
              "CSV)")
    if sweep == "scale_c":
        fit = analyze_isoflop
    else:
        fit = functools.partial(analyze_power, sweep)
    return fit(rows, N, D, L, out=out, convention=convention, n_boot=n_boot, seed=seed)


def analyze_isoflop(rows, N, D, L, out, convention, n_boot, seed):
    """scale_c: isoFLOP parabolas, their optima's power laws, and the Chinchilla fit once
    there are 8 runs."""
    # 1. the isoFLOP fit and its intervals
    iso = fit_isoflop(rows, convention)
    ci, sigma, dof = parametric_bootstrap(functools.partial(fit_isoflop,
                                                            convention=convention),
                                          rows, iso["fitted"], iso["n_params"],
                                          ["a", "b", "ratio"], n=n_boot, seed=seed)
    print(f"  {'C':>10} {'N*':>10} {'D*':>10} {'D/N':>7} {'bpb*':>7}")
    for c, n_star, d_star, ratio, bpb_star in iso["optima"]:
        print(f"  {c:10.3g} {n_star:10.3g} {d_star:10.3g} {ratio:7.2f} {bpb_star:7.4f}")
    print(_fmt("N* ~ C^a: a", iso["a"], ci["a"]))
    print(_fmt("D* ~ C^b: b", iso["b"], ci["b"]))
    print(_fmt("optimal D/N", iso["ratio"], ci["ratio"])
          + f"   (per-budget mean {iso['ratio_mean']:.2f} +- {iso['ratio_std']:.2f})")
    if dof > 0:
        print(f"  (intervals: the parabolas + N(0, {sigma:.4f}^2) bpb, from their "
              f"residuals over {dof} degrees of freedom)")
    else:
        print("  (no intervals: every budget has exactly 3 sizes; --width 4 or "
              "--seeds 2)")
    # 2. Chinchilla's fit, from 8 runs, its refits started where it ended
    if len(rows) < 8:
        print("  (the Chinchilla fit needs 8 runs or more)")
    ch = fit_chinchilla(N, D, L) if len(rows) >= 8 else None
    if ch:
        def refit(rs):
            return fit_chinchilla(effective_params(rs, convention),
                                  [r["tokens_trained"] for r in rs],
                                  [r["val_bpb"] for r in rs], starts=ch["theta"][None])
        keys = ["alpha", "beta", "E", "a", "b"]
        cci, csigma, cdof = parametric_bootstrap(refit, rows, ch["fitted"], 5, keys,
                                                 n=n_boot, seed=seed, log=True)
        print("  Chinchilla L(N, D) = E + A/N^alpha + B/D^beta (Huber in log space):")
        for k in keys:
            print(_fmt(k if k not in "ab" else f"implied {k}", ch[k], cci[k]))
        print(f"  (intervals: the fit x exp(N(0, {csigma:.4f}^2)), from its residuals "
              f"over {cdof} degrees of freedom)")
    # 3. the plots
    plot_isoflop(out, rows, N, L, iso, convention)
    return {"isoflop": iso, "isoflop_ci": ci, "isoflop_sigma": sigma, "chinchilla": ch,
            "chinchilla_ci": cci if ch else None}


def plot_isoflop(out, rows, N, L, iso, convention):
    """isoflop.svg (each budget's runs and parabola, the optima) and, with 2 budgets or
    more, optima.svg (N* and D* against C, with their power laws)."""
    # 1. each budget's runs and parabola, then the optima
    budgets = np.unique([r["flops_budget"] for r in rows])
    series = []
    for i, (c, p) in enumerate(zip(budgets, iso["parabolas"])):
        here = np.array([r["flops_budget"] for r in rows]) == c
        color = COLORS[i % 8]
        series.append({"x": N[here], "y": L[here], "label": f"C = {c:.3g}",
                       "color": color})
        if p[0] > 0:  # a parabola with a minimum (3+ sizes)
            log_n = np.log10(N[here])
            xs = np.linspace(log_n.min(), log_n.max(), 50)
            series.append({"x": 10**xs, "y": np.polyval(p, xs), "kind": "line",
                           "color": color})
    opt = iso["optima"]
    series.append({"x": opt[:, 1], "y": opt[:, 4], "label": "optimum N*",
                   "color": "black"})
    svg_plot(os.path.join(out, "isoflop.svg"), series, "IsoFLOP curves",
             f"N ({convention} params)", "val bpb")
    # 2. N* and D* against C, with the power laws through them
    C = opt[:, 0]
    if len(C) < 2:
        return
    cs = np.geomspace(C.min(), C.max(), 20)
    n_law = 10 ** (iso["a"] * np.log10(cs) + iso["log_kn"])
    d_law = 10 ** (iso["b"] * np.log10(cs) + iso["log_kd"])
    laws = [{"x": C, "y": opt[:, 1], "label": f"N*  (a = {iso['a']:.2f})",
             "color": COLORS[0]},
            {"x": cs, "y": n_law, "kind": "line", "color": COLORS[0]},
            {"x": C, "y": opt[:, 2], "label": f"D*  (b = {iso['b']:.2f})",
             "color": COLORS[1]},
            {"x": cs, "y": d_law, "kind": "line", "color": COLORS[1]}]
    svg_plot(os.path.join(out, "optima.svg"), laws, "Compute-optimal N* and D*",
             "C (training FLOPs)", "N* (params), D* (tokens)", logy=True)


def analyze_power(sweep, rows, N, D, L, out, convention, n_boot, seed):
    """scale_n / scale_d: L = E + A X^-alpha per group of the other variable, with 3 runs
    or more."""
    res = {}
    # X: what the law is in; the runs grouped by the other variable
    if sweep == "scale_n":
        X, xname, group = N, "N", D
    else:
        X, xname, group = D, "D", N

    def xs_of(rs):  # X of some rows
        if sweep == "scale_n":
            return effective_params(rs, convention)
        return np.array([r["tokens_trained"] for r in rs], float)
    series = []
    for i, g in enumerate(np.unique(group)):
        # 1. the group's runs
        here = group == g
        other = "D" if sweep == "scale_n" else "N"
        series.append({"x": X[here], "y": L[here], "color": COLORS[i % 8],
                       "label": f"{other} = {g:.3g}"})
        if here.sum() < 3:
            continue
        # 2. its power law, the intervals by resampling its runs
        sub = [r for r, k in zip(rows, here) if k]
        fit = fit_power(X[here], L[here])

        def refit(rs):
            return fit_power(xs_of(rs), [r["val_bpb"] for r in rs],
                             starts=fit["theta"][None])
        ci = bootstrap(refit, sub, ["alpha", "E"], n_boot, seed)
        print(f"  L({xname}) = E + A {xname}^-alpha at {series[-1]['label']}:")
        print(_fmt("alpha", fit["alpha"], ci["alpha"]))
        print(_fmt("E", fit["E"], ci["E"]))
        res[float(g)] = {"fit": fit, "ci": ci}
        # 3. its curve
        xs = np.geomspace(X[here].min(), X[here].max(), 40)
        curve = fit["E"] + fit["A"] * xs ** -fit["alpha"]
        series.append({"x": xs, "y": curve, "kind": "line", "color": COLORS[i % 8],
                       "label": f"fit: alpha = {fit['alpha']:.2f}"})
    if sweep == "scale_n":
        name, xlabel = "loss_vs_params.svg", f"N ({convention} params)"
    else:
        name, xlabel = "loss_vs_tokens.svg", "D (tokens trained)"
    svg_plot(os.path.join(out, name), series, f"val bpb vs {xname}", xlabel, "val bpb")
    return res
