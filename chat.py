"""Chat with a nanochat model: in the terminal, in the browser, or through an
OpenAI-compatible API. Every reply is sampled by engine.py's slot engine, with
nanochat's calculator on.

    python chat.py                      # terminal chat, newest checkpoint: RL, SFT, base
    python chat.py -p "What is 12*34?"  # one shot: print the reply and exit
    python chat.py --serve              # web chat at http://127.0.0.1:8000/, API at /v1
    python chat.py --checkpoint checkpoints/base -t 0
    python chat.py --nanochat-checkpoint ~/.cache/nanochat  # a PyTorch run, no torch

Read `Reply` (a reply's tokens as text and parts), `sample_replies`, `chat_cli`, then
the server: `parse_request`, `_Handler`, `make_server`. docs/chat.md tells the rest: how
a calculator step shows, what the API adds to OpenAI's, how many share one engine.
"""

import argparse
import codecs
import contextlib
import dataclasses
import http.server
import itertools
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

import checkpoint
import data
import engine
import kernels
import runtime

# what one request may ask for: beyond these, a 400 (or a 413) that names the limit
MAX_BODY = 1 << 20  # bytes of JSON
MAX_MESSAGES = 500
MAX_TOKENS = 4096  # a request's max_tokens
MAX_CHOICES = 8  # a request's n

# ------------------------------------------------------------------------------ replies


class Reply:
    """One assistant reply as it grows a token at a time: its ids, and its parts as
    render_conversation takes them back ([{"type": "text" | "python" | "python_output",
    "text": ...}]: the calculator's special tokens open and close parts; no special
    token becomes text). It ends at <|assistant_end|> or <|bos|> ("stop"), at the first
    of `stop`'s strings that a text part writes (cut off before it, as OpenAI's stop),
    or when the caller calls end() ("length")."""

    def __init__(self, tok, stop=()):
        sp = tok.special
        self.tok = tok
        self.stop = stop
        self.opens = {sp["<|python_start|>"]: "python", sp["<|output_start|>"]: "python_output"}
        self.closes = {sp["<|python_end|>"], sp["<|output_end|>"]}
        self.ends = set(data.reply_stops(tok))
        self.ids = []
        self.parts = []
        self.kind = "text"  # the type of the part the next token writes to
        self.sent = 0  # how much of the last part's text was returned already
        self.finish = None  # "stop" or "length" once the reply has ended
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # holds partial bytes

    @property
    def content(self):
        return "".join(p["text"] for p in self.parts if p["type"] == "text")

    def add(self, t):
        """Take the next token: (the content text it makes final, the calculator part it
        closed or None)."""
        self.ids.append(t)
        if t in self.ends:
            self.finish = "stop"
            return self._text(b"", final=True), None
        if t in self.opens:
            # the bytes held so far belong to the part before this one
            text = self._text(b"", final=True)
            self.kind = self.opens[t]
            self.parts.append({"type": self.kind, "text": ""})
            return text, None
        if t in self.closes:
            text = self._text(b"", final=True)
            closed = self.parts[-1] if self.kind != "text" else None
            self.kind = "text"
            return text, closed
        special = t in self.tok.special.values()
        raw = b"" if special else self.tok.enc.decode_single_token_bytes(t)
        return self._text(raw), None

    def end(self):
        """Cut off (max_tokens, a full context): the content text still held back."""
        self.finish = self.finish or "length"
        return self._text(b"", final=True)

    def _text(self, raw, final=False):
        # 1. decode into the current part, opening a new one when the kind has changed
        piece = self.utf8.decode(raw, final)  # a character cut off by a special token: U+FFFD
        if piece and (not self.parts or self.parts[-1]["type"] != self.kind):
            self.parts.append({"type": self.kind, "text": ""})
            self.sent = 0
        if not self.parts:
            return ""
        part = self.parts[-1]
        part["text"] += piece
        if part["type"] != "text":  # the calculator's parts are not content
            return ""
        # 2. a stop string ends the reply, cut off before it
        if cuts := [i for s in self.stop if (i := part["text"].find(s)) >= 0]:
            part["text"] = part["text"][:min(cuts)]
            self.finish = "stop"
            final = True
        # 3. a stop string's beginning waits for what follows
        held = 0
        if not final:
            held = max((k for s in self.stop for k in range(1, len(s))
                        if part["text"].endswith(s[:k])), default=0)
        # 4. return what is new and no longer held
        shown = len(part["text"]) - held
        text = part["text"][self.sent:shown]
        self.sent = shown
        return text


def chat_engine(params, cfg, tok, slots=1, waiting=None, kv_cache=None, pages=None):
    """The engine that chat.py samples from, not yet started: `slots` rows over the
    whole context (kv_cache, pages: the engine's), the calculator's block ids, this
    backend's attention."""
    sp = tok.special
    python_ids = (sp["<|python_start|>"], sp["<|python_end|>"])
    return engine.Engine(params, cfg, slots=slots, attn=kernels.attention_fn(),
                         python_ids=python_ids, waiting=waiting, kv_cache=kv_cache,
                         pages=pages)


def sample_replies(eng, tok, prompt, replies, sampling):
    """Submit the Replies to a started engine, the calculator on: an iterator that feeds
    each reply its tokens until every one has finished. It yields a device call's
    steps at a time, a list of (choice, token id, content text made final, calculator
    part closed or None, its logprobs or None); a reply cut off by its budget gives
    (choice, None, its held-back text, None, None) last. `sampling` is an
    engine.Sampling whose stop ids are replaced by the reply's. Closing the iterator
    cancels the request (engine.Busy is raised here, before anything is read)."""
    sampling = dataclasses.replace(sampling, stop_ids=data.reply_stops(tok))
    request = eng.submit(prompt, sampling, n=len(replies), tool=data.calculator_tool(tok),
                         stream=True)
    return _read_replies(request, replies)


def _read_replies(request, replies):
    try:
        for batch in request.batches():
            steps = []
            for event in batch:
                reply = replies[event.choice]
                if reply.finish:  # a stop string ended it: its tokens are no longer read
                    continue
                if event.token is None:  # cut off
                    steps.append((event.choice, None, reply.end(), None, None))
                else:
                    said = reply.add(event.token)
                    steps.append((event.choice, event.token, *said, event.logprobs))
            yield steps
            if all(r.finish for r in replies):
                return
    finally:
        request.cancel()  # frees its slots if it is still running

# ----------------------------------------------------------------------------- terminal


def _typed():
    while True:
        try:
            yield input("\nUser: ")
        except (EOFError, KeyboardInterrupt):  # Ctrl+D or Ctrl+C at the prompt ends the chat
            return


def _print_reply(eng, tok, ids, sampling):
    """Stream one reply to the terminal, a calculator step as [expr = result]; return
    its Reply."""
    print("\nAssistant: ", end="", flush=True)
    reply = Reply(tok)
    call = None  # a calculator call waits for its result
    steps = sample_replies(eng, tok, ids, [reply], sampling)
    for *_, piece, part, _ in itertools.chain.from_iterable(steps):
        if part and part["type"] == "python":
            call = part["text"]
        elif part or (piece and call is not None):
            # a step shows once its result closes it, or as [expr] if text comes first
            result = " = " + part["text"] if part else ""
            piece = f"[{call or ''}{result}] {piece}"
            call = None
        print(piece, end="", flush=True)
    print("" if call is None else f"[{call}]")
    return reply


def chat_cli(eng, tok, prompt=None, max_tokens=256, temperature=0.6, top_k=50, seed=42):
    """nanochat's chat_cli on a started engine: read a turn, stream the reply; `clear`
    starts over, `quit` ends; with a prompt: one shot. Turn t samples with seed + t."""
    sp = tok.special
    # the conversation stays token ids across turns, calculator steps included
    conversation = [tok.bos]
    if prompt is None:
        print("nanochat: type 'clear' to start a new conversation, 'quit' to end it")
    for turn, text in enumerate([prompt] if prompt is not None else _typed()):
        # 1. the commands, and a turn that says nothing
        text = text.strip()
        if text.lower() in ("quit", "exit"):
            return
        if text.lower() == "clear":
            conversation = [tok.bos]
            print("Conversation cleared.")
            continue
        if not text:
            print("(type a message, 'clear' or 'quit')")
            continue
        # 2. the user's turn, checked against the context before anything is sampled
        user = [sp["<|user_start|>"], *tok.encode(text), sp["<|user_end|>"]]
        ids = conversation + user + [sp["<|assistant_start|>"]]
        if len(ids) >= eng.cfg.sequence_len:
            print(f"(that makes {len(ids)} tokens and the context is {eng.cfg.sequence_len}: "
                  "type 'clear' to start over)")
            continue
        # 3. stream the reply, then keep it; one cut off by max_tokens is closed here
        sampling = engine.Sampling(max_tokens=max_tokens, temperature=temperature,
                                   top_k=top_k, seed=(seed + turn) % 2**32)
        reply = _print_reply(eng, tok, ids, sampling)
        assistant_end = sp["<|assistant_end|>"]
        end = [] if reply.ids[-1:] == [assistant_end] else [assistant_end]
        conversation = ids + reply.ids + end

# ---------------------------------------------------------------------------------- web


class _Reject(Exception):
    """A request the client must fix: an HTTP status, a message that says what to do."""

    def __init__(self, status, message, code=None):
        super().__init__(message)
        self.status = status
        self.code = code


def _option(req, name, lo, hi, default, types=(int, float)):
    """The request's `name` if within [lo, hi] (`default` when absent), else a 400."""
    if (value := req.get(name)) is None:
        return default
    # JSON's true and false are Python ints: refuse them too
    if isinstance(value, bool) or not isinstance(value, types) or not lo <= value <= hi:
        what = "an integer" if types is int else "a number"
        raise _Reject(400, f"'{name}' must be {what} from {lo} to {hi}")
    return value


def _plain(message):
    """A user or system message's content parts ([{"type": "text", "text": ...}], as
    OpenAI allows) as one string."""
    parts = None
    if isinstance(message, dict) and message.get("role") != "assistant":
        parts = message.get("content")

    def text(p):
        return p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None
    if isinstance(parts, list) and all(isinstance(text(p), str) for p in parts):
        return {**message, "content": "".join(map(text, parts))}
    return message


def _prompt(req, cfg, tok, model):
    """The prompt ids of a request's messages, and its max_tokens as asked (or None)."""
    # 1. the messages, their content parts joined, and the model
    messages = req.get("messages") if isinstance(req, dict) else None
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise _Reject(400, f"'messages' must be a list of 1 to {MAX_MESSAGES} messages")
    if req.get("model", model) != model:
        raise _Reject(404, f"The model `{req['model']}` does not exist: this server has "
                      f"`{model}`", "model_not_found")
    messages = [_plain(m) for m in messages]
    if not isinstance(messages[-1], dict) or messages[-1].get("role") != "user":
        raise _Reject(400, "the last message must be the user's: the model replies to it")
    # 2. render them as nanochat's chat format, the assistant's turn opened
    try:
        rendered = data.render_conversation(tok, messages, MAX_BODY)[0]
    except ValueError as e:
        raise _Reject(400, str(e)) from None
    ids = rendered + [tok.special["<|assistant_start|>"]]
    # 3. OpenAI's rule: the prompt and the reply must fit the context
    newer = "max_completion_tokens" in req  # the newer name of max_tokens
    name = "max_completion_tokens" if newer else "max_tokens"
    asked = _option(req, name, 1, MAX_TOKENS, None, int)
    if len(ids) + (asked or 1) > cfg.sequence_len:
        also = f" and {name} {asked}" if asked else ""
        raise _Reject(400, f"the conversation is {len(ids)} tokens{also}, the model's "
                      f"context {cfg.sequence_len}: send fewer or shorter messages",
                      "context_length_exceeded")
    return ids, asked


def parse_request(body, cfg, tok, defaults, model="nanochat"):
    """(prompt ids, options) of a /v1/chat/completions body, or a _Reject saying why."""
    # 1. the JSON, then the prompt it asks to complete
    try:
        req = json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise _Reject(400, f"the body is not valid JSON ({e})") from None
    ids, asked = _prompt(req, cfg, tok, model)
    # 2. the flags and the stop strings
    for flag in ("stream", "logprobs"):
        if not isinstance(req.get(flag, False), bool):
            raise _Reject(400, f"'{flag}' must be true or false")
    usage = req.get("stream_options")
    include = usage.get("include_usage", False) if isinstance(usage, dict) else None
    if usage is not None and not isinstance(include, bool):
        raise _Reject(400, """'stream_options' must be an object such as {"include_usage": true}""")
    stop = [req["stop"]] if isinstance(req.get("stop"), str) else req.get("stop") or []
    strings = isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    if not strings or len(stop) > 4:
        raise _Reject(400, "'stop' must be a string or a list of up to 4 non-empty strings")
    # 3. the sampling options, in this order: the first one out of range is reported
    seed = _option(req, "seed", 0, 2**63 - 1, None, int)
    n = _option(req, "n", 1, MAX_CHOICES, 1, int)
    temperature = _option(req, "temperature", 0, 2, defaults["temperature"])
    top_k = _option(req, "top_k", 0, engine.TOP_K_MAX, defaults["top_k"], int)
    top_p = _option(req, "top_p", 0, 1, 1.0)
    top_logprobs = _option(req, "top_logprobs", 0, 20, 0, int)
    return ids, dict(stream=req.get("stream", False), seed=seed, n=n, stop=stop,
                     max_tokens=asked or defaults["max_tokens"], temperature=temperature,
                     top_k=top_k, top_p=top_p, logprobs=req.get("logprobs", False),
                     top_logprobs=top_logprobs,
                     usage=bool(usage and usage.get("include_usage")))


def _logprobs(tok, t, probs, top):
    """OpenAI's logprobs entry of token t from the engine's probs: (t's log-probability,
    the likeliest (id, log-probability) pairs), of which the top first."""
    chosen, likeliest = probs

    def entry(i, logprob):
        raw = tok.enc.decode_single_token_bytes(i)
        return {"token": raw.decode(errors="replace"), "logprob": logprob, "bytes": list(raw)}
    return {**entry(t, chosen), "top_logprobs": [entry(i, lp) for i, lp in likeliest[:top]]}


def _add_delta(deltas, text, part):
    """Append a step's content text (joined to the content delta before it) or the
    calculator part it closed (whole, a delta of its own) to a choice's deltas."""
    if text and deltas and "content" in deltas[-1]:
        deltas[-1]["content"] += text
    elif text:
        deltas.append({"content": text})
    elif part:
        deltas.append({"parts": [part]})


def _error_body(status, message, code=None):
    error_type = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "nanochat-jax"

    def setup(self):
        self.timeout = self.server.request_timeout  # each read and write: a stall frees it
        super().setup()

    def _send(self, status, ctype, body, headers=()):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status, obj, headers=()):
        self._send(status, "application/json", json.dumps(obj).encode(), headers)

    def _error(self, status, message, code=None, headers=()):
        self._json(status, _error_body(status, message, code), headers)

    def _event(self, obj):
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())

    def _refusal(self, post):
        """Why a request is not served, or None: a Host that does not name this loopback
        server (DNS rebinding), a page of another origin (browsers send its Origin)
        driving the model, a POST body that is not JSON."""
        host = self.headers.get("Host", "")
        origin = self.headers.get("Origin")
        port = self.server.server_address[1]
        ours = rf"(localhost|127\.0\.0\.1|\[::1\])(:{port})?"
        if self.server.loopback and not re.fullmatch(ours, host, re.I):
            return _Reject(421, f"Host {host!r} is not this server: open it as "
                           f"http://127.0.0.1:{port}/")
        foreign = origin is not None and origin.lower() != f"http://{host}".lower()
        if foreign and origin not in self.server.origins:
            return _Reject(403, f"requests from pages of {origin} are refused; to allow "
                           f"them, serve with --allow-origin {origin}")
        if post and self.headers.get_content_type() != "application/json":
            return _Reject(415, "send the body as JSON, with Content-Type: application/json")
        return None

    def do_GET(self):
        path = urllib.parse.urlsplit(self.path).path
        cfg = self.server.engine.cfg
        if refused := self._refusal(post=False):
            self._error(refused.status, str(refused), refused.code)
        elif path == "/":
            self._send(200, "text/html; charset=utf-8", self.server.page)
        elif path == "/v1/models":  # context_length, max_tokens: ours, for the page to fit turns
            model = {"id": self.server.name, "object": "model", "owned_by": "nanochat",
                     "created": self.server.created, "context_length": cfg.sequence_len,
                     "max_tokens": self.server.defaults["max_tokens"]}
            self._json(200, {"object": "list", "data": [model]})
        elif path == "/health":
            self._json(200, {"status": "ok", "model": self.server.name,
                             "compiled": self.server.engine.warmed.is_set()})
        else:
            self._error(404, f"nothing at {path}: the chat is at /, the API at "
                        "/v1/chat/completions and /v1/models")

    def do_POST(self):
        tok = self.server.tok
        cfg = self.server.engine.cfg
        try:
            if refused := self._refusal(post=True):
                raise refused
            # 1. read the body, whose size must be stated and within the limit
            length = self.headers.get("Content-Length", "")
            if not re.fullmatch(r"[0-9]{1,18}", length):  # isdigit() takes '²', int() 5000 digits
                raise _Reject(411, "send a Content-Length header (the body's size in bytes)")
            if int(length) > MAX_BODY:
                if int(length) <= 8 * MAX_BODY:  # read it: the client gets the 413, not a reset
                    self.rfile.read(int(length))
                raise _Reject(413, f"the body is {length} bytes and the limit {MAX_BODY}: send "
                              "fewer or shorter messages")
            body = self.rfile.read(int(length))
            # 2. parse it as a chat completion request
            if urllib.parse.urlsplit(self.path).path != "/v1/chat/completions":
                raise _Reject(404, "POST to /v1/chat/completions")
            defaults = self.server.defaults
            prompt, opts = parse_request(body, cfg, tok, defaults, self.server.name)
        except _Reject as e:
            return self._error(e.status, str(e), e.code)
        self._complete(prompt, opts)

    def _start_stream(self, chunk, n):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self._event(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None} for i in range(n)]))

    def _complete(self, prompt, opts):
        """Generate the completion of one request through the engine, its choices beside
        every other request's, and send it: streamed, or whole."""
        tok = self.server.tok
        n = opts["n"]
        stream = opts["stream"]
        logprobs = opts["logprobs"]
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.server.name}

        def chunk(choices):
            return {**head, "object": "chat.completion.chunk", "choices": choices}
        # 1. the sampling settings, a Reply per choice, and what the stream has sent
        seed = secrets.randbits(32) if opts["seed"] is None else opts["seed"] % 2**32
        sampling = engine.Sampling(max_tokens=opts["max_tokens"],
                                   temperature=opts["temperature"], top_k=opts["top_k"],
                                   top_p=opts["top_p"], seed=seed, logprobs=logprobs)
        replies = [Reply(tok, opts["stop"]) for _ in range(n)]
        tokens = [[] for _ in range(n)]  # each choice's logprobs entries
        sent = [0] * n  # how many of them a stream has sent
        # 2. submit the request: a full waiting line is a 503 that the client retries
        try:
            steps = sample_replies(self.server.engine, tok, prompt, replies, sampling)
        except engine.Busy as e:
            return self._error(503, str(e), headers=[("Retry-After", "1")])
        # 3. a device call's tokens at a time: an event per choice and part, then the end
        try:
            if stream:
                self._start_stream(chunk, n)
            for batch in steps:
                deltas = [[] for _ in range(n)]
                for i, t, text, part, probs in batch:
                    # logprobs cover content tokens: no special token, no calculator
                    in_text = t is not None and replies[i].kind == "text"
                    if logprobs and in_text and t not in tok.special.values():
                        tokens[i].append(_logprobs(tok, t, probs, opts["top_logprobs"]))
                    _add_delta(deltas[i], text, part)
                if stream and logprobs:
                    self._send_deltas(chunk, deltas, tokens, sent)
                elif stream:
                    self._send_deltas(chunk, deltas)
            self._finish(head, chunk, prompt, replies, tokens, opts)
        # 4. what can go wrong on the way: the engine restarted, or the client went away
        except engine.EngineError as e:  # the engine started afresh: this request is lost
            if not stream:
                return self._error(500, str(e))
            self._event(_error_body(500, str(e)))
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            self.log_message("client went away after %d tokens: generation stopped",
                             sum(len(r.ids) for r in replies))
        finally:
            steps.close()  # a request still running frees its slots

    def _send_deltas(self, chunk, deltas, entries=None, sent=None):
        """Each choice's deltas as events; entries: each choice's logprobs entries, the
        sent[i] first of them sent already, the rest going with its next delta."""
        for i, choice in enumerate(deltas):
            for delta in choice:
                lp = {}
                if entries is not None:
                    lp = {"logprobs": {"content": entries[i][sent[i]:]}}
                    sent[i] = len(entries[i])
                self._event(chunk([{"index": i, "delta": delta, **lp, "finish_reason": None}]))

    def _finish(self, head, chunk, prompt, replies, tokens, opts):
        """The end of a completion: the stream's last events, or the whole JSON reply."""
        made = sum(len(r.ids) for r in replies)
        counts = {"prompt_tokens": len(prompt), "completion_tokens": made,
                  "total_tokens": len(prompt) + made}
        # a stream ends: each choice's finish_reason, the usage if asked, [DONE]
        if opts["stream"]:
            self._event(chunk([{"index": i, "delta": {}, "finish_reason": r.finish}
                               for i, r in enumerate(replies)]))
            if opts["usage"]:
                self._event({**head, "object": "chat.completion.chunk", "choices": [],
                             "usage": counts})
            self.wfile.write(b"data: [DONE]\n\n")
            return
        # parts: ours, the reply with its calculator steps, to send back as it is
        choices = []
        for i, r in enumerate(replies):
            message = {"role": "assistant", "content": r.content, "parts": r.parts}
            lp = {"logprobs": {"content": tokens[i]}} if opts["logprobs"] else {}
            choices.append({"index": i, "message": message, **lp, "finish_reason": r.finish})
        self._json(200, {**head, "object": "chat.completion", "usage": counts,
                         "choices": choices})


class _Server(http.server.ThreadingHTTPServer):
    """At most max_connections at once (a 503 beyond them); a client that stalls or goes
    away costs a thread until request_timeout at most, and a log line, not a traceback."""
    daemon_threads = True
    request_queue_size = 128  # a backlog of 5 makes bursts wait for SYN retries

    def process_request(self, request, client_address):
        # over the cap: a raw 503, written before any handler thread is started
        if not self.connections.acquire(blocking=False):
            error = {"message": "too many open connections; try again shortly",
                     "type": "server_error", "param": None, "code": None}
            body = json.dumps({"error": error}).encode()
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: "
                                b"application/json\r\nRetry-After: 1\r\nConnection: close\r\n"
                                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            return self.shutdown_request(request)
        # the thread releases its connection when it ends; one that never started, here
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connections.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release()

    def handle_error(self, request, client_address):
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            name = error.__class__.__name__
            sys.stderr.write(f"{client_address[0]}: {name}, connection closed\n")
        else:
            super().handle_error(request, client_address)


def make_server(eng, tok, host="127.0.0.1", port=8000, name="nanochat", allow_origins=(),
                max_connections=64, request_timeout=30.0, **defaults):
    """The web chat and API server on an engine (chat_engine's) that serve() starts
    (port 0: any free port); defaults: max_tokens (half the context unless given),
    temperature, top_k. Pages of other origins than its own are refused unless listed
    in allow_origins (e.g. "http://localhost:3000")."""
    server = _Server((host, port), _Handler)
    # what the handlers read: the limits, the engine, and who may call
    server.connections = threading.BoundedSemaphore(max_connections)
    server.request_timeout = request_timeout
    server.engine = eng
    server.tok = tok
    server.name = name
    server.loopback = host in ("localhost", "127.0.0.1", "::1")
    server.origins = set(allow_origins)
    server.created = int(time.time())
    # the web chat: one page, no dependencies
    page = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui.html")
    with open(page, "rb") as f:
        server.page = f.read()
    server.defaults = {"max_tokens": eng.cfg.sequence_len // 2, "temperature": 0.6,
                       "top_k": 50, **defaults}
    return server

# ------------------------------------------------------------------------- command line


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's layout and shows every flag's default."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    a = p.add_argument
    # the model: ours, or a PyTorch nanochat run read without torch
    a("--checkpoint", default="checkpoints", help="ours: a step directory, a stage folder "
      "(checkpoints/sft) or a root (its newest RL, SFT or base step)")
    a("--nanochat-checkpoint", metavar="DIR", help="a PyTorch nanochat run: its "
      "model_<step>.pt directory or its NANOCHAT_BASE_DIR")
    # the terminal chat and its sampling (the server's defaults too)
    a("-p", "--prompt", help="reply to this one message and exit")
    a("-t", "--temperature", type=float, default=0.6, help="0 is greedy")
    a("-k", "--top-k", type=int, default=50, help="sample among the k likeliest tokens (0: all)")
    a("-m", "--max-tokens", type=int, default=None, help="most tokens per reply (default: half "
      "the model's context)")
    a("--seed", type=int, default=42, help="terminal sampling seed (the server draws its own)")
    # the server
    a("--serve", action="store_true", help="serve the web chat and the OpenAI-compatible API")
    a("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    a("--port", type=int, default=8000, help="port to serve on")
    a("--allow-origin", nargs="*", default=[], help="other pages' origins allowed to use the API")
    a("--slots", type=int, default=16, help="server: requests generated at once (more "
      "wait in line, up to 4 per slot, then a 503)")
    a("--pages", type=int, help="server: pages (32 tokens each at most contexts) of the KV "
      "cache's layers over the whole context, shared by the slots; requests wait for them as "
      "for slots (default: every slot the whole context)")
    a("--kv-cache", choices=["int8"], help="an int8 KV cache, a scale a token and head: about "
      "half a bf16 cache's bytes, not exact (none: the compute dtype's, exact)")
    a("--compile-cache", default=os.path.expanduser("~/.cache/nanochat_jax/xla"),
      help="persistent XLA compilation cache ('' to disable)")
    return p.parse_args(argv)


def serve(eng, tok, host="127.0.0.1", port=8000, allow_origins=(), **defaults):
    """The web chat and API on an engine until Ctrl+C, the engine compiling its programs
    in the background first (/health says when); defaults: make_server's."""
    try:
        server = make_server(eng, tok, host, port, allow_origins=allow_origins, **defaults)
    except (OSError, OverflowError) as e:  # the port is taken, the host unknown, ...
        sys.exit(f"error: cannot serve on {host}:{port} ({e}): choose another --host or --port")
    url = f"http://{host}:{server.server_address[1]}"
    print(f"chat at {url}/ ; OpenAI-compatible API at {url}/v1 (model 'nanochat'); "
          "Ctrl+C stops")
    # the engine thread waits for the GIL after each device call while handlers hold it:
    # let them hand it over sooner than Python's default 5 ms
    sys.setswitchinterval(0.001)
    eng.start(warm_up=True)
    server.serve_forever()


def main(argv=None):
    args = parse_args(argv)
    # 1. flags out of range: one line that says what to pass, before any model is loaded
    too_few = args.max_tokens is not None and args.max_tokens < 1
    if args.temperature < 0 or not 0 <= args.top_k <= engine.TOP_K_MAX or too_few:
        sys.exit(f"error: -t must be 0 or more, -k from 0 to {engine.TOP_K_MAX}, -m 1 or more")
    if args.slots < 1:
        sys.exit("error: --slots must be 1 or more")
    runtime.use_compile_cache(args.compile_cache)  # compiled programs serve the next chat
    sys.stdout.reconfigure(errors="replace")  # a terminal that cannot show a character: '?'
    # 2. the model: a checkpoint that cannot be read is one line, not a traceback
    try:
        if args.nanochat_checkpoint:
            params, cfg, tok = checkpoint.load_nanochat(args.nanochat_checkpoint)
        else:
            params, cfg, tok = checkpoint.load_model(args.checkpoint)
    except (OSError, ValueError, KeyError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        sys.exit(f"error: {e}")
    params = engine.prepare(params, cfg)  # the weights on the device once, as the engine's
    if args.max_tokens is None:
        args.max_tokens = cfg.sequence_len // 2
    # 3. the engine: the server's slots, and a line of 4 per slot waiting for one (slots
    # that do not fit the device are one line)
    try:
        if args.serve:
            eng = chat_engine(params, cfg, tok, slots=args.slots, waiting=4 * args.slots,
                              kv_cache=args.kv_cache, pages=args.pages)
        else:
            eng = chat_engine(params, cfg, tok, slots=1, kv_cache=args.kv_cache)
    except ValueError as e:
        sys.exit(f"error: {e} ({'--pages' if args.pages else '--slots'})")
    # 4. serve many people at once, or chat with one in the terminal
    try:
        if args.serve:
            serve(eng, tok, args.host, args.port, args.allow_origin,
                  max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k)
        else:
            eng.start()
            chat_cli(eng, tok, prompt=args.prompt, max_tokens=args.max_tokens,
                     temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    except KeyboardInterrupt:  # Ctrl+C ends the chat or the server: no traceback
        print()
    finally:
        eng.stop()  # its thread out of the device before the process exits


if __name__ == "__main__":
    main()
