"""Chat with a nanochat model: in the terminal, in the browser, or through an OpenAI-compatible API.

    python chat.py                          # terminal chat with the newest checkpoint (checkpoints/rl, else sft, base)
    python chat.py -p "What is 12*34?"      # one shot: print the reply and exit
    python chat.py --serve                  # web chat at http://127.0.0.1:8000/, OpenAI API at .../v1
    python chat.py --checkpoint checkpoints/base/step_000600 -t 0
    python chat.py --nanochat-checkpoint ~/.cache/nanochat    # a PyTorch nanochat run, read without torch

- Engine: `nanochat.generate` (KV cache, jitted prefill and decode) with nanochat's calculator tool: when the model
  writes <|python_start|>expr<|python_end|>, <|output_start|>result<|output_end|> is forced into the stream. A `Reply`
  turns the tokens into text and parts (text / python / python_output, as render_conversation takes them back): no
  special token ever shows as text; a calculator step shows as `[expr = result] ` in the terminal, `expr = result` on
  the page.
- Terminal (nanochat's chat_cli): the conversation stays token ids across turns, tool calls included; an incremental
  UTF-8 decoder prints a character split over tokens whole. `clear` starts over, `quit` ends.
- Web: a stdlib ThreadingHTTPServer. GET / is ui.html, a one-page chat that streams replies (`/?q=Hi` opens with Hi),
  sends each reply back as its parts, and drops the oldest turns (saying so) when a conversation outgrows the context.
  GET /v1/models, POST /v1/chat/completions (stream, n, stop, temperature, top_p, top_k, seed, logprobs and
  top_logprobs, max_tokens) follow OpenAI's API, errors included (an unknown model is a 404), so its clients work
  unchanged; our additions: a message's (or a stream delta's) `parts`, the model's `context_length` and
  default `max_tokens` (-m), GET /health.
  One lock around the model: requests queue, streams never interleave, a client that disconnects stops its
  generation. At start-up `warm_up` compiles every shape a request can take (sampling settings are traced values),
  so no request compiles; a stalled client holds a thread only until a timeout, and connections are capped.
- Real nanochat checkpoints without torch: the model_<step>.pt zip and tokenizer.pkl (a pickled tiktoken Encoding) are
  read by a restricted unpickler that resolves only the globals that tensors or the tokenizer's state need, so a
  pickle naming anything else (os.system, ...) is refused before it runs. Storages are raw little-endian fp32 or bf16.
"""

import argparse
import codecs
import collections
import contextlib
import dataclasses
import glob
import http.server
import json
import os
import pickle
import re
import secrets
import sys
import threading
import time
import urllib.parse
import uuid
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

import data
import nanochat as nc

# ------------------------------------------------------------------------------------------------ checkpoints


def load_checkpoint(path="checkpoints"):
    """(params, cfg, tok) of a checkpoint written by train.py: a step directory, or the newest under a root."""
    step_dir = path if os.path.isfile(os.path.join(path, "meta.json")) else data.latest_checkpoint(path)
    if step_dir is None:
        raise FileNotFoundError(f"no checkpoint in {path}/: train one first with `python train.py`")
    params, _, meta = data.load_checkpoint(step_dir, optimizer=False)
    cfg = nc.config_from(meta["config"], os.path.join(step_dir, "meta.json"))
    tok = data.Tokenizer.load(os.path.join(step_dir, meta["tokenizer"]))
    return jax.tree.map(jnp.asarray, params), cfg, tok


class _Unpickler(pickle.Unpickler):
    """Resolves only the globals in `allowed`; anything else is refused before it can be called."""

    def __init__(self, file, path, allowed, storage=None):
        super().__init__(file)
        self.path, self.allowed, self.storage = path, allowed, storage

    def find_class(self, module, name):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"{self.path}: refusing to load {module}.{name}: nanochat's files hold only "
                                         "tensors, dicts and tokenizer state, so this one is corrupt or malicious")
        return self.allowed[module, name]

    def persistent_load(self, pid):
        if self.storage is None or not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
            raise pickle.UnpicklingError(f"{self.path}: unexpected persistent id; not a torch checkpoint")
        return self.storage(*pid[1:])


def _rebuild_tensor(storage, offset, size, stride, *_):
    """torch._utils._rebuild_tensor_v2 for numpy: a copy of the strided view, bounds-checked."""
    end = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else offset
    if offset < 0 or min(stride, default=0) < 0 or end > storage.size:
        raise pickle.UnpicklingError("corrupt checkpoint: a tensor runs past its storage")
    return np.array(np.lib.stride_tricks.as_strided(storage[offset:], size, [s * storage.itemsize for s in stride]))


_STORAGES = {name: np.dtype(dt).newbyteorder("<") for name, dt in (
    ("FloatStorage", np.float32), ("BFloat16Storage", jnp.bfloat16), ("HalfStorage", np.float16),
    ("DoubleStorage", np.float64), ("IntStorage", np.int32), ("LongStorage", np.int64))}
_TORCH_GLOBALS = {("collections", "OrderedDict"): collections.OrderedDict,
                  ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                  **{("torch", name): dtype for name, dtype in _STORAGES.items()}}


def read_torch_state_dict(path):
    """A `torch.save`d state_dict (zip format) as {name: numpy array}, without torch and without running code; a
    damaged or foreign file is a ValueError naming it."""
    try:
        return _read_torch_zip(path)
    except (zipfile.BadZipFile, KeyError, EOFError, pickle.UnpicklingError, ValueError) as e:
        said = str(e)  # our own errors name the file already
        raise ValueError(said if said.startswith(f"{path}: ") else
                         f"{path}: a damaged torch checkpoint ({type(e).__name__}: {said})") from None


def _read_torch_zip(path):
    with zipfile.ZipFile(path) as z:
        pkl = next((n for n in z.namelist() if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise ValueError(f"{path}: not a torch zip checkpoint (no data.pkl); re-save it with torch >= 1.6")
        prefix = pkl[:-len("data.pkl")]
        if prefix + "byteorder" in z.namelist() and z.read(prefix + "byteorder") != b"little":
            raise ValueError(f"{path}: a big-endian checkpoint; convert it on a little-endian machine")

        def storage(dtype, key, location, numel):
            if not isinstance(dtype, np.dtype):
                raise pickle.UnpicklingError(f"{path}: a storage of unknown type")
            raw = z.read(f"{prefix}data/{key}")
            if len(raw) < numel * dtype.itemsize:
                raise pickle.UnpicklingError(f"{path}: storage {key} is shorter than its {numel} elements")
            return np.frombuffer(raw, dtype, count=numel)

        with z.open(pkl) as f:
            sd = _Unpickler(f, path, _TORCH_GLOBALS, storage).load()
    if not isinstance(sd, dict) or not all(isinstance(v, np.ndarray) for v in sd.values()):
        raise ValueError(f"{path}: not a state_dict of tensors")
    return dict(sd)


class _EncodingState:
    """Stands in for tiktoken.core.Encoding while unpickling: keeps the state dict, runs nothing."""

    def __setstate__(self, state):
        self.state = state


def load_nanochat_tokenizer(path):
    """nanochat's tokenizer.pkl (a pickled tiktoken Encoding) as a data.Tokenizer, read without unpickling code."""
    with open(path, "rb") as f:
        st = getattr(_Unpickler(f, path, {("tiktoken.core", "Encoding"): _EncodingState}).load(), "state", None)
    if not isinstance(st, dict) or not all(isinstance(st.get(k), dict) for k in ("mergeable_ranks", "special_tokens")):
        raise ValueError(f"{path}: not a pickled tiktoken Encoding")
    ranks, specials = st["mergeable_ranks"], st["special_tokens"]
    tokens = sorted(ranks, key=ranks.get)
    if [ranks[t] for t in tokens] != list(range(len(tokens))) or set(specials) != set(data.SPECIAL_TOKENS):
        raise ValueError(f"{path}: not a nanochat tokenizer (ranks 0..N-1 and nanochat's 9 special tokens)")
    tok = data.Tokenizer(tokens, st["pat_str"], sorted(specials, key=specials.get))
    if tok.special != specials:
        raise ValueError(f"{path}: the special tokens must take the ids right after the merges, as nanochat's do")
    return tok


def _steps(d):
    files = os.listdir(d) if os.path.isdir(d) else []
    return sorted(int(m[1]) for f in files if (m := re.fullmatch(r"model_(\d+)\.pt", f)))


def load_nanochat_checkpoint(path, step=None):
    """(params, cfg, tok) of a PyTorch nanochat run: a dir of model_<step>.pt files, or its NANOCHAT_BASE_DIR."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such directory; pass a nanochat checkpoint directory")
    if not _steps(path):  # a base dir: nanochat's pick, the largest d<N> tag of the first source that has one
        depth = lambda d: int(m[1]) if (m := re.fullmatch(r"d(\d+)", os.path.basename(d))) else -1
        for source in ("chatsft", "chatrl", "base"):
            if tags := [d for d in glob.glob(os.path.join(path, f"{source}_checkpoints", "*")) if _steps(d)]:
                path = max(tags, key=depth)
                break
        else:
            raise FileNotFoundError(f"{path}: no model_<step>.pt here nor in {{chatsft,chatrl,base}}_checkpoints/*/")
    step = _steps(path)[-1] if step is None else step
    with open(os.path.join(path, f"meta_{step:06d}.json")) as f:
        config = {"window_pattern": "L", **json.load(f)["model_config"]}  # nanochat's patch for old checkpoints
    cfg = nc.Config(**{f.name: config[f.name] for f in dataclasses.fields(nc.Config) if f.name in config})
    sd = read_torch_state_dict(os.path.join(path, f"model_{step:06d}.pt"))
    sd = {k.removeprefix("_orig_mod."): v for k, v in sd.items()}  # saved from a torch.compile'd module
    sd.setdefault("resid_lambdas", np.ones(cfg.n_layer, np.float32))  # more of build_model's patches
    sd.setdefault("x0_lambdas", np.zeros(cfg.n_layer, np.float32))
    params = nc.from_nanochat_state_dict(sd, cfg)
    found = [p for up in ("", "..", "../..", "../../..")
             if os.path.isfile(p := os.path.join(path, up, "tokenizer", "tokenizer.pkl"))]
    if not found:
        raise FileNotFoundError(f"{path}: no tokenizer/tokenizer.pkl here or in the 3 directories above")
    tok = load_nanochat_tokenizer(found[0])
    if tok.n_vocab != cfg.vocab_size:
        raise ValueError(f"{found[0]}: {tok.n_vocab} tokens, but the model has vocab_size {cfg.vocab_size}")
    return params, cfg, tok

# ------------------------------------------------------------------------------------------------ replies


class Reply:
    """One assistant reply as it grows a token at a time: its ids, and its parts as render_conversation takes them
    back ([{"type": "text" | "python" | "python_output", "text": ...}]: the calculator's special tokens open and close
    parts; no special token becomes text). It ends at <|assistant_end|> or <|bos|> ("stop"), at the first of `stop`'s
    strings that a text part writes (cut off before it, as OpenAI's stop), or when the caller calls end() ("length")."""

    def __init__(self, tok, stop=()):
        sp, self.tok, self.stop = tok.special, tok, stop
        self.opens = {sp["<|python_start|>"]: "python", sp["<|output_start|>"]: "python_output"}
        self.closes, self.ends = {sp["<|python_end|>"], sp["<|output_end|>"]}, {sp["<|assistant_end|>"], tok.bos}
        self.ids, self.parts, self.kind, self.sent, self.finish = [], [], "text", 0, None
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds back a character's first bytes

    @property
    def content(self):
        return "".join(p["text"] for p in self.parts if p["type"] == "text")

    def add(self, t):
        """Take the next token: (the text it makes final in the content, the calculator part it closed or None)."""
        self.ids.append(t)
        if t in self.ends:
            self.finish = "stop"
            return self._text(b"", final=True), None
        if t in self.opens:
            text, self.kind = self._text(b"", final=True), self.opens[t]
            self.parts.append({"type": self.kind, "text": ""})
            return text, None
        if t in self.closes:
            text, closed = self._text(b"", final=True), (self.parts[-1] if self.kind != "text" else None)
            self.kind = "text"
            return text, closed
        return self._text(b"" if t in self.tok.special.values() else self.tok.enc.decode_single_token_bytes(t)), None

    def end(self):
        """Cut off (max_tokens, a full context): the content text still held back."""
        self.finish = self.finish or "length"
        return self._text(b"", final=True)

    def _text(self, raw, final=False):
        piece = self.utf8.decode(raw, final)  # a character cut off by a special token or the end is U+FFFD
        if piece and (not self.parts or self.parts[-1]["type"] != self.kind):
            self.parts.append({"type": self.kind, "text": ""})
            self.sent = 0
        if not self.parts:
            return ""
        part = self.parts[-1]
        part["text"] += piece
        if part["type"] != "text":  # the calculator's parts are not content
            return ""
        if cuts := [i for s in self.stop if (i := part["text"].find(s)) >= 0]:
            part["text"], self.finish, final = part["text"][:min(cuts)], "stop", True
        held = 0 if final else max((k for s in self.stop for k in range(1, len(s)) if part["text"].endswith(s[:k])),
                                   default=0)  # a stop string's beginning waits for what follows
        text, self.sent = part["text"][self.sent:len(part["text"]) - held], len(part["text"]) - held
        return text


def sample_replies(params, cfg, tok, prompt, key, replies, rows=None, logits=False, **sampling):
    """Sample the Replies together (the calculator on), feeding each its tokens until every one has finished: yields
    (row, token id, content text made final, calculator part closed or None, the step's logits row or None) per token;
    a reply cut off by max_tokens yields (row, None, its held-back text, None, None) last. rows: the batch (>= the
    replies; a server keeps it fixed, so nothing compiles); sampling: nc.generate's max_tokens, temperature, top_k..."""
    stops = (tok.special["<|assistant_end|>"], tok.bos)
    for column, _, *out in nc.generate(params, cfg, prompt, key=key, num_samples=rows or len(replies), stop_ids=stops,
                                       tool=data.calculator_tool(tok), logits=logits, **sampling):
        step = np.asarray(out[0]) if logits else [None] * len(column)
        for row, (r, t) in enumerate(zip(replies, column)):
            if not r.finish:
                yield row, t, *r.add(t), step[row]
        if all(r.finish for r in replies):
            return
    for row, r in enumerate(replies):
        if not r.finish:
            yield row, None, r.end(), None, None

# ------------------------------------------------------------------------------------------------ terminal


def _typed():
    while True:
        try:
            yield input("\nUser: ")
        except (EOFError, KeyboardInterrupt):  # Ctrl+D or Ctrl+C at the prompt ends the chat
            return


def chat_cli(params, cfg, tok, prompt=None, max_tokens=256, temperature=0.6, top_k=50, seed=42):
    """nanochat's chat_cli: read a turn, stream the reply; `clear` starts over, `quit` ends; a prompt: one shot.
    A calculator step shows as [expression = result]."""
    sp, key, conversation = tok.special, jax.random.key(seed), [tok.bos]
    if prompt is None:
        print("nanochat: type 'clear' to start a new conversation, 'quit' to end it")
    for turn, text in enumerate([prompt] if prompt is not None else _typed()):
        text = text.strip()
        if text.lower() in ("quit", "exit"):
            return
        if text.lower() == "clear":
            conversation = [tok.bos]
            print("Conversation cleared.")
            continue
        ids = conversation + [sp["<|user_start|>"], *tok.encode(text), sp["<|user_end|>"], sp["<|assistant_start|>"]]
        if not text or len(ids) >= cfg.sequence_len:
            print(f"(that makes {len(ids)} tokens and the context is {cfg.sequence_len}: type 'clear' to start over)"
                  if text else "(type a message, 'clear' or 'quit')")
            continue
        print("\nAssistant: ", end="", flush=True)
        reply, call = Reply(tok), None  # a calculator call waits for its result: [expr = result], or [expr]
        for *_, piece, part, _ in sample_replies(params, cfg, tok, ids, jax.random.fold_in(key, turn), [reply],
                                                 max_tokens=max_tokens, temperature=temperature, top_k=top_k):
            if part and part["type"] == "python":
                call = part["text"]
            elif part or (piece and call is not None):
                piece = f"[{call or ''}{' = ' + part['text'] if part else ''}] {piece}"
                call = None
            print(piece, end="", flush=True)
        print("" if call is None else f"[{call}]")
        end = [] if reply.ids[-1:] == [sp["<|assistant_end|>"]] else [sp["<|assistant_end|>"]]
        conversation = ids + reply.ids + end

# ------------------------------------------------------------------------------------------------ web

MAX_BODY, MAX_MESSAGES, MAX_TOKENS, MAX_CHOICES = 1 << 20, 500, 4096, 8


class _Reject(Exception):
    """A request the client must fix: an HTTP status and a message that says what to change."""

    def __init__(self, status, message, code=None):
        super().__init__(message)
        self.status, self.code = status, code


def _option(req, name, lo, hi, default, kind=(int, float)):
    if (value := req.get(name)) is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind) or not lo <= value <= hi:
        raise _Reject(400, f"'{name}' must be {'an integer' if kind is int else 'a number'} from {lo} to {hi}")
    return value


def _plain(m):
    """A user or system message's content parts ([{"type": "text", "text": ...}], as OpenAI allows) as one string."""
    parts = m.get("content") if isinstance(m, dict) and m.get("role") != "assistant" else None
    text = lambda p: p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
    if isinstance(parts, list) and all(isinstance(text(p), str) for p in parts):
        return {**m, "content": "".join(map(text, parts))}
    return m


def parse_request(body, cfg, tok, defaults, model="nanochat"):
    """(prompt ids, options) of a /v1/chat/completions body; _Reject says what is wrong with it."""
    try:
        req = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise _Reject(400, f"the body is not valid JSON ({e})") from None
    messages = req.get("messages") if isinstance(req, dict) else None
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise _Reject(400, f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    if req.get("model", model) != model:
        raise _Reject(404, f"The model `{req['model']}` does not exist: this server has `{model}`", "model_not_found")
    messages = [_plain(m) for m in messages]
    if not isinstance(messages[-1], dict) or messages[-1].get("role") != "user":
        raise _Reject(400, "the last message must be the user's: the model replies to it")
    try:
        ids = data.render_conversation(tok, messages, MAX_BODY)[0] + [tok.special["<|assistant_start|>"]]
    except ValueError as e:
        raise _Reject(400, str(e)) from None
    name = "max_completion_tokens" if "max_completion_tokens" in req else "max_tokens"  # OpenAI's newer name
    asked = _option(req, name, 1, MAX_TOKENS, None, int)
    if len(ids) + (asked or 1) > cfg.sequence_len:  # OpenAI's rule: the prompt and the asked-for reply must fit
        raise _Reject(400, f"the conversation is {len(ids)} tokens{f' and {name} {asked}' if asked else ''}, the "
                      f"model's context {cfg.sequence_len}: send fewer or shorter messages", "context_length_exceeded")
    for flag in ("stream", "logprobs"):
        if not isinstance(req.get(flag, False), bool):
            raise _Reject(400, f"'{flag}' must be true or false")
    usage = req.get("stream_options")
    if usage is not None and not (isinstance(usage, dict) and isinstance(usage.get("include_usage", False), bool)):
        raise _Reject(400, """'stream_options' must be an object such as {"include_usage": true}""")
    stop = [req["stop"]] if isinstance(req.get("stop"), str) else req.get("stop") or []
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
        raise _Reject(400, "'stop' must be a string or a list of up to 4 non-empty strings")
    return ids, dict(stream=req.get("stream", False), seed=_option(req, "seed", 0, 2**63 - 1, None, int),
                     n=_option(req, "n", 1, MAX_CHOICES, 1, int), stop=stop,
                     max_tokens=asked or defaults["max_tokens"],
                     temperature=_option(req, "temperature", 0, 2, defaults["temperature"]),
                     top_k=_option(req, "top_k", 0, nc.TOP_K_MAX, defaults["top_k"], int),
                     top_p=_option(req, "top_p", 0, 1, 1.0), logprobs=req.get("logprobs", False),
                     top_logprobs=_option(req, "top_logprobs", 0, 20, 0, int),
                     usage=bool(usage and usage.get("include_usage")))


def _logprobs(tok, row, t, top):
    """OpenAI's logprobs entry of token t: its log-probability under the model (logits row), and the top likeliest."""
    lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
    entry = lambda i: {"token": tok.enc.decode_single_token_bytes(i).decode(errors="replace"),
                       "logprob": float(lp[i]), "bytes": list(tok.enc.decode_single_token_bytes(i))}
    return {**entry(t), "top_logprobs": [entry(int(i)) for i in np.argsort(-lp)[:top]]}


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "nanochat-jax"

    def setup(self):
        self.timeout = self.server.request_timeout  # every read and write: a stalled client frees its thread
        super().setup()

    def _send(self, status, ctype, body):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status, obj):
        self._send(status, "application/json", json.dumps(obj).encode())

    def _error(self, status, message, code=None):
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._json(status, {"error": {"message": message, "type": kind, "param": None, "code": code}})

    def _event(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())

    def _refusal(self, post):
        """Why a request is not served, or None: a Host that does not name this loopback server (DNS rebinding), a
        page of another origin (browsers send its Origin) driving the model, a POST body that is not JSON."""
        host, origin, port = self.headers.get("Host", ""), self.headers.get("Origin"), self.server.server_address[1]
        if self.server.loopback and not re.fullmatch(rf"(localhost|127\.0\.0\.1|\[::1\])(:{port})?", host, re.I):
            return _Reject(421, f"Host {host!r} is not this server: open it as http://127.0.0.1:{port}/")
        if origin is not None and origin.lower() != f"http://{host}".lower() and origin not in self.server.origins:
            return _Reject(403, f"requests from pages of {origin} are refused; to allow them, serve with "
                                f"--allow-origin {origin}")
        if post and self.headers.get_content_type() != "application/json":
            return _Reject(415, "send the body as JSON, with Content-Type: application/json")
        return None

    def do_GET(self):
        path, cfg = urllib.parse.urlsplit(self.path).path, self.server.model[1]
        if refused := self._refusal(post=False):
            self._error(refused.status, str(refused), refused.code)
        elif path == "/":
            self._send(200, "text/html; charset=utf-8", self.server.page)
        elif path == "/v1/models":  # context_length, max_tokens (the default reply): ours, for the page to fit turns
            self._json(200, {"object": "list", "data": [{"id": self.server.name, "object": "model", "owned_by":
                             "nanochat", "created": self.server.created, "context_length": cfg.sequence_len,
                             "max_tokens": self.server.defaults["max_tokens"]}]})
        elif path == "/health":
            self._json(200, {"status": "ok", "model": self.server.name, "compiled": self.server.compiled.is_set()})
        else:
            self._error(404, f"nothing at {path}: the chat is at /, the API at /v1/chat/completions and /v1/models")

    def do_POST(self):
        params, cfg, tok = self.server.model
        try:
            if refused := self._refusal(post=True):
                raise refused
            n = self.headers.get("Content-Length", "")
            if not re.fullmatch(r"[0-9]{1,18}", n):  # not isdigit(): int() refuses '²' and 5000 digits
                raise _Reject(411, "send a Content-Length header (the body's size in bytes)")
            if int(n) > MAX_BODY:
                if int(n) <= 8 * MAX_BODY:  # read it anyway, so the client gets the 413 rather than a reset
                    self.rfile.read(int(n))
                raise _Reject(413, f"the body is {n} bytes and the limit {MAX_BODY}: send fewer or shorter messages")
            body = self.rfile.read(int(n))
            if urllib.parse.urlsplit(self.path).path != "/v1/chat/completions":
                raise _Reject(404, "POST to /v1/chat/completions")
            prompt, opts = parse_request(body, cfg, tok, self.server.defaults, self.server.name)
        except _Reject as e:
            return self._error(e.status, str(e), e.code)
        self._complete(prompt, **opts)

    def _complete(self, prompt, stream, seed, n, stop, max_tokens, temperature, top_k, top_p, logprobs, top_logprobs,
                  usage):
        params, cfg, tok = self.server.model
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.server.name}
        chunk = lambda choices: {**head, "object": "chat.completion.chunk", "choices": choices}
        key = jax.random.key(secrets.randbits(32) if seed is None else seed % 2**32)  # 32-bit seeds without x64
        replies, tokens = [Reply(tok, stop) for _ in range(n)], [[] for _ in range(n)]  # tokens: logprobs entries
        with self.server.lock:  # one generation at a time: the model and its caches are not shared
            try:
                if stream:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                    self.send_header("Cache-Control", "no-cache")
                    self.end_headers()
                    self._event(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None} for i in range(n)]))
                for i, t, text, part, row in sample_replies(
                        params, cfg, tok, prompt, key, replies, 1 if n == 1 else MAX_CHOICES, logprobs,
                        max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        cache_len=cfg.sequence_len):  # the shapes warm_up compiled
                    in_text = t is not None and replies[i].kind == "text" and t not in tok.special.values()
                    entry = [_logprobs(tok, row, t, top_logprobs)] if logprobs and in_text else []
                    tokens[i] += entry
                    if stream and (text or part):  # a calculator part is sent whole once it closes
                        delta = {"content": text} if text else {"parts": [part]}
                        lp = {"logprobs": {"content": entry}} if logprobs else {}
                        self._event(chunk([{"index": i, "delta": delta, **lp, "finish_reason": None}]))
                made = sum(len(r.ids) for r in replies)
                counts = {"prompt_tokens": len(prompt), "completion_tokens": made, "total_tokens": len(prompt) + made}
                if stream:
                    self._event(chunk([{"index": i, "delta": {}, "finish_reason": r.finish}
                                       for i, r in enumerate(replies)]))
                    if usage:
                        self._event({**head, "object": "chat.completion.chunk", "choices": [], "usage": counts})
                    self.wfile.write(b"data: [DONE]\n\n")
                else:  # parts: our addition, the reply with its calculator steps, to send back as the message
                    self._json(200, {**head, "object": "chat.completion", "usage": counts, "choices": [{
                        "index": i, "message": {"role": "assistant", "content": r.content, "parts": r.parts},
                        **({"logprobs": {"content": tokens[i]}} if logprobs else {}), "finish_reason": r.finish}
                        for i, r in enumerate(replies)]})
            except (BrokenPipeError, ConnectionResetError):
                self.log_message("client went away after %d tokens: generation stopped",
                                 sum(len(r.ids) for r in replies))


class _Server(http.server.ThreadingHTTPServer):
    """At most max_connections at once (a 503 beyond them); a client that stalls or goes away costs a thread only
    until request_timeout, and one log line rather than a traceback."""
    daemon_threads, request_queue_size = True, 128  # (socketserver's backlog of 5 makes a burst wait for SYN retries)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            body = json.dumps({"error": {"message": "too many open connections; try again shortly",
                                         "type": "server_error", "param": None, "code": None}}).encode()
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            return self.shutdown_request(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            sys.stderr.write(f"{client_address[0]}: {sys.exc_info()[1].__class__.__name__}, connection closed\n")
        else:
            super().handle_error(request, client_address)


def make_server(params, cfg, tok, host="127.0.0.1", port=8000, name="nanochat", allow_origins=(), max_connections=64,
                request_timeout=30.0, **defaults):
    """The web chat and API server (port 0: any free port); defaults: max_tokens, temperature, top_k. Pages of other
    origins than its own are refused unless listed in allow_origins (e.g. "http://localhost:3000")."""
    server = _Server((host, port), _Handler)
    server.slots, server.request_timeout = threading.BoundedSemaphore(max_connections), request_timeout
    server.model, server.name, server.lock = (params, cfg, tok), name, threading.Lock()
    server.loopback, server.origins = host in ("localhost", "127.0.0.1", "::1"), set(allow_origins)
    server.created, server.compiled = int(time.time()), threading.Event()
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui.html"), "rb") as f:
        server.page = f.read()  # the web chat: one page, no dependencies
    server.defaults = {"max_tokens": 512, "temperature": 0.6, "top_k": 50, **defaults}
    return server


def warm_up(server):
    """Compile every shape a request can take (each prompt bucket, at batch 1 and MAX_CHOICES, the cache at the full
    context; sampling settings are traced), one at a time under the model lock: after it, no request compiles."""
    params, cfg, tok = server.model
    S = cfg.sequence_len
    for rows in (1, MAX_CHOICES):
        for bucket in sorted({min(nc._bucket(n), S) for n in range(1, S)}):
            with server.lock:
                collections.deque(nc.generate(params, cfg, [tok.bos] * min(bucket, S - 1), max_tokens=2,
                                              key=jax.random.key(0), num_samples=rows, cache_len=S), maxlen=0)
    server.compiled.set()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="checkpoints", help="a step directory of train.py, or a checkpoints root")
    p.add_argument("--nanochat-checkpoint", metavar="DIR", help="a PyTorch nanochat run: its model_<step>.pt "
                   "directory or its NANOCHAT_BASE_DIR")
    p.add_argument("-p", "--prompt", help="reply to this one message and exit")
    p.add_argument("-t", "--temperature", type=float, default=0.6, help="0 is greedy")
    p.add_argument("-k", "--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("-m", "--max-tokens", type=int, default=512, help="most tokens per reply")
    p.add_argument("--seed", type=int, default=42, help="terminal sampling seed (the server draws one per request)")
    p.add_argument("--serve", action="store_true", help="serve the web chat and the OpenAI-compatible API")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--allow-origin", nargs="*", default=[], help="origins of other pages allowed to use the server")
    p.add_argument("--compile-cache", default=os.path.expanduser("~/.cache/nanochat_jax/xla"),
                   help="persistent XLA compilation cache ('' to disable)")
    args = p.parse_args()
    if args.temperature < 0 or not 0 <= args.top_k <= nc.TOP_K_MAX or args.max_tokens < 1:
        sys.exit(f"error: -t must be 0 or more, -k from 0 to {nc.TOP_K_MAX}, -m 1 or more")
    if args.compile_cache:  # compiled prefill/decode steps are reused by the next chat
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character gets '?', not a crash
    try:
        params, cfg, tok = (load_nanochat_checkpoint(args.nanochat_checkpoint) if args.nanochat_checkpoint
                            else load_checkpoint(args.checkpoint))
    except (OSError, ValueError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        sys.exit(f"error: {e}")
    if args.serve:
        try:
            server = make_server(params, cfg, tok, args.host, args.port, allow_origins=args.allow_origin,
                                 max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k)
        except (OSError, OverflowError) as e:  # the port is taken, the host unknown, ...
            sys.exit(f"error: cannot serve on {args.host}:{args.port} ({e}): choose another --host or --port")
        url = f"http://{args.host}:{server.server_address[1]}"
        print(f"chat at {url}/ ; OpenAI-compatible API at {url}/v1 (model 'nanochat'); Ctrl+C stops")
        threading.Thread(target=warm_up, args=(server,), daemon=True).start()  # serving meanwhile: /health says
    try:
        if args.serve:
            server.serve_forever()
        else:
            chat_cli(params, cfg, tok, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed)
    except KeyboardInterrupt:  # Ctrl+C ends the chat or the server: no traceback
        print()


if __name__ == "__main__":
    main()
