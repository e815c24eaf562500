"""Checkpoints: ours, nanochat's, the loaders that give (params, cfg, tokenizer), and the export.

- Ours (train.py writes them): a stage's step directories, <out>/<stage>/step_NNNNNN/ with
  params.msgpack, opt.msgpack (trees of arrays), meta.json (the config, schedule, loader state and
  each file's CRC-32) and tokenizer.json. A step is written to a temporary directory that is
  renamed, and whatever it replaces or prunes is renamed away before it is deleted: a failed write
  or a kill -9 at any moment leaves each step directory complete or absent.
- LoRA's (train.py --lora-rank): params.msgpack holds the adapters, meta.json's "lora" their rank,
  alpha, targets and base (its path and CRC-32); `load_params` merges them onto that base after
  checking it, so every loader, chat.py, evaluate.py and the export take them as they are.
- nanochat's (PyTorch): model_<step>.pt (a torch.save zip) and meta_<step>.json, with
  tokenizer/tokenizer.pkl (a pickled tiktoken Encoding), read without torch (torch_files.py: a
  restricted unpickler resolves only the globals that tensors and the tokenizer's state need, so a
  pickle naming anything else is refused before it can run). `python checkpoint.py export SOURCE
  DEST` writes them without torch too (docs/export.md).
- nanochat's state_dict names and PyTorch's (out, in) layout, to and from our params (the one
  place the two layouts meet).
"""

import argparse
import dataclasses
import glob
import json
import os
import pathlib
import pickle
import re
import shutil
import sys
import zlib

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import tiktoken

import data
import lora
import nanochat as nc
import torch_files

# ----------------------------------------------------------------------------- trees of arrays


def _pack(obj):
    if hasattr(obj, "dtype") and hasattr(obj, "shape"):  # numpy and jax arrays
        if not getattr(obj, "is_fully_addressable", True):  # replicated over hosts: our replica
            obj = obj.addressable_data(0)
        a = np.asarray(obj, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        return msgpack.ExtType(1, msgpack.packb([a.dtype.name, list(a.shape), a.tobytes()]))
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}")


def _unpack(code, payload):
    dtype, shape, raw = msgpack.unpackb(payload)
    return np.frombuffer(raw, np.dtype(dtype)).reshape(tuple(shape))


def save_tree(path, tree):
    """Write a nested dict of arrays as msgpack, atomically; returns its CRC-32."""
    raw = msgpack.packb(tree, default=_pack)
    data.write_atomic(path, raw)
    return zlib.crc32(raw)


def load_tree(path, crc=None):
    """A tree written by save_tree, its arrays read-only numpy views; a file that does not unpack,
    or whose CRC-32 is not `crc`, is a ValueError."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if crc is not None and zlib.crc32(raw) != crc:
            raise ValueError(f"CRC-32 {zlib.crc32(raw)}, saved as {crc}")
        return msgpack.unpackb(raw, ext_hook=_unpack, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # flipped bits, a foreign file
        raise ValueError(f"{path}: damaged ({type(e).__name__}: {e}); use an earlier checkpoint") \
            from None

# ----------------------------------------------------------------------------- step directories


def checkpoint_dirs(root):
    """The step directories under root (e.g. checkpoints/base), oldest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(os.path.join(root, d) for d in names if re.fullmatch(r"step_\d{6}", d))


def save_checkpoint(root, step, params, opt_state, meta, keep=3, files=None):
    """Write root/step_NNNNNN/{params,opt}.msgpack and meta.json (and `files`: name -> writer(path))
    through a temporary directory, so a step directory is complete or absent; keep the newest
    `keep`."""
    final = os.path.join(root, f"step_{step:06d}")
    tmp = f"{final}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        crc = {"params.msgpack": save_tree(os.path.join(tmp, "params.msgpack"), params)}
        if opt_state is not None:
            crc["opt.msgpack"] = save_tree(os.path.join(tmp, "opt.msgpack"), opt_state)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "crc32": crc}, f, indent=1)
        for name, write in (files or {}).items():
            write(os.path.join(tmp, name))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Every rename is atomic and whatever is deleted is renamed away first.
    if os.path.isdir(final):  # saving a step again: set the old one aside only now
        os.replace(final, f"{final}.old{os.getpid()}")
    os.replace(tmp, final)
    for old in checkpoint_dirs(root)[:-keep]:
        os.replace(old, f"{old}.old{os.getpid()}")
    leftovers = [p for pattern in ("step_*.old*", "step_*.tmp*")
                 for p in glob.glob(os.path.join(root, pattern))]
    for stale in leftovers:  # the steps set aside above, and whatever a killed save left behind
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path, optimizer=True):
    """(params, opt_state or None, meta) of a step directory written by save_checkpoint."""
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no meta.json); train one "
                                "with train.py")
    with open(os.path.join(path, "meta.json")) as f:
        try:
            meta = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}/meta.json: damaged ({e}); use an earlier "
                             "checkpoint") from None
    crc, opt_path = meta.pop("crc32", {}), os.path.join(path, "opt.msgpack")
    opt_state = None
    if optimizer and os.path.isfile(opt_path):
        opt_state = load_tree(opt_path, crc.get("opt.msgpack"))
    params = load_tree(os.path.join(path, "params.msgpack"), crc.get("params.msgpack"))
    return params, opt_state, meta


def params_crc(path):
    """The CRC-32 of a step directory's params.msgpack, as its meta.json records it (or None)."""
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f).get("crc32", {}).get("params.msgpack")


def reference(path, stage_dir):
    """How a LoRA checkpoint names its base, the step directory path: the path from the
    adapters' stage folder, the absolute one, and the CRC-32 of its params."""
    return {"path": os.path.relpath(path, stage_dir), "abspath": os.path.abspath(path),
            "crc32": params_crc(path)}


def lora_base(path, ref):
    """The step directory of the base that the adapters at path were trained on: ref's path from
    their stage folder, else its absolute one, whichever holds params of ref's CRC-32."""
    found = []
    for base in (os.path.join(os.path.dirname(path), ref["path"]), ref["abspath"]):
        if os.path.isfile(os.path.join(base, "meta.json")):
            crc = params_crc(base)
            if crc == ref["crc32"]:
                return base
            found.append(f"{base} has CRC-32 {crc}")
    if not found:
        raise FileNotFoundError(f"{path} holds LoRA adapters of {ref['abspath']}, which is "
                                "missing: put that base checkpoint back where it was")
    raise ValueError(f"{path} holds LoRA adapters of a base whose params have CRC-32 "
                     f"{ref['crc32']}, but {'; '.join(found)}: restore the base they were "
                     "trained on")


def load_params(path):
    """(params, meta) of a step directory: a LoRA checkpoint's adapters merged onto the base it
    names (lora_base checks it is the one; a base of adapters too is merged first)."""
    params, _, meta = load_checkpoint(path, optimizer=False)
    if spec := meta.get("lora"):
        base, _ = load_params(lora_base(path, spec["base"]))
        frozen = lora.frozen(base, spec["rank"], spec["alpha"], spec.get("tokens", ()))
        params = lora.apply(frozen, params)
    return params, meta


def load_newest(root, log=print):
    """(path, params, opt_state, meta) of the newest step directory under root that loads, or None.
    A damaged one (saves are atomic, so only the disk or a hand can damage one) is named and
    skipped."""
    for path in reversed(checkpoint_dirs(root)):
        try:
            return (path, *load_checkpoint(path))
        except (ValueError, OSError) as e:
            log(f"skipping {path}: {e}")
    return None


def latest_checkpoint(root="checkpoints", stages=("rl", "sft", "base")):
    """The newest step directory of the first stage that has one (RL, then SFT, then base)."""
    for stage in stages:
        if dirs := checkpoint_dirs(os.path.join(root, stage)):
            return dirs[-1]
    return None


def find_step(path):
    """The step directory `path` names: a step directory itself, the newest of a stage folder
    (checkpoints/base), or of a root's latest stage (checkpoints: RL, then SFT, then base)."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = (checkpoint_dirs(path) or [None])[-1] or latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"no checkpoint in {path}/: pass a step directory, a stage folder "
                                "(checkpoints/base) or a root, or train one with `python train.py`")
    return found


def config_from(d, where):
    """Config(**d) of a checkpoint's meta; a field this version does not know is a one-line error.
    An "attention" field, a kernel route that older checkpoints recorded, is not the model's."""
    d = {k: v for k, v in d.items() if k != "attention"}
    if unknown := sorted(set(d) - {f.name for f in dataclasses.fields(nc.Config)}):
        raise ValueError(f"{where}: config fields {unknown} are unknown to this version of "
                         "nanochat.py; read it with the version that wrote it")
    return nc.Config(**d)


def load_stage(out, stage, tok):
    """(params, cfg, its step directory) of the newest checkpoint of `stage` under out (train.py's
    --out), which must have been trained with the tokenizer tok."""
    path = latest_checkpoint(out, (stage,))
    if path is None:
        raise FileNotFoundError(f"no {stage} checkpoint under {out}/{stage}: run `python train.py "
                                f"--stage {stage}` first")
    params, meta = load_params(path)
    if data.Tokenizer.load(os.path.join(path, meta["tokenizer"])).tokens != tok.tokens:
        raise ValueError(f"{path} was trained with another tokenizer than {out}/tokenizer.json; "
                         "start from a checkpoint of this --out, or train its stages again")
    return params, config_from(meta["config"], os.path.join(path, "meta.json")), path


def load_model(path="checkpoints"):
    """(params, cfg, tok) of a checkpoint of ours: see find_step for what `path` may name."""
    step_dir = find_step(path)
    params, meta = load_params(step_dir)
    cfg = config_from(meta["config"], os.path.join(step_dir, "meta.json"))
    tok = data.Tokenizer.load(os.path.join(step_dir, meta["tokenizer"]))
    return jax.tree.map(jnp.asarray, params), cfg, tok

# ------------------------------------------------------------------------- nanochat's state_dict

STACKED = ("h", "value_embeds")  # top-level keys of leaves stacked over layers
TRANSPOSED = ("h", "lm_head", "smear_gate")  # (in, out) here, (out, in) in PyTorch


def nanochat_names(path, cfg):
    """nanochat's state_dict names of our leaf at `path` (a tuple of keys), one per layer if
    stacked."""
    if path[0] == "h":
        layers = cfg.ve_layers if path[-1] == "ve_gate" else range(cfg.n_layer)
        return [f"transformer.h.{i}.{path[1]}.{path[2]}.weight" for i in layers]
    if path[0] == "value_embeds":
        return [f"value_embeds.{i}.weight" for i in cfg.ve_layers]
    names = {"wte": "transformer.wte.weight", "lm_head": "lm_head.weight",
             "smear_gate": "smear_gate.weight"}
    return [names.get(path[0], path[0])]


def to_nanochat_state_dict(params, cfg):
    """Our params -> nanochat's state_dict, float32 numpy arrays in PyTorch's (out, in) layout."""
    out = {}
    for keys, w in jax.tree_util.tree_leaves_with_path(params):
        path, w = tuple(k.key for k in keys), np.asarray(w, np.float32)
        for name, a in zip(nanochat_names(path, cfg), w if path[0] in STACKED else [w]):
            out[name] = a.T if path[0] in TRANSPOSED else a
    return out


def from_nanochat_state_dict(state_dict, cfg):
    """nanochat's state_dict (numpy arrays, any float dtype) -> our params; the exact inverse."""
    sd = {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}  # torch.compile'd
    shapes = nc.param_shapes(cfg)
    names = {n for keys, _ in jax.tree_util.tree_leaves_with_path(shapes)
             for n in nanochat_names(tuple(k.key for k in keys), cfg)}
    missing, unexpected = sorted(names - set(sd)), sorted(set(sd) - names)
    if missing or unexpected:
        raise ValueError(f"state_dict does not match {cfg}: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}; pass the Config the checkpoint was trained with")

    def leaf(keys, want):
        path = tuple(k.key for k in keys)
        rows = [np.asarray(sd[n], np.float32) for n in nanochat_names(path, cfg)]
        rows = [a.T for a in rows] if path[0] in TRANSPOSED else rows
        a = np.stack(rows) if path[0] in STACKED else rows[0]
        if a.shape != want.shape:
            raise ValueError(f"{'.'.join(path)} has shape {a.shape}, expected {want.shape} for "
                             f"{cfg}")
        return jnp.asarray(a)
    return jax.tree_util.tree_map_with_path(leaf, shapes)

# ---------------------------------------------------------------------------- nanochat's files


class _EncodingState:
    """Stands in for tiktoken.core.Encoding while unpickling: keeps the state dict, runs nothing."""

    def __setstate__(self, state):
        self.state = state


def load_nanochat_tokenizer(path):
    """nanochat's tokenizer.pkl (a pickled tiktoken Encoding) as a data.Tokenizer, read without
    unpickling code."""
    with open(path, "rb") as f:
        allowed = {("tiktoken.core", "Encoding"): _EncodingState}
        state = torch_files.Unpickler(f, path, allowed).load()
    st = getattr(state, "state", None)
    if not isinstance(st, dict) or not all(isinstance(st.get(k), dict)
                                           for k in ("mergeable_ranks", "special_tokens")):
        raise ValueError(f"{path}: not a pickled tiktoken Encoding")
    ranks, specials = st["mergeable_ranks"], st["special_tokens"]
    tokens = sorted(ranks, key=ranks.get)
    dense = [ranks[t] for t in tokens] == list(range(len(tokens)))
    if not dense or set(specials) != set(data.SPECIAL_TOKENS):
        raise ValueError(f"{path}: not a nanochat tokenizer (ranks 0..N-1 and nanochat's 9 special "
                         "tokens)")
    tok = data.Tokenizer(tokens, st["pat_str"], sorted(specials, key=specials.get))
    if tok.special != specials:
        raise ValueError(f"{path}: the special tokens must take the ids right after the merges, "
                         "as nanochat's do")
    return tok


def nanochat_steps(d):
    """The steps of the model_<step>.pt files in a directory, in order."""
    files = os.listdir(d) if os.path.isdir(d) else []
    return sorted(int(m[1]) for f in files if (m := re.fullmatch(r"model_(\d+)\.pt", f)))


def find_nanochat(path, step=None):
    """(model directory, step) of a PyTorch nanochat run: a directory of model_<step>.pt files, or
    its NANOCHAT_BASE_DIR (nanochat's pick: the largest d<N> of the first source that has one)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such directory; pass a nanochat checkpoint directory")
    if not nanochat_steps(path):
        def depth(d):
            return int(m[1]) if (m := re.fullmatch(r"d(\d+)", os.path.basename(d))) else -1
        for source in ("chatsft", "chatrl", "base"):
            pattern = os.path.join(path, f"{source}_checkpoints", "*")
            if tags := [d for d in glob.glob(pattern) if nanochat_steps(d)]:
                path = max(tags, key=depth)
                break
        else:
            raise FileNotFoundError(f"{path}: no model_<step>.pt here nor in "
                                    "{chatsft,chatrl,base}_checkpoints/*/")
    return path, nanochat_steps(path)[-1] if step is None else step


def load_nanochat(path, step=None):
    """(params, cfg, tok) of a PyTorch nanochat run that find_nanochat finds."""
    path, step = find_nanochat(path, step)
    with open(os.path.join(path, f"meta_{step:06d}.json")) as f:
        config = {"window_pattern": "L", **json.load(f)["model_config"]}  # nanochat's patch
    fields = [f.name for f in dataclasses.fields(nc.Config) if f.name in config]
    cfg = nc.Config(**{name: config[name] for name in fields})
    sd = torch_files.read_torch_state_dict(os.path.join(path, f"model_{step:06d}.pt"))
    sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items()}  # saved from torch.compile
    sd.setdefault("resid_lambdas", np.ones(cfg.n_layer, np.float32))  # more of build_model's
    sd.setdefault("x0_lambdas", np.zeros(cfg.n_layer, np.float32))  # patches
    params = from_nanochat_state_dict(sd, cfg)
    found = [p for up in ("", "..", "../..", "../../..")
             if os.path.isfile(p := os.path.join(path, up, "tokenizer", "tokenizer.pkl"))]
    if not found:
        raise FileNotFoundError(f"{path}: no tokenizer/tokenizer.pkl here or in the 3 directories "
                                "above")
    tok = load_nanochat_tokenizer(found[0])
    if tok.n_vocab != cfg.vocab_size:
        raise ValueError(f"{found[0]}: {tok.n_vocab} tokens, but the model has vocab_size "
                         f"{cfg.vocab_size}")
    return params, cfg, tok

def tokenizer_pickle(tok):
    """tokenizer.pkl's bytes as nanochat's RustBPETokenizer.save writes them for tok."""
    enc = tiktoken.Encoding("rustbpe", pat_str=tok.pat_str, special_tokens=tok.special,
                            mergeable_ranks={t: i for i, t in enumerate(tok.tokens)})
    return pickle.dumps(enc, protocol=4)  # Python 3.11's default, as nanochat's files have

# -------------------------------------------------------------------------- export to nanochat

NANOCHAT_DIRS = {"base": "base_checkpoints", "sft": "chatsft_checkpoints",
                 "rl": "chatrl_checkpoints"}  # checkpoint_manager.load_model's sources
META_KEYS = ("step", "val_bpb", "model_config", "user_config", "device_batch_size",
             "max_seq_len", "total_batch_size")  # base_train's, less those resuming needs


def nanochat_state_dict(params, cfg, embeddings="auto", log=print):
    """(state_dict, embeddings' dtype) of our params in the dtypes a nanochat run saves."""
    sd = to_nanochat_state_dict(params, cfg)
    emb = [k for k in sd if k == "transformer.wte.weight" or k.startswith("value_embeds.")]
    bf16 = {k: sd[k].astype(jnp.bfloat16) for k in emb}
    exact = all(np.array_equal(bf16[k].astype(np.float32), sd[k]) for k in emb)
    if embeddings == "auto":
        embeddings = "bfloat16" if exact else "float32"
    if embeddings == "bfloat16":
        if not exact:
            log(f"rounded {', '.join(emb)} from float32 to bfloat16 (--embeddings bfloat16)")
        sd.update(bf16)
    elif embeddings != "float32":
        raise ValueError(f"embeddings {embeddings!r}: pass auto, bfloat16 or float32")
    return sd, embeddings


def load_for_export(path, step=None):
    """(params, cfg, tok, stage, step, nanochat's meta keys) of our checkpoint or nanochat's."""
    if nanochat_steps(path) or any(os.path.isdir(os.path.join(path, d))
                                   for d in NANOCHAT_DIRS.values()):
        model_dir, step = find_nanochat(path, step)
        meta = json.loads(pathlib.Path(model_dir, f"meta_{step:06d}.json").read_text())
        parent = os.path.basename(os.path.dirname(os.path.abspath(model_dir)))
        stage = {d: name for name, d in NANOCHAT_DIRS.items()}.get(parent, parent)
        return (*load_nanochat(model_dir, step), stage, step, meta)
    step_dir = os.path.normpath(find_step(path))
    if step is not None:  # that step of the stage find_step picks
        step_dir = os.path.join(os.path.dirname(step_dir), f"step_{step:06d}")
    params, meta = load_params(step_dir)
    cfg = config_from(meta["config"], os.path.join(step_dir, "meta.json"))
    tok = data.Tokenizer.load(os.path.join(step_dir, meta["tokenizer"]))
    stage = meta.get("stage", os.path.basename(os.path.dirname(os.path.abspath(step_dir))))
    args = meta.get("args", {})  # train.py's flags, named and meant as nanochat's scripts' are
    known = {"val_bpb": meta.get("val_bpb"), "user_config": args, "max_seq_len": cfg.sequence_len,
             "device_batch_size": args.get("device_batch_size")}
    if args.get("total_batch_size", -1) > 0:  # -1: nanochat's rule picked it, and we kept no note
        known["total_batch_size"] = args["total_batch_size"]
    return params, cfg, tok, stage, meta.get("step", int(os.path.basename(step_dir)[5:])), known


def write_files(dest, files):
    """Write {path under dest: writer(path)} into a temporary tree, then rename each into dest."""
    dest = os.path.abspath(dest)
    tmp = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.tmp{os.getpid()}")
    try:
        for rel, write in files.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
            write(os.path.join(tmp, rel))
        if not os.path.exists(dest):  # a new dest appears whole
            os.rename(tmp, dest)
        for rel in files if os.path.exists(tmp) else ():
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            os.replace(os.path.join(tmp, rel), os.path.join(dest, rel))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def same_tokenizer(path, tok):
    """Whether nanochat's tokenizer.pkl at path is tok (a damaged one is not)."""
    try:
        theirs = load_nanochat_tokenizer(path)
    except (ValueError, OSError, EOFError, pickle.UnpicklingError):
        return False
    return (theirs.tokens, theirs.pat_str, theirs.special) == (tok.tokens, tok.pat_str, tok.special)


def export_nanochat(params, cfg, tok, dest, stage, step, *, meta_extra=None, model_tag=None,
                    force=False, embeddings="auto"):
    """Write a model into dest, a NANOCHAT_BASE_DIR, as nanochat saves it; returns its .pt path.
    Says what it wrote (and any embeddings it rounded) on stdout."""
    if stage not in NANOCHAT_DIRS:
        raise ValueError(f"stage {stage!r}: nanochat's are base, sft, rl; export one of those")
    if tok.n_vocab != cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tok.n_vocab} tokens but the model vocab_size "
                         f"{cfg.vocab_size}: export the model with the tokenizer it learned")
    folder = os.path.join(NANOCHAT_DIRS[stage], model_tag or f"d{cfg.n_layer}")
    model = os.path.join(dest, folder, f"model_{step:06d}.pt")
    if os.path.exists(model) and not force:
        raise ValueError(f"{model} exists: pass --force (force=True) to overwrite it, or export "
                         "another --step or --model-tag")
    pkl = os.path.join(dest, "tokenizer", "tokenizer.pkl")
    if os.path.exists(pkl) and not force and not same_tokenizer(pkl, tok):
        raise ValueError(f"{pkl} is another tokenizer than this model's: export into another "
                         "directory, or pass --force (force=True) to replace it")
    sd, dtype = nanochat_state_dict(params, cfg, embeddings, log=print)
    known = {"step": step, **(meta_extra or {}),
             "model_config": {k: v for k, v in dataclasses.asdict(cfg).items()  # GPTConfig's
                              if k != "compute_dtype"}}
    meta = json.dumps({k: known[k] for k in META_KEYS if known.get(k) is not None}, indent=2)
    write_files(dest, {  # the model last: nanochat looks for model_<step>.pt files
        "tokenizer/tokenizer.pkl": lambda p: pathlib.Path(p).write_bytes(tokenizer_pickle(tok)),
        "tokenizer/token_bytes.pt": lambda p: torch_files.write_torch_state_dict(
            p, tok.token_bytes(), "archive"),
        os.path.join(folder, f"meta_{step:06d}.json"): lambda p: pathlib.Path(p).write_text(meta),
        os.path.join(folder, f"model_{step:06d}.pt"):
            lambda p: torch_files.write_torch_state_dict(p, sd)})
    print(f"{model}: {stage} step {step}, {dtype} embeddings")
    return model

# -------------------------------------------------------------------------------- command line


class Parser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag: one line, not the whole usage
        self.exit(2, f"error: {message} (python checkpoint.py export --help lists the flags)\n")


def parse_args(argv=None):
    p = Parser(description="Export a checkpoint as a nanochat base directory (docs/export.md).")
    e = p.add_subparsers(dest="command", required=True).add_parser(
        "export", help="write a checkpoint into a NANOCHAT_BASE_DIR that nanochat's scripts load")
    e.add_argument("source", help="ours: a root (checkpoints), a stage folder or a step "
                   "directory (newest rl, sft, base); or a nanochat checkpoint directory")
    e.add_argument("dest", help="the nanochat base directory to write into (made if absent)")
    e.add_argument("--step", type=int, help="the source's step (default: its newest)")
    e.add_argument("--model-tag", help="nanochat's model tag (default: d<n_layer>)")
    e.add_argument("--force", action="store_true", help="overwrite that step, and the tokenizer")
    e.add_argument("--embeddings", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="wte and value_embeds dtype (auto: bfloat16 when exact, else float32)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    params, cfg, tok, stage, step, meta = load_for_export(args.source, args.step)
    return export_nanochat(params, cfg, tok, args.dest, stage, step,
                           meta_extra=meta,
                           model_tag=args.model_tag,
                           force=args.force,
                           embeddings=args.embeddings)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError, pickle.UnpicklingError) as e:  # one line, no traceback
        sys.exit(f"error: {e}")
