"""Data for nanochat in JAX: the tokenizer, corpora, packing, the chat format and the calculator.
It imports no jax and nothing of the project.

- Tokenizer: byte-level BPE with nanochat's split pattern and its 9 special tokens as the last ids,
  trained here and run by a `tiktoken.Encoding` of our ranks. Training is rustbpe's algorithm:
  unique regex chunks with counts, incremental pair counts, a pair -> chunks index and a lazy
  max-heap; ties go to the smallest pair, so our merges equal nanochat's. Saved as JSON: no pickle,
  and no tiktoken `load_tiktoken_bpe` (its cache can serve stale files).
- Corpora, offline by default: the running interpreter's stdlib docstrings (through `ast`, each
  headed by its qualified name) and the language reference in `pydoc_data.topics`, about 2 MB.
  User data: .txt, .jsonl and .parquet (pyarrow) files with "text", directories and globs,
  streamed a document at a time. The splits are by a hash of the text: disjoint and stable.
- Packing: nanochat's BOS-aligned best fit (its dataloader.py): every row starts with <|bos|>, the
  largest buffered document that fits goes in whole, and a row is cropped only when none fits;
  SFT pads instead (chat_sft.py). The loader's state (the stream position and the buffered
  documents' positions) resumes to exactly the same rows.
- Chat: nanochat's rendering of conversations to ids and a training mask (a typed "<|bos|>"
  stays text), and its calculator tool, evaluated on a whitelisted `ast`, never `eval`.
"""
import ast
import collections
import functools
import glob
import heapq
import itertools
import json
import os
import string
import sysconfig
import time
import warnings
import zlib

import numpy as np
import pydoc_data.topics
import regex
import tiktoken

SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}"""
                 r"""| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
SPECIAL_TOKENS = ("<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
                  "<|assistant_end|>", "<|python_start|>", "<|python_end|>", "<|output_start|>",
                  "<|output_end|>")

# ------------------------------------------------------------------------------------ tokenizer


class Tokenizer:
    """nanochat's tokenizer: token bytes in rank order (rank = id), the special tokens last."""

    def __init__(self, tokens, pat_str=SPLIT_PATTERN, specials=SPECIAL_TOKENS):
        ranks = {t: i for i, t in enumerate(tokens)}
        if len(ranks) != len(tokens) or any(ranks.get(bytes([b])) != b for b in range(256)):
            raise ValueError("tokenizer tokens must be unique and start with the 256 single bytes; "
                             "retrain it")
        self.tokens, self.pat_str = list(tokens), pat_str
        self.special = {s: len(tokens) + i for i, s in enumerate(specials)}
        self.enc = tiktoken.Encoding("nanochat", pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=self.special,
                                     explicit_n_vocab=len(tokens) + len(specials))
        self.bos, self.n_vocab = self.special["<|bos|>"], self.enc.n_vocab

    def encode(self, text):
        """Text -> ids. Special-token strings in the text stay ordinary text."""
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        """Ids -> text; bytes that are not UTF-8 become U+FFFD, special ids their names."""
        return self.enc.decode([int(i) for i in ids])

    def token_bytes(self):
        """The byte length of every id, 0 for the specials: the denominator of bits per byte."""
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
            tokens = [bytes.fromhex(t) for t in state["tokens"]]
            return cls(tokens, state["pat_str"], state["special_tokens"])
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no tokenizer file here; train one first") from None
        except (ValueError, KeyError, TypeError, AssertionError):
            raise ValueError(f"{path}: not a tokenizer file written by data.Tokenizer.save; "
                             "retrain it") from None


def tokenizer_for(out, paths=(), vocab_size=384, max_chars=2e9, retrain=False, write=True):
    """A run's tokenizer, out/tokenizer.json: trained on the corpus's train split (nanochat's
    tok_train: documents cropped to 10,000 characters) if it is not there yet, or if retrain;
    written if write (one process of several)."""
    path = os.path.join(out, "tokenizer.json")
    if os.path.isfile(path) and not retrain:
        return Tokenizer.load(path)
    t = time.perf_counter()
    tok = train_tokenizer(corpus(paths, "train")(0), vocab_size, max_chars=max_chars,
                          doc_chars=10_000)
    os.makedirs(out, exist_ok=True)
    if write:
        tok.save(path)
    print(f"tokenizer: vocab {tok.n_vocab} trained in {time.perf_counter() - t:.1f} s -> {path}")
    return tok


def byte_tokenizer():
    """nanochat's byte-level tokenizer (no merges, vocab 265): the golden chat renders' one."""
    return Tokenizer([bytes([i]) for i in range(256)])


def _merge(ids, a, b, new):
    out, i = [], 0
    while i < len(ids):
        hit = ids[i] == a and i + 1 < len(ids) and ids[i + 1] == b  # left to right, no overlaps
        out.append(new if hit else ids[i])
        i += 2 if hit else 1
    return out


def _chunk_counts(texts, pattern, max_chars, doc_chars):
    """Regex chunks of the texts with their counts; each text cropped to doc_chars, reading stopped
    after max_chars (nanochat's tok_train). Only unique chunks are kept, so no text is reread."""
    chunks, seen = collections.Counter(), 0
    for text in [texts] if isinstance(texts, str) else texts:
        if max_chars is not None and seen >= max_chars:
            break
        text = text[:doc_chars]
        seen += len(text)
        chunks.update(pattern.findall(text))
    if not chunks:
        raise ValueError("no text to train the tokenizer on; check the corpus")
    return chunks


def train_tokenizer(texts, vocab_size, pat_str=SPLIT_PATTERN, max_chars=None, doc_chars=None):
    """Train byte-level BPE on an iterable of texts; vocab_size counts the 9 specials, as nanochat's
    does."""
    n_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small: it needs at least "
                         f"{256 + len(SPECIAL_TOKENS)}")
    chunks = _chunk_counts(texts, regex.compile(pat_str), max_chars, doc_chars)
    words, freq = [list(w.encode()) for w in chunks], list(chunks.values())
    counts, where = collections.defaultdict(int), collections.defaultdict(set)
    for i, w in enumerate(words):
        for pair in zip(w, w[1:]):  # overlapping pairs count twice ("aaa": (a, a) twice)
            counts[pair] += freq[i]
            where[pair].add(i)
    # A lazy max-heap: after a merge old pairs only lose counts and every new pair holds the new id,
    # so a popped entry whose count is stale goes back with its true count; a fresh one is the
    # true (largest, then smallest) pair.
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
        new = ids.setdefault(merged, len(tokens))  # bytes already a token keep its id
        if new == len(tokens):
            tokens.append(merged)
        touched = set()
        for i in where.pop(pair):
            w, nw = words[i], _merge(words[i], *pair, new)
            if len(nw) == len(w):  # a stale index entry: an earlier merge took the pair
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
        warnings.warn(f"the text allows only {len(tokens) - 256} merges: the vocab is {n_vocab}, "
                      f"not {vocab_size}")
    return Tokenizer(tokens, pat_str)

# -------------------------------------------------------------------------------------- corpora

SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
             "site-packages", "dist-packages", "__pycache__", "lib-dynload"}


def holdout(key, percent):
    """A stable hash split: True for about `percent`% of keys, the same on every machine and run."""
    return zlib.crc32(key.encode("utf-8", "replace")) % 100 < percent


def _docstrings_of(tree, module, out):
    """Append (qualified name, kind, docstring) of a module's classes and functions to out."""
    def visit(body, prefix):
        for node in body:
            if isinstance(node, ast.If):  # platform-dependent definitions (os.py) sit under if, try
                visit(node.body + node.orelse, prefix)
            elif isinstance(node, ast.Try):
                handlers = [s for h in node.handlers for s in h.body]
                visit(node.body + node.orelse + node.finalbody + handlers, prefix)
            elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{node.name}"
                if doc := ast.get_docstring(node):
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    out.append((name, kind, doc))
                if isinstance(node, ast.ClassDef):
                    visit(node.body, name)
    if doc := ast.get_docstring(tree):
        out.append((module, "module", doc))
    visit(tree.body, module)


@functools.cache
def stdlib_docstrings():
    """(qualified name, kind, docstring) of the running interpreter's stdlib, by sorted path, then
    in source order."""
    root, paths, out = sysconfig.get_paths()["stdlib"], [], []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith("config-")]
        paths += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    for rel in sorted(paths):
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        try:
            with open(os.path.join(root, rel), "rb") as f:
                tree = ast.parse(f.read())  # parsed and dropped: keeping every tree slows the GC 3x
        except (SyntaxError, ValueError, OSError):
            continue
        _docstrings_of(tree, module, out)
    return tuple(out)


def _paragraphs(lines, min_chars=2000, max_chars=20000):
    """Cut lines into documents at blank lines once a document holds min_chars (small files stay
    whole), and at any line end past max_chars, so that text without blank lines streams."""
    doc, n = [], 0
    for line in lines:
        if line.strip() or n < min_chars:  # a blank line past min_chars ends the document
            doc.append(line)
            n += len(line)
            if n < max_chars:
                continue
        yield "".join(doc).strip()
        doc, n = [], 0
    if doc:
        yield "".join(doc).strip()


def default_corpus():
    """The offline default corpus: a document per stdlib docstring ("name\\n\\ndoc"), then the
    pydoc topics."""
    topics = pydoc_data.topics.topics
    docstrings = [f"{name}\n\n{doc}" for name, _, doc in stdlib_docstrings()]
    return docstrings + [d for key in sorted(topics)
                         for d in _paragraphs(topics[key].splitlines(keepends=True))]


def _lines(path):
    """Lines of a text file; invalid UTF-8 becomes U+FFFD, with one warning per file."""
    bad = 0
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace")
            bad += line.count("\ufffd") - raw.count("\ufffd".encode())  # not the file's own U+FFFDs
            yield line
    if bad:
        warnings.warn(f"{path}: replaced {bad} invalid UTF-8 sequences with U+FFFD; re-encode the "
                      "file as UTF-8")


def json_lines(path, what):
    """(line number, value) of each non-blank line of a .jsonl file; a line that is not JSON is a
    ValueError naming it and `what` it should be."""
    for n, line in enumerate(_lines(path), 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: invalid JSON ({e}); each line must be "
                                 f"{what}") from None


def _jsonl_texts(path):
    for n, line in enumerate(_lines(path), 1):
        if line.strip():
            try:
                text = json.loads(line)["text"]
                assert isinstance(text, str)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise ValueError(f'{path}:{n}: expected a JSON object with a "text" string; fix or '
                                 "delete it") from None
            yield text


def _parquet_texts(path):
    try:
        import pyarrow.parquet as pq  # optional: only nanochat's FineWeb/ClimbMix shards need it
    except ImportError:
        raise ImportError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow") from None
    f = pq.ParquetFile(path)
    if "text" not in f.schema_arrow.names:
        raise ValueError(f'{path}: no "text" column (it has {f.schema_arrow.names}); pass '
                         "nanochat-style shards")
    for i in range(f.num_row_groups):  # one row group (about 1000 documents) in memory at a time
        texts = f.read_row_group(i, columns=["text"]).column("text").to_pylist()
        yield from (t for t in texts if t is not None)


READERS = {".txt": lambda path: _paragraphs(_lines(path)), ".jsonl": _jsonl_texts,
           ".parquet": _parquet_texts}


def _corpus_files(paths):
    """Expand files, directories (recursively) and globs into corpus files, each group sorted."""
    def known(p):
        return os.path.isfile(p) and os.path.splitext(p)[1] in READERS
    files = []
    for p in [paths] if isinstance(paths, str) else paths:
        if os.path.isdir(p):
            found = sorted(filter(known, (os.path.join(d, f)
                                          for d, _, fs in os.walk(p) for f in fs)))
            if not found:
                raise ValueError(f"{p}: no .txt, .jsonl or .parquet files in this directory")
        elif os.path.isfile(p):
            if not known(p):
                raise ValueError(f"{p}: unsupported file type; corpora are .txt, .jsonl or "
                                 ".parquet files")
            found = [p]
        elif any(c in p for c in "*?["):
            if not (found := sorted(filter(known, glob.glob(p, recursive=True)))):
                raise FileNotFoundError(f"{p}: the pattern matches no .txt, .jsonl or .parquet "
                                        "file")
        else:
            raise FileNotFoundError(f"{p}: no such file or directory; pass .txt/.jsonl/.parquet "
                                    "files, directories or globs")
        files += found
    return files


def shuffled(items, seed=0):
    """epoch -> the items in a fresh order per (seed, epoch)."""
    def epoch_items(epoch):
        order = np.random.default_rng([seed, epoch]).permutation(len(items))
        return (items[i] for i in order)
    return epoch_items


def corpus(paths=None, split="train", seed=0):
    """epoch -> documents of one split: the default corpus reshuffled per epoch, or user files
    streamed in order; 1 document in 20 (by a hash of its text) is "val". User files are not
    shuffled: nanochat's shards come shuffled, and the packing buffer mixes nearby documents."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    want_val = split == "val"
    if not paths:
        return shuffled([d for d in default_corpus() if holdout(d, 5) == want_val], seed)
    files = _corpus_files(paths)

    def documents(epoch):
        return (d for f in files for d in READERS[os.path.splitext(f)[1]](f)
                if d.strip() and holdout(d, 5) == want_val)
    return documents

# -------------------------------------------------------------------------------------- packing


def every_nth(items, r, n):
    """epoch -> every n-th item from the r-th on: one data shard of n."""
    return lambda epoch: itertools.islice(items(epoch), r, None, n)


def _stream(items, epoch, index):
    """((epoch, i), item) for every item from position (epoch, index) on, epoch after epoch."""
    while True:
        n = -1
        for n, item in enumerate(items(epoch)):
            if n >= index:
                yield (epoch, n), item
        if n < 0:
            raise ValueError("the corpus has no documents in this split; give it more text (1 in "
                             "20 goes to val)")
        epoch, index = epoch + 1, 0


def _replay(items, encode, keys, nxt):
    """The buffered documents of a saved loader state, encoded again: {key: encode(item)}."""
    found, wanted = {}, set(keys)
    for key, item in _stream(items, *min(keys)) if keys else ():  # from the oldest buffered one
        if key >= nxt:
            break
        if key in wanted:
            found[key] = encode(item)
    if len(found) < len(wanted):
        raise ValueError("the corpus changed since this loader state was saved; resume with the "
                         "same data and seed")
    return found


def _best_fit(items, encode, B, T, state, buffer_size, pad, bos):
    """Rows of T + 1 tokens by nanochat's best fit: (rows, masks, state) per batch of B rows."""
    if B < 1 or T < 1:
        raise ValueError(f"batch size B={B} and sequence length T={T} must be positive")
    state = {"epoch": 0, "index": 0, "buffer": [], "dropped": 0} | (state or {})
    nxt, dropped = (state["epoch"], state["index"]), state["dropped"]
    keys = [tuple(k) for k in state["buffer"]]
    found = _replay(items, encode, keys, nxt)
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
                    j = int(fits.argmax())  # the largest that fits; ties to the first, as nanochat
                elif pad:
                    break  # SFT: the rest of the row stays BOS with mask 0
                else:
                    j = int(lens.argmin())  # nothing fits: crop the shortest, drop its tail
                (_, ids, mask), lens = buffer.pop(j), np.delete(lens, j)
                n = min(len(ids), cap - pos)
                rows[b, pos:pos + n], masks[b, pos:pos + n] = ids[:n], mask[:n]
                dropped += len(ids) - n
                pos += n
        yield rows, masks, {"epoch": nxt[0], "index": nxt[1], "buffer": [e[0] for e in buffer],
                            "dropped": dropped}


def pretrain_batches(tok, documents, B, T, state=None, buffer_size=1000):
    """Endless (inputs, targets, state) of nanochat's BOS-aligned best-fit packing, int32 (B, T)
    each, of documents (epoch -> texts, see `corpus`); the last yielded state resumes exactly.
    Every target is supervised (nanochat does not mask BOS; bits per byte gives it 0 bytes)."""
    def encode(text):
        ids = [tok.bos] + tok.encode(text)
        return ids, [1] * len(ids)  # the mask is unused in pretraining

    for rows, _, st in _best_fit(documents, encode, B, T, state, buffer_size, False, tok.bos):
        yield rows[:, :-1], rows[:, 1:], st


def sft_batches(tok, conversations, B, T, state=None, buffer_size=100):
    """Endless (inputs, targets, state) of nanochat's SFT best fit: rows padded with BOS, targets -1
    where unsupervised. An item is a conversation, or a document (a str: its first T + 1 tokens,
    all trained on)."""
    def encode(item):
        if isinstance(item, str):
            ids = ([tok.bos] + tok.encode(item))[:T + 1]
            return ids, [1] * len(ids)
        return render_conversation(tok, item, max_tokens=T + 1)

    for rows, masks, st in _best_fit(conversations, encode, B, T, state, buffer_size, True,
                                     tok.bos):
        yield rows[:, :-1], np.where(masks[:, 1:] == 1, rows[:, 1:], -1).astype(np.int32), st

# ---------------------------------------------------------------------------------- chat format

PARTS = ("text", "python", "python_output")


def _checked(messages):
    """nanochat's message rules, a system message merged into the first user turn; ValueError if
    broken."""
    if not isinstance(messages, list) or not messages or \
            not all(isinstance(m, dict) for m in messages):
        raise ValueError('a conversation is a non-empty list of {"role": ..., "content": ...} '
                         "messages")
    offset = 0
    if messages[0].get("role") == "system":
        if (len(messages) < 2 or messages[1].get("role") != "user"
                or not all(isinstance(m.get("content"), str) for m in messages[:2])):
            raise ValueError("a system message must be a string followed by a user message (a "
                             "string)")
        text = messages[0]["content"] + "\n\n" + messages[1]["content"]
        messages, offset = [{"role": "user", "content": text}] + messages[2:], 1
    for i, m in enumerate(messages):
        role, content, want = m.get("role"), m.get("content"), ("user", "assistant")[i % 2]
        if role != want:
            raise ValueError(f"message {i + offset} has role {role!r} where {want!r} is due: roles "
                             "must alternate user, assistant, ... after an optional system message")
        parts = content if role == "assistant" and isinstance(content, list) else \
            [{"type": "text", "text": content}]
        if not all(isinstance(p, dict) and p.get("type") in PARTS and isinstance(p.get("text"), str)
                   for p in parts):
            raise ValueError(f"message {i + offset}: content must be a string (assistant: or a "
                             f"list of {{'type': one of {PARTS}, 'text': str}} parts)")
        if not parts or not "".join(p["text"] for p in parts).strip():
            raise ValueError(f"message {i + offset} ({role}) is empty; give it some text or drop "
                             "the turn")
    return messages


def render_conversation(tok, messages, max_tokens=2048):
    """(ids, mask) of a conversation as nanochat renders it; mask 1 on the tokens the assistant is
    trained on."""
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
    """Prompt ids for generation: the conversation without its last assistant message, then
    <|assistant_start|>."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict) \
            or messages[-1].get("role") != "assistant":
        raise ValueError("render_for_completion needs a conversation ending in the assistant "
                         "message to replace")
    return render_conversation(tok, messages[:-1])[0] + [tok.special["<|assistant_start|>"]]


def reply_stops(tok):
    """The ids that end an assistant reply: <|assistant_end|>, or <|bos|> (a new document)."""
    return (tok.special["<|assistant_end|>"], tok.bos)


def load_conversations(path):
    """Conversations of a CustomJSON .jsonl file (nanochat's form): a list of messages a line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such conversations file (.jsonl, one JSON list of "
                                "messages a line)")
    convs = []
    for n, messages in json_lines(path, "a JSON list of messages"):
        try:
            _checked(messages)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        convs.append(messages)
    if not convs:
        raise ValueError(f"{path}: no conversations in this file")
    return convs

# ----------------------------------------------------------------------------------- calculator

OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
       ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b}


def _calc(node):
    """Evaluate a whitelisted ast: numbers, + - * / //, unary +/-, and "str".count("str")."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in (ast.UAdd, ast.USub):
        return -_calc(node.operand) if isinstance(node.op, ast.USub) else +_calc(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        a, b = _calc(node.left), _calc(node.right)
        if isinstance(a, str) or isinstance(b, str):
            raise ValueError("no arithmetic on strings")
        return OPS[type(node.op)](a, b)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "count" and len(node.args) == 1 and not node.keywords):
        s, sub = _calc(node.func.value), _calc(node.args[0])
        if isinstance(s, str) and isinstance(sub, str):
            return s.count(sub)
    raise ValueError("unsupported expression")


def use_calculator(expr):
    """nanochat's calculator tool: the value of arithmetic or of a "str".count("str") expression,
    else None."""
    expr = expr.replace(",", "")  # nanochat's character filters first: None where it gives None
    math = all(c in "0123456789*+-/.() " for c in expr) and "**" not in expr
    allowed = string.ascii_letters + string.digits + "'\"()._ "
    count = all(c in allowed for c in expr) and ".count(" in expr
    if not (math or count):
        return None
    try:
        value = _calc(ast.parse(expr.strip(), mode="eval").body)
        str(value)  # the engine prints it: ints past Python's 4300-digit limit raise here
        return value
    except (SyntaxError, ValueError, ArithmeticError, RecursionError, MemoryError):
        return None


def calculator_tool(tok):
    """nanochat's tool state machine for one generation: tool(row, token) -> the ids to force into
    that row next, <|output_start|>use_calculator(expr)<|output_end|> after
    <|python_start|>expr<|python_end|> (nothing when the calculator gives None)."""
    sp, exprs = tok.special, {}  # row -> its ids since <|python_start|>, while a block is open

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
