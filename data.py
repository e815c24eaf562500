"""Data for nanochat in JAX: the tokenizer, the corpora, packing, the chat format and
the calculator tool. It imports no jax and nothing of the project.

- Tokenizer: byte-level BPE with nanochat's split pattern and 9 special tokens, trained
  by rustbpe's algorithm (our merges equal nanochat's), run by tiktoken, saved as JSON.
- Corpora: stdlib docstrings and pydoc topics offline, or .txt, .jsonl and .parquet
  files; train and val are split by a hash of each document's text.
- Packing: nanochat's BOS-aligned best fit (its dataloader.py), padded for SFT; each
  process packs its own shards of the documents.
- Chat: nanochat's conversation rendering (ids and a training mask), its calculator.

docs/data.md tells how each part works and why.
"""
import ast
import collections
import functools
import glob
import heapq
import itertools
import json
import operator
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

# nanochat's split pattern: GPT-4's, with numbers in chunks of at most 2 digits, not 3
SPLIT_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}"""
                 r"""| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
# nanochat's special tokens, in its order: they take the last ids of the vocab
SPECIAL_TOKENS = (
    "<|bos|>",  # every document and every conversation starts with it
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # around the assistant's calculator call
    "<|output_start|>", "<|output_end|>",  # around the calculator's answer, forced in
)


def write_atomic(path, content):
    """Write content (str or bytes) to path whole or not at all: a temporary file beside it,
    flushed to the disk, then renamed over it. Every file of the project is written so (a
    checkpoint's directory is made whole the same way, in checkpoint.py)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # a failed write leaves nothing behind
            os.remove(tmp)

# ---------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """nanochat's tokenizer: token bytes in rank order (rank = id), specials last."""

    def __init__(self, tokens, pat_str=SPLIT_PATTERN, specials=SPECIAL_TOKENS):
        ranks = {t: i for i, t in enumerate(tokens)}
        # any byte must be encodable, so the 256 single bytes hold ids 0-255
        single_bytes_first = all(ranks.get(bytes([b])) == b for b in range(256))
        if len(ranks) != len(tokens) or not single_bytes_first:
            raise ValueError("tokenizer tokens must be unique and start with the 256 "
                             "single bytes; retrain it")
        self.tokens = list(tokens)
        self.pat_str = pat_str
        self.special = {s: len(tokens) + i for i, s in enumerate(specials)}
        self.enc = tiktoken.Encoding("nanochat", pat_str=pat_str, mergeable_ranks=ranks,
                                     special_tokens=self.special,
                                     explicit_n_vocab=len(tokens) + len(specials))
        self.bos = self.special["<|bos|>"]
        self.n_vocab = self.enc.n_vocab

    def encode(self, text):
        """Text -> ids. Special-token strings in the text stay ordinary text."""
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        """Ids -> text; invalid UTF-8 becomes U+FFFD, special ids their names."""
        return self.enc.decode([int(i) for i in ids])

    def token_bytes(self):
        """Bytes per id, 0 for the specials: the denominator of bits per byte."""
        lengths = [len(t) for t in self.tokens] + [0] * len(self.special)
        return np.array(lengths, np.int32)

    def save(self, path):
        """Write the tokenizer as plain JSON, atomically."""
        # JSON rather than pickle: loading a file never runs code
        state = {"version": 1, "pat_str": self.pat_str,
                 "tokens": [t.hex() for t in self.tokens],
                 "special_tokens": list(self.special)}
        write_atomic(path, json.dumps(state))

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
            raise ValueError(f"{path}: not a tokenizer file written by "
                             "data.Tokenizer.save; retrain it") from None


def tokenizer_for(out, paths=(), vocab_size=384, max_chars=2e9, retrain=False, write=True):
    """A run's tokenizer, out/tokenizer.json, trained on the train split if it is not
    there or if retrain (as nanochat's tok_train: documents cropped to 10,000
    characters); written only if write (one process of several writes it)."""
    path = os.path.join(out, "tokenizer.json")
    if os.path.isfile(path) and not retrain:
        return Tokenizer.load(path)
    t0 = time.perf_counter()
    documents = corpus(paths, "train")(0)
    tok = train_tokenizer(documents, vocab_size, max_chars=max_chars, doc_chars=10_000)
    os.makedirs(out, exist_ok=True)
    if write:
        tok.save(path)
    seconds = time.perf_counter() - t0
    print(f"tokenizer: vocab {tok.n_vocab} trained in {seconds:.1f} s -> {path}")
    return tok


def byte_tokenizer():
    """nanochat's byte tokenizer (no merges, vocab 265), used by the golden renders."""
    return Tokenizer([bytes([i]) for i in range(256)])


def _merge(ids, a, b, new_id):
    """ids with each (a, b) replaced by new_id, left to right, without overlaps."""
    out = []
    i = 0
    while i < len(ids):
        hit = ids[i] == a and i + 1 < len(ids) and ids[i + 1] == b
        out.append(new_id if hit else ids[i])
        i += 2 if hit else 1
    return out


def _chunk_counts(texts, pattern, max_chars, doc_chars):
    """Regex chunks of the texts with their counts, each text cropped to doc_chars and
    reading stopped after max_chars (nanochat's tok_train). Only unique chunks are kept,
    so training never rereads the text."""
    chunks = collections.Counter()
    chars_read = 0
    for text in [texts] if isinstance(texts, str) else texts:
        if max_chars is not None and chars_read >= max_chars:
            break
        text = text[:doc_chars]
        chars_read += len(text)
        chunks.update(pattern.findall(text))
    if not chunks:
        raise ValueError("no text to train the tokenizer on; check the corpus")
    return chunks


def _apply_merge(words, freq, counts, where, pair, new_id):
    """Merge pair into new_id in every word that holds it, updating the pair counts and
    the pair -> words index; returns the pairs that now hold new_id."""
    touched = set()
    for i in where.pop(pair):
        word = words[i]
        new_word = _merge(word, *pair, new_id)
        # a stale index entry: an earlier merge took the pair
        if len(new_word) == len(word):
            continue
        for p in zip(word, word[1:]):
            counts[p] -= freq[i]
        for p in zip(new_word, new_word[1:]):
            counts[p] += freq[i]
            if new_id in p:
                where[p].add(i)
                touched.add(p)
        words[i] = new_word
    del counts[pair]
    return touched


def train_tokenizer(texts, vocab_size, pat_str=SPLIT_PATTERN, max_chars=None, doc_chars=None):
    """Train byte-level BPE on texts (an iterable of str, or one str); vocab_size counts
    the 9 specials, as nanochat's does."""
    n_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small: it needs at least "
                         f"{256 + len(SPECIAL_TOKENS)}")
    # 1. the unique chunks as lists of byte ids, each with its count
    chunks = _chunk_counts(texts, regex.compile(pat_str), max_chars, doc_chars)
    words = [list(w.encode()) for w in chunks]
    freq = list(chunks.values())
    # 2. count every adjacent pair, and index the words that hold it
    counts = collections.defaultdict(int)
    where = collections.defaultdict(set)
    for i, word in enumerate(words):
        # overlapping pairs count twice: "aaa" holds (a, a) twice
        for pair in zip(word, word[1:]):
            counts[pair] += freq[i]
            where[pair].add(i)
    # 3. a lazy max-heap: after a merge, old pairs only lose counts and every new pair
    # holds the new id, so a popped entry with a stale count goes back with its true
    # count, and a fresh one is the true (largest, then smallest) pair
    heap = [(-count, pair) for pair, count in counts.items()]
    heapq.heapify(heap)
    tokens = [bytes([i]) for i in range(256)]
    id_of = {t: i for i, t in enumerate(tokens)}
    # 4. merge the most frequent pair until the vocab is full or no pair is left
    while len(tokens) < 256 + n_merges and heap:
        neg_count, pair = heapq.heappop(heap)
        count = counts.get(pair, 0)
        if count != -neg_count:
            if count > 0:
                heapq.heappush(heap, (-count, pair))
            continue
        merged = tokens[pair[0]] + tokens[pair[1]]
        # merged bytes that are already a token keep that token's id
        new_id = id_of.setdefault(merged, len(tokens))
        if new_id == len(tokens):
            tokens.append(merged)
        touched = _apply_merge(words, freq, counts, where, pair=pair, new_id=new_id)
        for p in touched:
            heapq.heappush(heap, (-counts[p], p))
    # a small text can run out of pairs before the vocab is full
    if len(tokens) < 256 + n_merges:
        n_vocab = len(tokens) + len(SPECIAL_TOKENS)
        warnings.warn(f"the text allows only {len(tokens) - 256} merges: the vocab is "
                      f"{n_vocab}, not {vocab_size}")
    return Tokenizer(tokens, pat_str)

# ------------------------------------------------------------------------------ corpora

# left out of the stdlib corpus: tests, GUI and tool packages, and whatever is installed
# (site-packages would make the corpus differ from machine to machine)
SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3",
             "ensurepip", "site-packages", "dist-packages", "__pycache__", "lib-dynload"}


def holdout(key, percent):
    """A stable hash split: True for about `percent`% of keys, on any machine."""
    return zlib.crc32(key.encode("utf-8", "replace")) % 100 < percent


def _docstrings_of(tree, module, out):
    """Append to out the (qualified name, kind, docstring) of a module and its defs."""
    def visit(body, prefix):
        for node in body:
            # platform-dependent definitions (as in os.py) sit under an if or a try
            if isinstance(node, ast.If):
                visit(node.body + node.orelse, prefix)
            elif isinstance(node, ast.Try):
                handlers = [stmt for handler in node.handlers for stmt in handler.body]
                visit(node.body + node.orelse + node.finalbody + handlers, prefix)
            elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{node.name}"
                if docstring := ast.get_docstring(node):
                    kind = "class" if isinstance(node, ast.ClassDef) else "function"
                    out.append((name, kind, docstring))
                if isinstance(node, ast.ClassDef):
                    visit(node.body, name)

    if docstring := ast.get_docstring(tree):
        out.append((module, "module", docstring))
    visit(tree.body, module)


@functools.cache
def stdlib_docstrings():
    """(qualified name, kind, docstring) of the running interpreter's stdlib, by sorted
    path, then in source order."""
    root = sysconfig.get_paths()["stdlib"]
    # 1. the stdlib's .py files; config-* holds the build's scripts, not the library
    paths = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [sub for sub in dirs
                   if sub not in SKIP_DIRS and not sub.startswith("config-")]
        py_files = [os.path.join(dirpath, name) for name in files if name.endswith(".py")]
        paths += [os.path.relpath(py_file, root) for py_file in py_files]
    # 2. each module's docstrings, named by its dotted path (pkg/__init__.py is pkg)
    out = []
    for rel in sorted(paths):
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        try:
            # parsed and dropped: holding every tree at once slows the garbage collector
            with open(os.path.join(root, rel), "rb") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, ValueError, OSError):
            continue  # a file this interpreter cannot read or parse
        _docstrings_of(tree, module, out)
    return tuple(out)


def _paragraphs(lines, min_chars=2000, max_chars=20000):
    """Cut lines into documents at blank lines once a document holds min_chars (small
    files stay whole), and at any line end past max_chars (text without blank lines)."""
    held = []
    n_chars = 0
    for line in lines:
        # a blank line ends the document once it holds min_chars
        if line.strip() or n_chars < min_chars:
            held.append(line)
            n_chars += len(line)
            if n_chars < max_chars:
                continue
        yield "".join(held).strip()
        held = []
        n_chars = 0
    if held:
        yield "".join(held).strip()


def default_corpus():
    """The offline default corpus: a document per stdlib docstring ("name\\n\\ndoc"),
    then the pydoc topics."""
    topics = pydoc_data.topics.topics
    docstrings = [f"{name}\n\n{docstring}" for name, _, docstring in stdlib_docstrings()]
    # the language reference's topics, the long ones cut into paragraphs
    topic_docs = [doc for topic in sorted(topics)
                  for doc in _paragraphs(topics[topic].splitlines(keepends=True))]
    return docstrings + topic_docs


def _lines(path):
    """Lines of a text file; invalid UTF-8 becomes U+FFFD, with one warning per file."""
    bad = 0
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8", errors="replace")
            # count the replacements only, not the U+FFFDs the file holds itself
            bad += line.count("\ufffd") - raw.count("\ufffd".encode())
            yield line
    if bad:
        warnings.warn(f"{path}: replaced {bad} invalid UTF-8 sequences with U+FFFD; "
                      "re-encode the file as UTF-8")


def json_lines(path, what):
    """(line number, value) of each non-blank line of a .jsonl file; a line that is not
    JSON is a ValueError naming it and `what` it should be."""
    for lineno, line in enumerate(_lines(path), 1):
        if line.strip():
            try:
                yield lineno, json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e}); "
                                 f"each line must be {what}") from None


def _txt_texts(path):
    """The documents of a .txt file: its paragraphs."""
    return _paragraphs(_lines(path))


def _jsonl_texts(path):
    """The documents of a .jsonl file: one {"text": ...} object a line."""
    for lineno, line in enumerate(_lines(path), 1):
        if line.strip():
            try:
                text = json.loads(line)["text"]
                assert isinstance(text, str)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise ValueError(f'{path}:{lineno}: expected a JSON object with a '
                                 '"text" string; fix or delete it') from None
            yield text


def _parquet_texts(path):
    """The documents of a .parquet file: its "text" column, as in nanochat's shards."""
    try:
        import pyarrow.parquet as pq  # optional: only nanochat's shards need it
    except ImportError:
        raise ImportError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow") from None
    parquet = pq.ParquetFile(path)
    if "text" not in parquet.schema_arrow.names:
        raise ValueError(f'{path}: no "text" column (it has '
                         f'{parquet.schema_arrow.names}); pass nanochat-style shards')
    # one row group (about 1000 documents) in memory at a time
    for i in range(parquet.num_row_groups):
        texts = parquet.read_row_group(i, columns=["text"]).column("text").to_pylist()
        yield from (t for t in texts if t is not None)


# a corpus file's reader by its extension: path -> its documents, streamed
READERS = {".txt": _txt_texts, ".jsonl": _jsonl_texts, ".parquet": _parquet_texts}


def _corpus_files(paths):
    """Corpus files of files, directories (recursively) and globs, each group sorted."""
    def known(path):
        return os.path.isfile(path) and os.path.splitext(path)[1] in READERS

    files = []
    for path in [paths] if isinstance(paths, str) else paths:
        if os.path.isdir(path):
            walked = (os.path.join(dirpath, name)
                      for dirpath, _, names in os.walk(path) for name in names)
            found = sorted(filter(known, walked))
            if not found:
                raise ValueError(f"{path}: no .txt, .jsonl or .parquet files in this directory")
        elif os.path.isfile(path):
            if not known(path):
                raise ValueError(f"{path}: unsupported file type; corpora are .txt, "
                                 ".jsonl or .parquet files")
            found = [path]
        elif any(c in path for c in "*?["):  # a glob
            found = sorted(filter(known, glob.glob(path, recursive=True)))
            if not found:
                raise FileNotFoundError(f"{path}: the pattern matches no .txt, "
                                        ".jsonl or .parquet file")
        else:
            raise FileNotFoundError(f"{path}: no such file or directory; pass "
                                    ".txt/.jsonl/.parquet files, directories or globs")
        files += found
    return files


def shuffled(items, seed=0):
    """epoch -> the items in a fresh order per (seed, epoch)."""
    def epoch_items(epoch):
        order = np.random.default_rng([seed, epoch]).permutation(len(items))
        return (items[i] for i in order)
    return epoch_items


def corpus(paths=None, split="train", seed=0):
    """epoch -> documents of one split: the default corpus reshuffled per epoch, or user
    files streamed in order; 1 document in 20 (by a hash of its text) is "val". User
    files are not shuffled: nanochat's shards come shuffled, and packing mixes nearby
    documents."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    want_val = split == "val"
    # the default corpus fits in memory: split it once, then reshuffle it per epoch
    if not paths:
        split_docs = [doc for doc in default_corpus() if holdout(doc, 5) == want_val]
        return shuffled(split_docs, seed)
    files = _corpus_files(paths)

    # user files may not fit in memory: each epoch streams them, a document at a time
    def documents(epoch):
        for path in files:
            read = READERS[os.path.splitext(path)[1]]
            for doc in read(path):
                if doc.strip() and holdout(doc, 5) == want_val:
                    yield doc
    return documents

# ------------------------------------------------------------------------------ packing


def every_nth(items, r, n):
    """epoch -> every n-th item from the r-th on: one data shard of n."""
    def shard(epoch):
        return itertools.islice(items(epoch), r, None, n)
    return shard


def _stream(items, epoch, index):
    """((epoch, i), item) of every item from (epoch, index) on, epoch after epoch."""
    while True:
        # an epoch cannot seek: the items before index are read and skipped
        i = -1
        for i, item in enumerate(items(epoch)):
            if i >= index:
                yield (epoch, i), item
        if i < 0:
            raise ValueError("the corpus has no documents in this split; give it more "
                             "text (1 in 20 goes to val)")
        epoch += 1
        index = 0


def _replay(items, encode, keys, next_key):
    """{key: encode(item)} for the buffered documents of a saved loader state: keys are
    their stream positions, next_key is where the saved stream stopped."""
    found = {}
    wanted = set(keys)
    # read the stream again from the oldest buffered document to where the state stopped
    replayed = _stream(items, *min(keys)) if keys else ()
    for key, item in replayed:
        if key >= next_key:
            break
        if key in wanted:
            found[key] = encode(item)
    if len(found) < len(wanted):
        raise ValueError("the corpus changed since this loader state was saved; "
                         "resume with the same data and seed")
    return found


def _best_fit(items, encode, B, T, *, state, buffer_size, pad, bos):
    """Rows of T + 1 tokens by nanochat's best fit: (rows, masks, state) per B rows."""
    if B < 1 or T < 1:
        raise ValueError(f"batch size B={B} and sequence length T={T} must be positive")
    cap = T + 1  # a row holds T inputs and, one token later, their T targets
    # 1. resume: the stream position, and the buffered documents encoded again
    state = {"epoch": 0, "index": 0, "buffer": [], "dropped": 0} | (state or {})
    next_key = (state["epoch"], state["index"])
    dropped = state["dropped"]
    keys = [tuple(k) for k in state["buffer"]]
    found = _replay(items, encode, keys, next_key)
    # a buffer entry is (key, ids, mask), its key a list that the yielded states share;
    # lens mirrors the buffered documents' lengths: one array op finds the best fit
    buffer = [(list(k), *found[k]) for k in keys]
    stream = _stream(items, *next_key)
    lens = np.array([len(entry[1]) for entry in buffer], np.int64)
    while True:
        rows = np.full((B, cap), bos, np.int32)
        masks = np.zeros((B, cap), np.int8)
        for b in range(B):
            pos = 0
            while pos < cap:
                # 2. top the buffer up from the stream
                while len(buffer) < buffer_size:
                    key, item = next(stream)
                    buffer.append((list(key), *encode(item)))
                    lens = np.append(lens, len(buffer[-1][1]))
                    next_key = (key[0], key[1] + 1)
                # 3. choose the largest document that fits in the rest of the row
                fits = np.where(lens <= cap - pos, lens, 0)
                if fits.any():
                    j = int(fits.argmax())  # ties go to the first, as in nanochat
                elif pad:
                    break  # SFT: the rest of the row stays BOS with mask 0
                else:
                    # nothing fits: crop the shortest and drop its tail
                    j = int(lens.argmin())
                # 4. copy it into the row, cropped to the room left
                _, ids, mask = buffer.pop(j)
                lens = np.delete(lens, j)
                take = min(len(ids), cap - pos)
                rows[b, pos:pos + take] = ids[:take]
                masks[b, pos:pos + take] = mask[:take]
                dropped += len(ids) - take
                pos += take
        # 5. the state after this batch: loading it resumes at the next batch
        yield rows, masks, {"epoch": next_key[0], "index": next_key[1],
                            "buffer": [entry[0] for entry in buffer], "dropped": dropped}


def pretrain_batches(tok, documents, B, T, state=None, buffer_size=1000):
    """Endless (inputs, targets, state) of nanochat's BOS-aligned best-fit packing,
    int32 (B, T) each, of documents (epoch -> texts, see `corpus`); the last state
    resumes exactly. Every target is supervised (nanochat does not mask BOS; bits per
    byte gives it 0 bytes)."""
    def encode(text):
        ids = [tok.bos] + tok.encode(text)
        return ids, [1] * len(ids)  # the mask is unused in pretraining

    batches = _best_fit(documents, encode, B, T, state=state,
                        buffer_size=buffer_size, pad=False, bos=tok.bos)
    for rows, _, loader_state in batches:
        yield rows[:, :-1], rows[:, 1:], loader_state


def sft_batches(tok, conversations, B, T, state=None, buffer_size=100):
    """Endless (inputs, targets, state) of nanochat's SFT best fit: rows padded with
    BOS, targets -1 where unsupervised. An item is a conversation, or a document (a str:
    its first T + 1 tokens, all trained on)."""
    def encode(item):
        if isinstance(item, str):
            ids = ([tok.bos] + tok.encode(item))[:T + 1]
            return ids, [1] * len(ids)
        return render_conversation(tok, item, max_tokens=T + 1)

    batches = _best_fit(conversations, encode, B, T, state=state,
                        buffer_size=buffer_size, pad=True, bos=tok.bos)
    for rows, masks, loader_state in batches:
        targets = np.where(masks[:, 1:] == 1, rows[:, 1:], -1).astype(np.int32)
        yield rows[:, :-1], targets, loader_state


def process_batches(packer, tok, docs, shape, *, process=(0, 1), data_shards=0, states=None):
    """(batches, states): one process's rows of every step's batch, and their loader states.
    shape: the step's (A micro-batches, rows, T). The documents (epoch -> texts) are cut into
    data_shards shards (0: one per process), every data_shards-th document each; process
    (index, count) packs its own shards, each with packer(tok, shard, rows, T, state), their
    rows side by side. A batch is (inputs, targets, states): int (A, rows / count, T) numpy,
    and every shard's loader position in shard order (what a checkpoint keeps)."""
    A, rows, T = shape
    index, count = process
    n_shards = data_shards or count
    if n_shards % count or rows % n_shards:
        raise ValueError(f"--data-shards {n_shards} must be a multiple of the {count} "
                         f"processes and divide the {rows} rows of a micro-batch")
    # this process's shards, each resumed from its saved state
    per_process = n_shards // count
    shards = range(index * per_process, (index + 1) * per_process)
    if states is None:
        states = [None] * per_process
    else:
        states = states[shards.start:shards.stop]
    per_shard = rows // n_shards
    packers = [packer(tok, every_nth(docs, r, n_shards), A * per_shard, T, state)
               for r, state in zip(shards, states)]

    def batches():
        while True:
            parts = [next(packed) for packed in packers]
            # a micro-batch's rows: each shard's share of them, shard after shard
            inputs = np.concatenate([p[0].reshape(A, per_shard, T) for p in parts], axis=1)
            targets = np.concatenate([p[1].reshape(A, per_shard, T) for p in parts], axis=1)
            yield inputs, targets, [p[2] for p in parts]
    return batches(), states

# -------------------------------------------------------------------------- chat format

# the kinds of part an assistant message's content list may hold
PARTS = ("text", "python", "python_output")


def _checked(messages):
    """The messages, checked by nanochat's rules (a ValueError if broken), a system
    message merged into the first user turn."""
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(message, dict) for message in messages)):
        raise ValueError('a conversation is a non-empty list of '
                         '{"role": ..., "content": ...} messages')
    # 1. a system message joins the first user message, as in nanochat; the numbers in
    # the errors still count it
    offset = 0
    if messages[0].get("role") == "system":
        if (len(messages) < 2 or messages[1].get("role") != "user"
                or not all(isinstance(message.get("content"), str)
                           for message in messages[:2])):
            raise ValueError("a system message must be a string followed by a user "
                             "message (a string)")
        text = messages[0]["content"] + "\n\n" + messages[1]["content"]
        messages = [{"role": "user", "content": text}] + messages[2:]
        offset = 1
    # 2. the roles alternate, and every message has some text
    for i, message in enumerate(messages):
        role = message.get("role")
        content = message.get("content")
        expected = ("user", "assistant")[i % 2]
        if role != expected:
            raise ValueError(f"message {i + offset} has role {role!r} where "
                             f"{expected!r} is due: roles must alternate user, "
                             "assistant, ... after an optional system message")
        # only an assistant's content may be a list of parts
        if role == "assistant" and isinstance(content, list):
            parts = content
        else:
            parts = [{"type": "text", "text": content}]
        well_formed = all(isinstance(part, dict) and part.get("type") in PARTS
                          and isinstance(part.get("text"), str) for part in parts)
        if not well_formed:
            raise ValueError(f"message {i + offset}: content must be a string "
                             "(assistant: or a list of "
                             f"{{'type': one of {PARTS}, 'text': str}} parts)")
        if not parts or not "".join(part["text"] for part in parts).strip():
            raise ValueError(f"message {i + offset} ({role}) is empty; "
                             "give it some text or drop the turn")
    return messages


def render_conversation(tok, messages, max_tokens=2048):
    """(ids, mask) of a conversation as nanochat renders it; mask 1 where it trains."""
    sp = tok.special
    ids = []
    mask = []

    def add(token_ids, supervised):
        ids.extend(token_ids)
        mask.extend([supervised] * len(token_ids))

    add([tok.bos], 0)
    for message in _checked(messages):
        content = message["content"]
        if message["role"] == "user":
            add([sp["<|user_start|>"], *tok.encode(content), sp["<|user_end|>"]], 0)
            continue
        # the assistant is trained on what it writes: its text, its tool calls, its end
        add([sp["<|assistant_start|>"]], 0)
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for part in parts:
            part_ids = tok.encode(part["text"])
            if part["type"] == "text":
                add(part_ids, 1)
            elif part["type"] == "python":
                add([sp["<|python_start|>"], *part_ids, sp["<|python_end|>"]], 1)
            else:  # the tool's output is forced in at inference: not supervised
                add([sp["<|output_start|>"], *part_ids, sp["<|output_end|>"]], 0)
        add([sp["<|assistant_end|>"]], 1)
    # cropped after rendering, as nanochat crops
    return ids[:max_tokens], mask[:max_tokens]


def render_for_completion(tok, messages):
    """Prompt ids for generation: the conversation without its last assistant message,
    then <|assistant_start|>."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant":
        raise ValueError("render_for_completion needs a conversation ending in the "
                         "assistant message to replace")
    ids, _ = render_conversation(tok, messages[:-1])
    return ids + [tok.special["<|assistant_start|>"]]


def reply_stops(tok):
    """The ids that end a reply: <|assistant_end|>, or <|bos|> (a new document)."""
    return (tok.special["<|assistant_end|>"], tok.bos)


def load_conversations(path):
    """Conversations of a .jsonl file in nanochat's CustomJSON form: a list a line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such conversations file (.jsonl, "
                                "one JSON list of messages a line)")
    conversations = []
    for lineno, messages in json_lines(path, "a JSON list of messages"):
        try:
            _checked(messages)
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
        conversations.append(messages)
    if not conversations:
        raise ValueError(f"{path}: no conversations in this file")
    return conversations

# --------------------------------------------------------------------------- calculator

# the arithmetic the calculator does; no ** (nanochat's filter refuses it too)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}


def _calc(node):
    """Evaluate a whitelisted ast: numbers, + - * / //, unary +-, "str".count("str")."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in (ast.UAdd, ast.USub):
        operand = _calc(node.operand)
        return -operand if isinstance(node.op, ast.USub) else +operand
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        left = _calc(node.left)
        right = _calc(node.right)
        # numbers only: a string times a large number would fill the memory
        if isinstance(left, str) or isinstance(right, str):
            raise ValueError("no arithmetic on strings")
        return OPS[type(node.op)](left, right)
    # the one call allowed: counting a substring
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "count" and len(node.args) == 1 and not node.keywords):
        text = _calc(node.func.value)
        sub = _calc(node.args[0])
        if isinstance(text, str) and isinstance(sub, str):
            return text.count(sub)
    raise ValueError("unsupported expression")


def use_calculator(expr):
    """nanochat's calculator tool: the value of arithmetic or of a "str".count("str")
    expression, else None."""
    # nanochat's character filters first: None wherever nanochat's gives None
    expr = expr.replace(",", "")
    is_math = all(c in "0123456789*+-/.() " for c in expr) and "**" not in expr
    allowed = string.ascii_letters + string.digits + "'\"()._ "
    is_count = all(c in allowed for c in expr) and ".count(" in expr
    if not (is_math or is_count):
        return None
    # then a whitelisted ast where nanochat calls eval: no other node can run
    try:
        value = _calc(ast.parse(expr.strip(), mode="eval").body)
        # the engine prints the value: ints past Python's 4300-digit limit raise here
        str(value)
        return value
    except (SyntaxError, ValueError, ArithmeticError, RecursionError, MemoryError):
        return None


def calculator_tool(tok):
    """nanochat's tool state machine for one generation: tool(row, token) -> the ids to
    force into that row next, <|output_start|>use_calculator(expr)<|output_end|> after
    <|python_start|>expr<|python_end|> (nothing when the calculator gives None)."""
    sp = tok.special
    exprs = {}  # row -> its ids since <|python_start|>, while a block is open

    def tool(row, token):
        if token == sp["<|python_start|>"]:
            exprs[row] = []
        elif row in exprs and token == sp["<|python_end|>"]:
            result = use_calculator(tok.decode(exprs.pop(row)))
            if result is not None:
                output = tok.encode(str(result))
                return [sp["<|output_start|>"], *output, sp["<|output_end|>"]]
        elif row in exprs:
            exprs[row].append(token)
        return []
    return tool
