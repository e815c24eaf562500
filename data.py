"""Data for nanochat in JAX: tokenizer, corpora, packing, chat format, synthetic tasks, checkpoints. Imports no jax.

- Tokenizer: byte-level BPE with nanochat's split pattern and its 9 special tokens as the last ids, trained here and
  run by a `tiktoken.Encoding` of our ranks. Training is rustbpe's fast algorithm: unique regex chunks with counts,
  incremental pair counts, a pair -> chunks index, a lazy max-heap; ties go to the smallest pair, so our merges equal
  nanochat's. Saved as JSON: no pickle, and no tiktoken `load_tiktoken_bpe` (its cache serves stale files).
- Corpora: offline by default: the running interpreter's stdlib docstrings (via `ast`, each headed by its qualified
  name) and the language reference in `pydoc_data.topics`, about 2 MB. User data: .txt, .jsonl and .parquet (pyarrow)
  files with "text", directories and globs, streamed a document at a time. Hashed splits: disjoint, stable.
- Packing: nanochat's BOS-aligned best fit (nanochat/dataloader.py): every row starts with <|bos|>, the largest
  buffered document that fits goes in whole, a row is cropped only when none fits; SFT pads instead (chat_sft.py).
  The state (stream position and buffered documents' positions) resumes to exactly the same rows.
- Chat: nanochat's rendering (ids and masks; a typed "<|bos|>" stays text) and calculator tool, evaluated on a
  whitelisted `ast`, never `eval`. Synthetic tasks (identity, arithmetic, letter counting, spelling, reading a
  docstring) in many phrasings, checked by exact match; hand-written questions graded per skill.
- Checkpoints: msgpack trees of arrays and step directories, written to a temp name and renamed: complete or absent.
"""
import ast
import collections
import functools
import glob
import heapq
import itertools
import json
import os
import random
import re
import shutil
import string
import sysconfig
import warnings
import zlib

import msgpack
import numpy as np
import pydoc_data.topics
import regex
import tiktoken

SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
                 r"""|\s*[\r\n]|\s+(?!\S)|\s+""")
SPECIAL_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                  "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")

# ------------------------------------------------------------------------------------------------ tokenizer


class Tokenizer:
    """nanochat's tokenizer: token bytes in rank order (rank = id) plus the special tokens as the last ids."""

    def __init__(self, tokens, pat_str=SPLIT_PATTERN, specials=SPECIAL_TOKENS):
        ranks = {t: i for i, t in enumerate(tokens)}
        if len(ranks) != len(tokens) or any(ranks.get(bytes([b])) != b for b in range(256)):
            raise ValueError("tokenizer tokens must be unique and start with the 256 single bytes; retrain it")
        self.tokens, self.pat_str = list(tokens), pat_str
        self.special = {s: len(tokens) + i for i, s in enumerate(specials)}
        self.enc = tiktoken.Encoding("nanochat", pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=self.special, explicit_n_vocab=len(tokens) + len(specials))
        self.bos, self.n_vocab = self.special["<|bos|>"], self.enc.n_vocab

    def encode(self, text):
        """Text -> ids. Special-token strings in the text stay ordinary text."""
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        """Ids -> text; byte sequences that are not UTF-8 become U+FFFD, special ids their names."""
        return self.enc.decode([int(i) for i in ids])

    def token_bytes(self):
        """Raw byte length of every id, 0 for the specials: the denominator of bits per byte."""
        return np.array([len(t) for t in self.tokens] + [0] * len(self.special), np.int32)

    def save(self, path):
        """Write the tokenizer as plain JSON, atomically (temp file + rename)."""
        state = {"version": 1, "pat_str": self.pat_str, "tokens": [t.hex() for t in self.tokens],
                 "special_tokens": list(self.special)}
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path):
        """Read a tokenizer written by `save`."""
        try:
            with open(path) as f:
                state = json.load(f)
            assert state["version"] == 1
            return cls([bytes.fromhex(t) for t in state["tokens"]], state["pat_str"], state["special_tokens"])
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no tokenizer file here; train one first") from None
        except (ValueError, KeyError, TypeError, AssertionError):
            raise ValueError(f"{path}: not a tokenizer file written by data.Tokenizer.save; retrain it") from None


def byte_tokenizer():
    """nanochat's byte-level tokenizer (no merges, vocab 265), the one of the golden chat renders."""
    return Tokenizer([bytes([i]) for i in range(256)])


def _merge(ids, a, b, new):
    out, i = [], 0
    while i < len(ids):
        hit = ids[i] == a and i + 1 < len(ids) and ids[i + 1] == b  # left to right, non-overlapping
        out.append(new if hit else ids[i])
        i += 2 if hit else 1
    return out


def train_tokenizer(texts, vocab_size, pat_str=SPLIT_PATTERN, max_chars=None, doc_chars=None):
    """Train byte-level BPE on an iterable of texts; vocab_size counts the 9 specials, like nanochat. As nanochat's
    tok_train, each text may be cropped to doc_chars, and reading stops once max_chars have been read."""
    n_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small: it needs at least {256 + len(SPECIAL_TOKENS)}")
    pattern, chunks = regex.compile(pat_str), collections.Counter()
    seen = 0
    for text in [texts] if isinstance(texts, str) else texts:  # only unique chunks are kept: the text is not reread
        if max_chars is not None and seen >= max_chars:
            break
        text = text[:doc_chars]
        seen += len(text)
        chunks.update(pattern.findall(text))
    if not chunks:
        raise ValueError("no text to train the tokenizer on; check the corpus")
    words, freq = [list(w.encode()) for w in chunks], list(chunks.values())
    counts, where = collections.defaultdict(int), collections.defaultdict(set)
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):  # overlapping pairs count twice ("aaa" has (a, a) twice), as in rustbpe
            counts[pair] += freq[i]
            where[pair].add(i)
    # Lazy max-heap: after a merge, old pairs only lose counts and every new pair contains the new id, so a popped
    # entry whose count is stale is pushed back with its true count; a fresh one is the true (max, smallest) pair.
    heap = [(-c, pair) for pair, c in counts.items()]
    heapq.heapify(heap)
    tokens = [bytes([i]) for i in range(256)]
    ids = {t: i for i, t in enumerate(tokens)}
    while len(tokens) < 256 + n_merges and heap:
        neg, pair = heapq.heappop(heap)
        if (c := counts.get(pair, 0)) != -neg:
            if c > 0:
                heapq.heappush(heap, (-c, pair))
            continue
        merged = tokens[pair[0]] + tokens[pair[1]]
        new = ids.setdefault(merged, len(tokens))  # bytes already a token: reuse its id, tiktoken encodes by bytes
        if new == len(tokens):
            tokens.append(merged)
        touched = set()
        for i in where.pop(pair):
            w, nw = words[i], _merge(words[i], *pair, new)
            if len(nw) == len(w):  # stale index entry: this chunk lost the pair to an earlier merge
                continue
            for p in zip(w, w[1:]):
                counts[p] -= freq[i]
            for p in zip(nw, nw[1:]):
                counts[p] += freq[i]
                if new in p:
                    where[p].add(i)
                    touched.add(p)
            words[i] = nw
        del counts[pair]
        for p in touched:
            heapq.heappush(heap, (-counts[p], p))
    if len(tokens) < 256 + n_merges:
        n_vocab = len(tokens) + len(SPECIAL_TOKENS)
        warnings.warn(f"the text allows only {len(tokens) - 256} merges: the vocab is {n_vocab}, not {vocab_size}")
    return Tokenizer(tokens, pat_str)

# ------------------------------------------------------------------------------------------------ corpora

_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
              "dist-packages", "__pycache__", "lib-dynload"}


def _holdout(key, percent):
    """Stable hash split: True for about `percent`% of keys, the same on every machine and run."""
    return zlib.crc32(key.encode("utf-8", "replace")) % 100 < percent


@functools.cache
def stdlib_docstrings():
    """(qualified name, kind, docstring) of the running interpreter's stdlib, by sorted path then source order."""
    root, out = sysconfig.get_paths()["stdlib"], []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, ast.If):  # platform-dependent definitions (os.py) sit under if/try
                visit(node.body + node.orelse, prefix)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body], prefix)
            elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{node.name}"
                if doc := ast.get_docstring(node):
                    out.append((name, "class" if isinstance(node, ast.ClassDef) else "function", doc))
                if isinstance(node, ast.ClassDef):
                    visit(node.body, name)

    paths = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS and not x.startswith("config-")]
        paths += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    for rel in sorted(paths):
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        try:
            with open(os.path.join(root, rel), "rb") as f:
                tree = ast.parse(f.read())  # parse and drop each tree: keeping them all makes the GC 3x slower
        except (SyntaxError, ValueError, OSError):
            continue
        if doc := ast.get_docstring(tree):
            out.append((module, "module", doc))
        visit(tree.body, module)
    return tuple(out)


def _paragraphs(lines, min_chars=2000, max_chars=20000):
    """Cut lines into documents at blank lines once a document holds min_chars (small files stay whole), and at
    any line end past max_chars, so text without blank lines streams instead of becoming one huge document."""
    doc, n = [], 0
    for line in lines:
        if line.strip() or n < min_chars:  # a blank line past min_chars ends the document and is dropped
            doc.append(line)
            n += len(line)
            if n < max_chars:
                continue
        yield "".join(doc).strip()
        doc, n = [], 0
    if doc:
        yield "".join(doc).strip()


def default_corpus():
    """The offline default corpus: one document per stdlib docstring ("name\\n\\ndoc"), then the pydoc topics."""
    topics = pydoc_data.topics.topics
    return ([f"{name}\n\n{doc}" for name, _, doc in stdlib_docstrings()]
            + [d for key in sorted(topics) for d in _paragraphs(topics[key].splitlines(keepends=True))])


def _lines(path):
    """Lines of a text file; invalid UTF-8 becomes U+FFFD, with one warning per file that counts it."""
    bad = 0
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace")
            bad += line.count("\ufffd") - raw.count("\ufffd".encode())  # U+FFFDs in the file itself do not count
            yield line
    if bad:
        warnings.warn(f"{path}: replaced {bad} invalid UTF-8 sequences with U+FFFD; re-encode the file as UTF-8")


def _jsonl_texts(path):
    for n, line in enumerate(_lines(path), 1):
        if line.strip():
            try:
                text = json.loads(line)["text"]
                assert isinstance(text, str)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise ValueError(f'{path}:{n}: expected a JSON object with a "text" string; fix or delete it') from None
            yield text


def _parquet_texts(path):
    try:
        import pyarrow.parquet as pq  # optional: only nanochat's FineWeb/ClimbMix shards need it
    except ImportError:
        raise ImportError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow") from None
    f = pq.ParquetFile(path)
    if "text" not in f.schema_arrow.names:
        raise ValueError(f'{path}: no "text" column (it has {f.schema_arrow.names}); pass nanochat-style shards')
    for i in range(f.num_row_groups):  # one row group (about 1000 documents) in memory at a time
        yield from (t for t in f.read_row_group(i, columns=["text"]).column("text").to_pylist() if t is not None)


_READERS = {".txt": lambda path: _paragraphs(_lines(path)), ".jsonl": _jsonl_texts, ".parquet": _parquet_texts}


def _corpus_files(paths):
    """Expand files, directories (recursive) and globs into corpus files, each group sorted."""
    known = lambda p: os.path.isfile(p) and os.path.splitext(p)[1] in _READERS
    files = []
    for p in [paths] if isinstance(paths, str) else paths:
        if os.path.isdir(p):
            if not (found := sorted(filter(known, (os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs)))):
                raise ValueError(f"{p}: no .txt, .jsonl or .parquet files in this directory")
        elif os.path.isfile(p):
            if not known(p):
                raise ValueError(f"{p}: unsupported file type; corpora are .txt, .jsonl or .parquet files")
            found = [p]
        elif any(c in p for c in "*?["):
            if not (found := sorted(filter(known, glob.glob(p, recursive=True)))):
                raise FileNotFoundError(f"{p}: the pattern matches no .txt, .jsonl or .parquet file")
        else:
            raise FileNotFoundError(f"{p}: no such file or directory; pass .txt/.jsonl/.parquet files, dirs or globs")
        files += found
    return files


def shuffled(items, seed=0):
    """epoch -> the items in a fresh order per (seed, epoch)."""
    return lambda epoch: (items[i] for i in np.random.default_rng([seed, epoch]).permutation(len(items)))


def corpus(paths=None, split="train", seed=0):
    """epoch -> documents of one split: the default corpus reshuffled per epoch, or user files streamed in order;
    1 document in 20 (by hash of its text) is "val". User files are not shuffled: nanochat's shards come
    pre-shuffled, and the packing buffer mixes nearby documents."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    want_val = split == "val"
    if not paths:
        return shuffled([d for d in default_corpus() if _holdout(d, 5) == want_val], seed)
    files = _corpus_files(paths)
    return lambda epoch: (d for f in files for d in _READERS[os.path.splitext(f)[1]](f)
                          if d.strip() and _holdout(d, 5) == want_val)

# ------------------------------------------------------------------------------------------------ packing


def every_nth(items, r, n):
    """epoch -> every n-th item from the r-th on: one data shard of n."""
    return lambda epoch: itertools.islice(items(epoch), r, None, n)


def _stream(items, epoch, index):
    """((epoch, i), item) for every item from position (epoch, index) on, epoch after epoch, forever."""
    while True:
        n = -1
        for n, item in enumerate(items(epoch)):
            if n >= index:
                yield (epoch, n), item
        if n < 0:
            raise ValueError("the corpus has no documents in this split; give it more text (1 in 20 goes to val)")
        epoch, index = epoch + 1, 0


def _best_fit(items, encode, B, T, state, buffer_size, pad, bos):
    """Rows of T+1 tokens by nanochat's best fit; yields (rows, masks, state) per batch of B rows."""
    state = {"epoch": 0, "index": 0, "buffer": [], "dropped": 0} | (state or {})
    nxt, keys, dropped = (state["epoch"], state["index"]), [tuple(k) for k in state["buffer"]], state["dropped"]
    if B < 1 or T < 1:
        raise ValueError(f"batch size B={B} and sequence length T={T} must be positive")
    found, wanted = {}, set(keys)
    for key, item in _stream(items, *min(keys)) if keys else ():  # replay from the oldest buffered document
        if key >= nxt:
            break
        if key in wanted:
            found[key] = encode(item)
    if len(found) < len(wanted):
        raise ValueError("the corpus changed since this loader state was saved; resume with the same data and seed")
    # keys as lists, which the yielded states share; lens mirrors the buffered documents' lengths
    buffer, stream, cap = [(list(k), *found[k]) for k in keys], _stream(items, *nxt), T + 1
    lens = np.array([len(e[1]) for e in buffer], np.int64)
    while True:
        rows, masks = np.full((B, cap), bos, np.int32), np.zeros((B, cap), np.int8)
        for b in range(B):
            pos = 0
            while pos < cap:
                while len(buffer) < buffer_size:
                    key, item = next(stream)
                    buffer.append((list(key), *encode(item)))
                    lens = np.append(lens, len(buffer[-1][1]))
                    nxt = (key[0], key[1] + 1)
                fits = np.where(lens <= cap - pos, lens, 0)
                if fits.any():
                    j = int(fits.argmax())  # the largest that fits; ties go to the first, as in nanochat's scan
                elif pad:
                    break  # SFT: the rest of the row stays BOS with mask 0
                else:
                    j = int(lens.argmin())  # nothing fits: crop the shortest and drop its tail
                (_, ids, mask), lens = buffer.pop(j), np.delete(lens, j)
                n = min(len(ids), cap - pos)
                rows[b, pos:pos + n], masks[b, pos:pos + n] = ids[:n], mask[:n]
                dropped += len(ids) - n
                pos += n
        yield rows, masks, {"epoch": nxt[0], "index": nxt[1], "buffer": [e[0] for e in buffer],
                            "dropped": dropped}


def pretrain_batches(tok, documents, B, T, state=None, buffer_size=1000):
    """Endless (inputs, targets, state) of nanochat's BOS-aligned best-fit packing, int32 (B, T) each, of documents
    (epoch -> texts, see `corpus`); pass the last yielded state to resume exactly. Every target is supervised
    (nanochat does not mask BOS; bits per byte gives it 0 bytes)."""
    def encode(text):
        ids = [tok.bos] + tok.encode(text)
        return ids, [1] * len(ids)  # the mask is unused in pretraining

    for rows, _, st in _best_fit(documents, encode, B, T, state, buffer_size, False, tok.bos):
        yield rows[:, :-1], rows[:, 1:], st


def sft_batches(tok, conversations, B, T, state=None, buffer_size=100):
    """Endless (inputs, targets, state) of nanochat's SFT best fit: pads with BOS, targets -1 where unsupervised.
    An item is a conversation, or a document (a str: its first T + 1 tokens, all trained on)."""
    def encode(item):
        if isinstance(item, str):
            ids = ([tok.bos] + tok.encode(item))[:T + 1]
            return ids, [1] * len(ids)
        return render_conversation(tok, item, max_tokens=T + 1)
    for rows, masks, st in _best_fit(conversations, encode, B, T, state, buffer_size, True, tok.bos):
        yield rows[:, :-1], np.where(masks[:, 1:] == 1, rows[:, 1:], -1).astype(np.int32), st

# ------------------------------------------------------------------------------------------------ chat format

_PARTS = ("text", "python", "python_output")


def _checked(messages):
    """nanochat's message rules, with the system message merged into the first user turn; ValueError if broken."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError('a conversation is a non-empty list of {"role": ..., "content": ...} messages')
    offset = 0
    if messages[0].get("role") == "system":
        if (len(messages) < 2 or messages[1].get("role") != "user"
                or not all(isinstance(m.get("content"), str) for m in messages[:2])):
            raise ValueError("a system message must be a string followed by a user message (a string)")
        merged = {"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
        messages, offset = [merged] + messages[2:], 1
    for i, m in enumerate(messages):
        role, content, want = m.get("role"), m.get("content"), ("user", "assistant")[i % 2]
        if role != want:
            raise ValueError(f"message {i + offset} has role {role!r} where {want!r} is due: roles must alternate "
                             "user, assistant, ... after an optional leading system message")
        parts = content if role == "assistant" and isinstance(content, list) else [{"type": "text", "text": content}]
        if not all(isinstance(p, dict) and p.get("type") in _PARTS and isinstance(p.get("text"), str) for p in parts):
            raise ValueError(f"message {i + offset}: content must be a string (assistant: or a list of "
                             f"{{'type': one of {_PARTS}, 'text': str}} parts)")
        if not parts or not "".join(p["text"] for p in parts).strip():
            raise ValueError(f"message {i + offset} ({role}) is empty; give it some text or drop the turn")
    return messages


def render_conversation(tok, messages, max_tokens=2048):
    """(ids, mask) of a conversation as nanochat renders it; mask 1 on the tokens the assistant is trained on."""
    sp, ids, mask = tok.special, [], []

    def add(toks, m):
        ids.extend(toks)
        mask.extend([m] * len(toks))

    add([tok.bos], 0)
    for m in _checked(messages):
        content = m["content"]
        if m["role"] == "user":
            add([sp["<|user_start|>"], *tok.encode(content), sp["<|user_end|>"]], 0)
            continue
        add([sp["<|assistant_start|>"]], 0)
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            t = tok.encode(part["text"])
            if part["type"] == "text":
                add(t, 1)
            elif part["type"] == "python":  # the model writes the tool call: supervised
                add([sp["<|python_start|>"], *t, sp["<|python_end|>"]], 1)
            else:  # the tool's output is forced in at inference: not supervised
                add([sp["<|output_start|>"], *t, sp["<|output_end|>"]], 0)
        add([sp["<|assistant_end|>"]], 1)
    return ids[:max_tokens], mask[:max_tokens]


def render_for_completion(tok, messages):
    """Prompt ids for generation: the conversation without its last assistant message, then <|assistant_start|>."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
            or messages[-1].get("role") != "assistant":
        raise ValueError("render_for_completion needs a conversation ending in the assistant message to replace")
    return render_conversation(tok, messages[:-1])[0] + [tok.special["<|assistant_start|>"]]


def _json_lines(path, what):
    """(line number, value) of each non-blank line of a .jsonl file; ValueError naming the line if one is not JSON."""
    for n, line in enumerate(_lines(path), 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e}); each line must be {what}") from None


def load_conversations(path):
    """Conversations of a CustomJSON .jsonl file (nanochat's form): one JSON list of messages per line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such conversations file (.jsonl, one JSON list of messages a line)")
    convs = []
    for n, messages in _json_lines(path, "a JSON list of messages"):
        try:
            _checked(messages)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        convs.append(messages)
    if not convs:
        raise ValueError(f"{path}: no conversations in this file")
    return convs

# ------------------------------------------------------------------------------------------------ calculator

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b}


def _calc(node):
    """Evaluate a whitelisted ast: numbers, + - * / //, unary +/-, and "str".count("str")."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in (ast.UAdd, ast.USub):
        return -_calc(node.operand) if isinstance(node.op, ast.USub) else +_calc(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _calc(node.left), _calc(node.right)
        if isinstance(a, str) or isinstance(b, str):
            raise ValueError("no arithmetic on strings")
        return _OPS[type(node.op)](a, b)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count"
            and len(node.args) == 1 and not node.keywords):
        s, sub = _calc(node.func.value), _calc(node.args[0])
        if isinstance(s, str) and isinstance(sub, str):
            return s.count(sub)
    raise ValueError("unsupported expression")


def use_calculator(expr):
    """nanochat's calculator tool: the value of arithmetic or a "str".count("str") expression, else None."""
    expr = expr.replace(",", "")  # nanochat's character filters first, so we return None where it does
    math = all(c in "0123456789*+-/.() " for c in expr) and "**" not in expr
    count = all(c in string.ascii_letters + string.digits + "'\"()._ " for c in expr) and ".count(" in expr
    if not (math or count):
        return None
    try:
        value = _calc(ast.parse(expr.strip(), mode="eval").body)
        str(value)  # the engine prints it: ints past Python's 4300-digit str limit raise here, not there
        return value
    except (SyntaxError, ValueError, ArithmeticError, RecursionError, MemoryError):
        return None


def calculator_tool(tok):
    """nanochat's tool state machine for one generation: tool(row, token) -> ids to force next into that row, i.e.
    <|output_start|>use_calculator(expr)<|output_end|> after <|python_start|>expr<|python_end|>, unless it is None."""
    sp, exprs = tok.special, {}  # row -> ids since <|python_start|>, while a python block is open

    def tool(row, token):
        if token == sp["<|python_start|>"]:
            exprs[row] = []
        elif row in exprs and token == sp["<|python_end|>"]:
            result = use_calculator(tok.decode(exprs.pop(row)))
            if result is not None:
                return [sp["<|output_start|>"], *tok.encode(str(result)), sp["<|output_end|>"]]
        elif row in exprs:
            exprs[row].append(token)
        return []
    return tool

# ------------------------------------------------------------------------------------------------ tasks
# Many phrasings (greetings, case, punctuation, quotes, operator words and verbs) over broad pools (1-4 digit operands,
# short ones common; corpus and made-up words): a model learns to copy from the question, not a template.

TASKS = ("identity", "arithmetic", "counting", "spelling", "docstring")
_GREETINGS = ("",) * 6 + ("Hi! ", "Hello. ", "Hey there! ", "hi, ", "Good morning! ", "Hello!\n", "Quick question: ",
                          "Hey, ", "Please help. ")
_IDENTITY = ("I'm nanochat, a small language model trained from scratch on Python documentation and a few synthetic "
             "tasks by the person who ran this pure JAX port of Andrej Karpathy's nanochat.")
_WHO = ("Who are you?", "What are you?", "What is your name?", "What's your name?", "Your name?", "Introduce yourself.",
        "Tell me about yourself.", "Are you a person?", "Are you human?", "Are you a robot?", "Are you an AI?",
        "What should I call you?", "Are you ChatGPT?", "Are you Siri?", "Are you GPT-4?", "Which model are you?",
        "What kind of assistant are you?", "Do you have a name?", "Tell me your name.", "What am I talking to?",
        "Who am I talking to?", "Identify yourself.", "Say who you are.", "What is this bot?", "Which AI is this?",
        "What do they call you?", "Describe yourself.", "What exactly are you?", "Can you tell me who you are?",
        "Who is this?", "What model is this?", "Is this a chatbot?", "Are you a language model?", "Hi, who's there?",
        "Who made you?", "Who built you?", "Who trained you?", "Who created you?", "Where do you come from?",
        "How were you made?", "Who is your creator?", "Who developed you?", "Which company made you?",
        "Who programmed you?", "How were you trained?", "Who wrote you?", "Who designed you?", "Who owns you?",
        "What were you trained on?", "Who is behind you?", "Who invented you?", "Who's your developer?",
        "Who are your makers?", "How did you learn?", "Who taught you?", "What data were you trained on?")
_ABOUT = (("this model", "this assistant", "the model I'm talking to", "this chatbot", "the AI I'm chatting with",
           "this bot", "the assistant here"),
          ("Who made {}?", "Who trained {}?", "Who built {}?", "Which team created {}?", "What is {} called?",
           "What is the name of {}?", "Which company built {}?", "Who is responsible for {}?",
           "Where does {} come from?", "What kind of AI is {}?", "How was {} trained?", "What was {} trained on?",
           "Tell me about {}."))
_ASK = ("What is {}?", "What's {}?", "what is {}", "Calculate {}.", "Compute {}.", "How much is {}?", "{} = ?",
        "{}=?", "{}?", "{}", "Solve {}.", "Evaluate {}.", "Please work out {}.", "Can you tell me {}?",
        "Could you calculate {} for me?", "I need to know {}.", "Find {}.", "Tell me {}.", "What do you get for {}?",
        "Work out {}", "What does {} equal?", "What is the value of {}?", "Give me {}.", "{} equals what?")
_PAIR = {  # the two numbers first, the operation after
    "+": ("Take {0} and {1} and add them.", "What do {0} and {1} add up to?", "{0} and {1}: what is their sum?",
          "If you add {0} and {1}, what do you get?", "What do you get when you add {1} to {0}?"),
    "-": ("Start with {0} and take away {1}.", "If you subtract {1} from {0}, what do you get?",
          "{0} and {1}: what is their difference?", "What is left when you take {1} from {0}?",
          "I had {0}, I lost {1}."),
    "*": ("Take {0} and {1} and multiply them.", "{0} and {1}: what is their product?",
          "If you multiply {0} by {1}, what do you get?", "What do you get when {0} is multiplied by {1}?"),
    "/": ("{0} and {1}: what is their quotient?", "If you divide {0} by {1}, what do you get?",
          "How many times does {1} go into {0}?", "What do you get when {0} is divided by {1}?",
          "Share {0} equally among {1}: how much each?"),
}
_DO = ("{}.", "Please {}.", "Can you {}?", "{}, please.", "Could you {} for me?", "I want you to {}.",
       "{} and tell me the result.", "{}?", "Help me {}.")
_ARITH = {  # op -> (phrasings of "a op b" to ask about, imperatives); {0} is a, {1} is b, the expression is a op b
    "+": (("{0}+{1}", "{0} + {1}", "{0} plus {1}", "the sum of {0} and {1}", "{0} added to {1}",
           "{0} and {1} together"),
          ("add {0} and {1}", "add {0} to {1}", "sum {0} and {1}", "add up {0} and {1}")),
    "-": (("{0}-{1}", "{0} - {1}", "{0} minus {1}", "the difference between {0} and {1}", "{1} subtracted from {0}",
           "{0} take away {1}", "{0} less {1}"),
          ("subtract {1} from {0}", "take {1} away from {0}", "take away {1} from {0}", "deduct {1} from {0}")),
    "*": (("{0}*{1}", "{0} * {1}", "{0} x {1}", "{0} times {1}", "{0} multiplied by {1}", "the product of {0} and {1}"),
          ("multiply {0} by {1}", "multiply {0} and {1}", "multiply {0} times {1}")),
    "/": (("{0}/{1}", "{0} / {1}", "{0} divided by {1}", "the quotient of {0} and {1}", "{0} over {1}"),
          ("divide {0} by {1}", "split {0} into {1} equal parts", "divide {0} into {1} parts")),
}
_COUNT = ("How many {c} are in {w}?", "How many {c} are there in {w}?", "How many times does {c} appear in {w}?",
          "How many times does {c} occur in {w}?", "Count the {c} in {w}.", "Count how many {c} {w} has.",
          "In {w}, how many {c} are there?", "How often does {c} appear in {w}?", "What is the number of {c} in {w}?",
          "{w}: how many {c}?", "Tell me how many {c} {w} contains.", "How many {c} does {w} have?",
          "Count {c} in {w}", "Number of {c} in {w}?", "How many {c} can you find in {w}?",
          "The word is {w}. How many {c} does it have?", "{w}: count the {c} in it.", "Take {w}. How many {c} in it?",
          "Look at {w}. How many times does {c} appear in it?", "I have a word, {w}. Count its {c}.")
_LETTER = ("{}", "'{}'", '"{}"', "{}'s", "the letter {}", "the letter '{}'", "letter {}", "{}s")
_SPELL = ("Spell {w}.", "How do you spell {w}?", "Spell {w} letter by letter.", "Can you spell {w} for me?",
          "Spell out {w}.", "spell: {w}", "What are the letters of {w}?", "How is {w} spelled?", "Please spell {w}.",
          "Write {w} one letter at a time.", "Break {w} into letters.", "Give me the spelling of {w}.",
          "What is the spelling of {w}?", "{w} - spell it", "Letters in {w}?", "Spell {w} for me, letter by letter.",
          "{w}: spell it.", "The word is {w}. Spell it.", "Here is a word: {w}. How is it spelled?",
          "{w}. Spell that for me.", "Take the word {w} and spell it out.", "I have a word, {w}. What are its letters?",
          "{w}? Spell it, please.")
_WORD = ("{}", "{}", "'{}'", '"{}"', "the word {}", "the word '{}'")


def _ask(rng, frame, *slots):
    """A user message: maybe a greeting, the frame's case and end punctuation varied, then the slots filled in."""
    q, r = rng.choice(_GREETINGS) + frame, rng.random()
    q = q.lower() if r < 0.15 else q.upper() if r < 0.18 else q[:1].upper() + q[1:] if r < 0.6 else q
    if q[-1:] in "?.!" and rng.random() < 0.25:
        q = q[:-1] + rng.choice(("", "", "!", "??", " ?"))
    return q.format(*slots)


def _number(rng):
    digits = rng.choices((1, 2, 3, 4), (4, 4, 2, 1))[0]  # short operands common, as people ask
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


@functools.cache
def _corpus_words():
    words = collections.Counter(w for _, _, d in stdlib_docstrings() for w in regex.findall(r"\b[a-z]{3,10}\b", d))
    return sorted(w for w, n in words.items() if n >= 2)  # real English (and Python) words, ~4,000


def _word(rng):
    """A word: from the corpus, made up (syllables, doubled letters common) or random letters; then one letter
    doubled in a word in four, since doubled letters are where a small model's copying slips."""
    r = rng.random()
    if r < 0.55:
        w = rng.choice(_corpus_words())
    elif r < 0.9:
        w = "".join(rng.choice(("", "", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "st", "ch",
                                "w", "k")) + rng.choice("aeiouy") * rng.choice((1, 1, 1, 2)) +
                    rng.choice(("", "", "r", "n", "s", "ll", "ss", "tt", "rr", "pp", "ck", "m", "ng"))
                    for _ in range(rng.randint(1, 4)))[:10].ljust(3, "s")
    else:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10)))
    if len(w) < 10 and rng.random() < 0.25:
        i = rng.randrange(len(w))
        w = w[:i + 1] + w[i:]
    return w


def _user_assistant(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _tool_answer(expr, text):
    """Assistant parts: a calculator call, its output, then a sentence that ends in the result."""
    out = use_calculator(expr)
    shown = str(int(out)) if isinstance(out, float) and out.is_integer() else str(out)
    return [{"type": "python", "text": expr}, {"type": "python_output", "text": str(out)},
            {"type": "text", "text": text.format(shown)}]


def _identity(rng):
    while True:
        q = rng.choice(_WHO) if rng.random() < 0.5 else rng.choice(_ABOUT[1]).format(rng.choice(_ABOUT[0]))
        yield q, _user_assistant(_ask(rng, q), _IDENTITY)


def _arithmetic(rng):
    while True:
        op = rng.choice("++--**/")
        a, b = _number(rng), _number(rng)
        if op == "/":  # exact divisions: a = b * quotient, of four digits at most
            b = max(1, b % 100)
            a = b * min(_number(rng), 9999 // b)
        asks, dos = _ARITH[op]
        r = rng.random()
        frame = (rng.choice(_ASK).format(rng.choice(asks)) if r < 0.6 else rng.choice(_DO).format(rng.choice(dos))
                 if r < 0.85 else rng.choice(_PAIR[op]))
        answer = _tool_answer(f"{a}{op}{b}", f"{a} {op} {b} = {{}}")
        yield f"{a}{op}{b}", _user_assistant(_ask(rng, frame, a, b), answer)


def _counting(rng):
    while True:
        w = _word(rng)
        c = rng.choice(w) if rng.random() < 0.85 else rng.choice(string.ascii_lowercase)
        q = _ask(rng, rng.choice(_COUNT).replace("{c}", "{0}").replace("{w}", "{1}"), rng.choice(_LETTER).format(c),
                 rng.choice(_WORD).format(w))
        yield w, _user_assistant(q, _tool_answer(f"'{w}'.count('{c}')", f"'{c}' appears {{}} time(s) in '{w}'."))


def _spelling(rng):
    while True:
        w = _word(rng)
        yield w, _user_assistant(_ask(rng, rng.choice(_SPELL).replace("{w}", "{}"), rng.choice(_WORD).format(w)),
                                 "-".join(w))


@functools.cache
def _docstrings():
    """(name, first paragraph, its first sentence) of public stdlib functions with a short docstring paragraph."""
    out = []
    for name, kind, doc in stdlib_docstrings():
        para = " ".join(doc.split("\n\n")[0].split())
        m = regex.match(r"(.+?[.!?])(\s|$)", para)
        if kind == "function" and m and "._" not in name and len(para) <= 200 and 20 <= len(m.group(1)):
            out.append((name, para, m.group(1)))
    return out


def _docstring(rng):
    """Reading: a function's docstring paragraph is in the question; the answer is its first sentence."""
    frames = ('Here is the docstring of {0}:\n"""{1}"""\nWhat does {0} do, in one sentence?',
              '{0}: """{1}"""\nSummarize what {0} does in one sentence.',
              "Docstring of {0}: {1}\nIn one sentence, what does it do?",
              'def {0}(...):\n    """{1}"""\nWhat is the first sentence of this docstring?',
              "Read this and tell me what {0} does in one sentence: {1}")
    while True:
        name, para, sentence = rng.choice(_docstrings())
        yield name, _user_assistant(_ask(rng, rng.choice(frames), name, para), sentence)


def recall_conversations(split):
    """Docstring questions answered from memory (the docstring is not in the prompt), for bits/byte only: recalling
    an unseen function's first sentence is more than a 1M-parameter model can learn."""
    return [_user_assistant(f"What does {name} do?", s) for name, _, s in _docstrings()
            if _holdout(f"docstring/{name}", 20) == (split == "test")]


def task_conversations(task, split, seed=0):
    """Endless conversations of one synthetic task; 'train' and 'test' draw from disjoint items (1 in 5 is test)."""
    makers = {"identity": _identity, "arithmetic": _arithmetic, "counting": _counting, "spelling": _spelling,
              "docstring": _docstring}
    if task not in makers or split not in ("train", "test"):
        raise ValueError(f"unknown task {task!r} or split {split!r}: tasks are {TASKS}, splits 'train' and 'test'")
    items = makers[task](random.Random(f"{task}/{split}/{seed}"))
    return (messages for key, messages in items if _holdout(f"{task}/{key}", 20) == (split == "test"))


MIXTURE = {"identity": 1, "arithmetic": 3, "counting": 2, "spelling": 5, "docstring": 2}  # conversations drawn per 13


def sft_mixture(seed=0, extra=(), documents=None, text_every=8):
    """epoch -> SFT items: any user conversations (`extra`), then the tasks' train splits drawn by MIXTURE weights,
    with a pretraining document (a str, trained on whole) after every `text_every` conversations when `documents`
    (epoch -> texts) is given, so that SFT keeps what pretraining taught."""
    def items(epoch):
        rng, tasks = random.Random(f"mixture/{seed}/{epoch}"), list(MIXTURE)
        streams = [task_conversations(t, "train", seed=seed + 1000 * epoch) for t in tasks]
        docs = itertools.chain.from_iterable(documents(1000 * epoch + k) for k in itertools.count()) \
            if documents and text_every else None
        yield from extra
        for i in itertools.count(1):
            yield next(streams[rng.choices(range(len(tasks)), MIXTURE.values())[0]])
            if docs is not None and i % text_every == 0:
                yield next(docs)
    return items


def _final_answer(text, numeric):
    text = text.rsplit("<|output_end|>", 1)[-1].replace("<|assistant_end|>", "").strip()
    if not numeric:
        return text
    numbers = regex.findall(r"-?\d+(?:\.\d+)?", text)
    return float(numbers[-1]) if numbers else None  # as a number: 12.0 is 12


def check(messages, generated):
    """Exact match of a decoded completion with a task conversation's last (reference) message: the last number of the
    final text if the reference calls the calculator, else the whole stripped text."""
    ref = messages[-1]["content"]
    if isinstance(ref, str):
        return _final_answer(generated, False) == ref.strip()
    got = _final_answer(generated, True)
    return got is not None and got == _final_answer(ref[-1]["text"], True)


def load_questions(path):
    """Hand-written questions of a .jsonl file: {"skill": one of TASKS but docstring, "question", "answer"} a line."""
    rows = []
    for n, r in _json_lines(path, "a JSON object"):
        if not isinstance(r, dict) or r.get("skill") not in TASKS[:4] or not all(
                isinstance(r.get(k), str) for k in ("question", "answer")):
            raise ValueError(f"{path}:{n}: want {{\"skill\": one of {TASKS[:4]}, \"question\": str, \"answer\": str}}")
        rows.append(r)
    return rows


def grade(skill, answer, generated):
    """Whether a decoded completion answers a hand-written question: the last number of the final text for
    arithmetic and counting, its letters for spelling, the answer named for identity."""
    text = _final_answer(generated, False)
    if skill in ("arithmetic", "counting"):
        return _final_answer(generated, True) == float(answer)
    if skill == "spelling":
        return "".join(regex.findall(r"[a-z]", text.lower())) == answer.lower()
    return answer.lower() in text.lower()


# ------------------------------------------------------------------------------------------------ checkpoints


def _pack(obj):
    if hasattr(obj, "dtype") and hasattr(obj, "shape"):  # numpy and jax arrays
        if not getattr(obj, "is_fully_addressable", True):  # replicated multi-host: this process's own replica
            obj = obj.addressable_data(0)
        a = np.asarray(obj, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        return msgpack.ExtType(1, msgpack.packb([a.dtype.name, list(a.shape), a.tobytes()]))
    raise TypeError(f"cannot checkpoint a {type(obj).__name__}")


def _unpack(code, payload):
    dtype, shape, raw = msgpack.unpackb(payload)
    return np.frombuffer(raw, np.dtype(dtype)).reshape(tuple(shape))


def save_tree(path, tree):
    """Write a nested dict of arrays as msgpack, atomically (temp file, fsync, rename); returns its CRC-32."""
    tmp, raw = f"{path}.tmp{os.getpid()}", msgpack.packb(tree, default=_pack)
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return zlib.crc32(raw)


def load_tree(path, crc=None):
    """Read a tree written by save_tree (arrays come back as read-only numpy views); a file that does not unpack, or
    whose CRC-32 is not `crc`, is a ValueError."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if crc is not None and zlib.crc32(raw) != crc:
            raise ValueError(f"CRC-32 {zlib.crc32(raw)}, saved as {crc}")
        return msgpack.unpackb(raw, ext_hook=_unpack, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # flipped bits, a truncated or foreign file
        raise ValueError(f"{path}: damaged ({type(e).__name__}: {e}); use an earlier checkpoint") from None


def checkpoint_dirs(root):
    """Step directories under root (e.g. checkpoints/base), oldest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(os.path.join(root, d) for d in names if re.fullmatch(r"step_\d{6}", d))


def save_checkpoint(root, step, params, opt_state, meta, keep=3, files=None):
    """Write root/step_NNNNNN/{params,opt}.msgpack + meta.json (+ `files`: name -> writer(path)) via a temp dir, so
    a step directory is complete or absent; keep the newest `keep`."""
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
    # every rename is atomic and what is deleted is renamed away first: a kill -9 at any moment leaves each step_*
    # directory complete or absent
    if os.path.isdir(final):  # re-saving a step: set the old one aside only now that the new one is complete
        os.replace(final, f"{final}.old{os.getpid()}")
    os.replace(tmp, final)
    for old in checkpoint_dirs(root)[:-keep]:
        os.replace(old, f"{old}.old{os.getpid()}")
    for stale in glob.glob(os.path.join(root, "step_*.old*")) + glob.glob(os.path.join(root, "step_*.tmp*")):
        # the old steps set aside above, and whatever a killed save left behind
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path, optimizer=True):
    """(params, opt_state or None, meta) of a step directory written by save_checkpoint."""
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise FileNotFoundError(f"{path}: not a checkpoint directory (no meta.json); train one with train.py")
    with open(os.path.join(path, "meta.json")) as f:
        try:
            meta = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}/meta.json: damaged ({e}); use an earlier checkpoint") from None
    crc, opt_path = meta.pop("crc32", {}), os.path.join(path, "opt.msgpack")  # (no CRCs in older checkpoints)
    opt_state = load_tree(opt_path, crc.get("opt.msgpack")) if optimizer and os.path.isfile(opt_path) else None
    return load_tree(os.path.join(path, "params.msgpack"), crc.get("params.msgpack")), opt_state, meta


def load_newest(root, log=print):
    """(path, params, opt_state, meta) of the newest step directory under root that loads, or None: a damaged one
    (saves are atomic, so only the disk or a hand can damage one) is named and skipped."""
    for path in reversed(checkpoint_dirs(root)):
        try:
            return (path, *load_checkpoint(path))
        except (ValueError, OSError) as e:
            log(f"skipping {path}: {e}")
    return None


def latest_checkpoint(root="checkpoints", stages=("rl", "sft", "base")):
    """The newest step directory of the first stage that has one (RL before SFT before base), or None."""
    for stage in stages:
        if dirs := checkpoint_dirs(os.path.join(root, stage)):
            return dirs[-1]
    return None
