"""The chat tasks, as nanochat's tasks/: what SFT and RL train on and what the
evaluations score.

- Our synthetic skills (identity, arithmetic, letter counting, spelling, reading a
  docstring), each question drawn from many phrasings over broad pools, so that a model
  learns to copy from the question, not a template; arithmetic and counting answer
  through the calculator; train and test draw from disjoint items (1 in 5 test).
- The SFT mixture: the tasks' train splits by fixed weights, and a pretraining document
  after every few conversations.
- Grading: exact match against a task's reference answer (`check`), and per skill for
  the hand-written questions of testdata/heldout_questions.jsonl (`grade`).
- nanochat's chat_eval datasets (ARC-Easy, ARC-Challenge, MMLU, GSM8K, HumanEval) from a
  local copy in Hugging Face's layout, rendered as nanochat renders them, and their
  checkers; the RL task set: our tasks or GSM8K, with their rewards.
docs/evaluations.md tells how the tasks are drawn and graded.
"""

import collections
import functools
import glob
import itertools
import os
import random
import re
import string

import numpy as np
import regex

import data
import execution

# ------------------------------------------------------------------ our synthetic tasks

TASKS = ("identity", "arithmetic", "counting", "spelling", "docstring")
# the SFT mixture's weights, per 13 conversations
MIXTURE = {"identity": 1, "arithmetic": 3, "counting": 2, "spelling": 5, "docstring": 2}

# the phrasings a question is drawn from: a greeting (none, mostly), then a frame
GREETINGS = ("",) * 6 + ("Hi! ", "Hello. ", "Hey there! ", "hi, ", "Good morning! ",
                         "Hello!\n", "Quick question: ", "Hey, ", "Please help. ")
IDENTITY = ("I'm nanochat, a small language model trained from scratch on Python "
            "documentation and a few synthetic tasks by the person who ran this pure "
            "JAX port of Andrej Karpathy's nanochat.")
WHO = ("Who are you?", "What are you?", "What is your name?", "What's your name?",
       "Your name?", "Introduce yourself.", "Tell me about yourself.",
       "Are you a person?", "Are you human?", "Are you a robot?", "Are you an AI?",
       "What should I call you?", "Are you ChatGPT?", "Are you Siri?", "Are you GPT-4?",
       "Which model are you?", "What kind of assistant are you?", "Do you have a name?",
       "Tell me your name.", "What am I talking to?", "Who am I talking to?",
       "Identify yourself.", "Say who you are.", "What is this bot?",
       "Which AI is this?", "What do they call you?", "Describe yourself.",
       "What exactly are you?", "Can you tell me who you are?", "Who is this?",
       "What model is this?", "Is this a chatbot?", "Are you a language model?",
       "Hi, who's there?", "Who made you?", "Who built you?", "Who trained you?",
       "Who created you?", "Where do you come from?", "How were you made?",
       "Who is your creator?", "Who developed you?", "Which company made you?",
       "Who programmed you?", "How were you trained?", "Who wrote you?",
       "Who designed you?", "Who owns you?", "What were you trained on?",
       "Who is behind you?", "Who invented you?", "Who's your developer?",
       "Who are your makers?", "How did you learn?", "Who taught you?",
       "What data were you trained on?")
# identity: a question to the model, or about it by a name
ABOUT = (  # (a name for the model, questions about it)
    ("this model", "this assistant", "the model I'm talking to", "this chatbot",
     "the AI I'm chatting with", "this bot", "the assistant here"),
    ("Who made {}?", "Who trained {}?", "Who built {}?", "Which team created {}?",
     "What is {} called?", "What is the name of {}?", "Which company built {}?",
     "Who is responsible for {}?", "Where does {} come from?", "What kind of AI is {}?",
     "How was {} trained?", "What was {} trained on?", "Tell me about {}."))
# arithmetic: a way to say the operation in a question (ASK) or an order (DO), or the
# two numbers first (PAIR)
ASK = ("What is {}?", "What's {}?", "what is {}", "Calculate {}.", "Compute {}.",
       "How much is {}?", "{} = ?", "{}=?", "{}?", "{}", "Solve {}.", "Evaluate {}.",
       "Please work out {}.", "Can you tell me {}?", "Could you calculate {} for me?",
       "I need to know {}.", "Find {}.", "Tell me {}.", "What do you get for {}?",
       "Work out {}", "What does {} equal?", "What is the value of {}?", "Give me {}.",
       "{} equals what?")
PAIR = {  # the two numbers first, the operation after
    "+": ("Take {0} and {1} and add them.", "What do {0} and {1} add up to?",
          "{0} and {1}: what is their sum?", "If you add {0} and {1}, what do you get?",
          "What do you get when you add {1} to {0}?"),
    "-": ("Start with {0} and take away {1}.",
          "If you subtract {1} from {0}, what do you get?",
          "{0} and {1}: what is their difference?",
          "What is left when you take {1} from {0}?",
          "I had {0}, I lost {1}."),
    "*": ("Take {0} and {1} and multiply them.", "{0} and {1}: what is their product?",
          "If you multiply {0} by {1}, what do you get?",
          "What do you get when {0} is multiplied by {1}?"),
    "/": ("{0} and {1}: what is their quotient?",
          "If you divide {0} by {1}, what do you get?",
          "How many times does {1} go into {0}?",
          "What do you get when {0} is divided by {1}?",
          "Share {0} equally among {1}: how much each?"),
}
DO = ("{}.", "Please {}.", "Can you {}?", "{}, please.", "Could you {} for me?",
      "I want you to {}.", "{} and tell me the result.", "{}?", "Help me {}.")
ARITH = {  # op -> (ways to say a op b, imperatives); {0} is a, {1} is b
    "+": (("{0}+{1}", "{0} + {1}", "{0} plus {1}", "the sum of {0} and {1}",
           "{0} added to {1}", "{0} and {1} together"),
          ("add {0} and {1}", "add {0} to {1}", "sum {0} and {1}",
           "add up {0} and {1}")),
    "-": (("{0}-{1}", "{0} - {1}", "{0} minus {1}", "the difference between {0} and {1}",
           "{1} subtracted from {0}", "{0} take away {1}", "{0} less {1}"),
          ("subtract {1} from {0}", "take {1} away from {0}", "take away {1} from {0}",
           "deduct {1} from {0}")),
    "*": (("{0}*{1}", "{0} * {1}", "{0} x {1}", "{0} times {1}", "{0} multiplied by {1}",
           "the product of {0} and {1}"),
          ("multiply {0} by {1}", "multiply {0} and {1}", "multiply {0} times {1}")),
    "/": (("{0}/{1}", "{0} / {1}", "{0} divided by {1}", "the quotient of {0} and {1}",
           "{0} over {1}"),
          ("divide {0} by {1}", "split {0} into {1} equal parts",
           "divide {0} into {1} parts")),
}
# counting and spelling: the frames, then the ways to quote the letter and the word
COUNT = ("How many {c} are in {w}?", "How many {c} are there in {w}?",
         "How many times does {c} appear in {w}?",
         "How many times does {c} occur in {w}?", "Count the {c} in {w}.",
         "Count how many {c} {w} has.", "In {w}, how many {c} are there?",
         "How often does {c} appear in {w}?", "What is the number of {c} in {w}?",
         "{w}: how many {c}?", "Tell me how many {c} {w} contains.",
         "How many {c} does {w} have?", "Count {c} in {w}", "Number of {c} in {w}?",
         "How many {c} can you find in {w}?",
         "The word is {w}. How many {c} does it have?", "{w}: count the {c} in it.",
         "Take {w}. How many {c} in it?",
         "Look at {w}. How many times does {c} appear in it?",
         "I have a word, {w}. Count its {c}.")
LETTER = ("{}", "'{}'", '"{}"', "{}'s", "the letter {}", "the letter '{}'", "letter {}",
          "{}s")
SPELL = ("Spell {w}.", "How do you spell {w}?", "Spell {w} letter by letter.",
         "Can you spell {w} for me?", "Spell out {w}.", "spell: {w}",
         "What are the letters of {w}?", "How is {w} spelled?", "Please spell {w}.",
         "Write {w} one letter at a time.", "Break {w} into letters.",
         "Give me the spelling of {w}.", "What is the spelling of {w}?",
         "{w} - spell it", "Letters in {w}?", "Spell {w} for me, letter by letter.",
         "{w}: spell it.", "The word is {w}. Spell it.",
         "Here is a word: {w}. How is it spelled?", "{w}. Spell that for me.",
         "Take the word {w} and spell it out.",
         "I have a word, {w}. What are its letters?", "{w}? Spell it, please.")
WORD = ("{}", "{}", "'{}'", '"{}"', "the word {}", "the word '{}'")


def _ask(rng, frame, *slots):
    """A user message: maybe a greeting, the frame's case and end punctuation varied,
    the slots filled in."""
    text = rng.choice(GREETINGS) + frame
    # 1. the case: lower, upper, capitalized, or as written
    draw = rng.random()
    if draw < 0.15:
        text = text.lower()
    elif draw < 0.18:
        text = text.upper()
    elif draw < 0.6:
        text = text[:1].upper() + text[1:]
    # 2. the end punctuation, now and then dropped or doubled
    if text[-1:] in "?.!" and rng.random() < 0.25:
        text = text[:-1] + rng.choice(("", "", "!", "??", " ?"))
    return text.format(*slots)


def _number(rng):
    # short operands common, as people ask
    digits = rng.choices((1, 2, 3, 4), (4, 4, 2, 1))[0]
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10 ** digits - 1)


@functools.cache
def _corpus_words():
    """Real English (and Python) words of the docstrings, about 4,000."""
    words = collections.Counter(w for _, _, doc in data.stdlib_docstrings()
                                for w in regex.findall(r"\b[a-z]{3,10}\b", doc))
    return sorted(w for w, n in words.items() if n >= 2)


# made-up words: syllables of an onset, a vowel and a coda (none, often)
ONSETS = ("", "", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "st",
          "ch", "w", "k")
CODAS = ("", "", "r", "n", "s", "ll", "ss", "tt", "rr", "pp", "ck", "m", "ng")


def _syllable(rng):
    """A made-up syllable: an onset, a vowel (doubled one time in four), a coda."""
    onset = rng.choice(ONSETS)
    vowel = rng.choice("aeiouy") * rng.choice((1, 1, 1, 2))
    return onset + vowel + rng.choice(CODAS)


def _word(rng):
    """A word: from the corpus, made up (syllables, doubled letters common) or random
    letters; then one letter doubled in a word in four, since doubled letters are where
    a small model's copying slips."""
    draw = rng.random()
    if draw < 0.55:
        word = rng.choice(_corpus_words())
    elif draw < 0.9:
        count = rng.randint(1, 4)
        word = "".join(_syllable(rng) for _ in range(count))
        word = word[:10].ljust(3, "s")
    else:
        length = rng.randint(3, 10)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
    if len(word) < 10 and rng.random() < 0.25:
        i = rng.randrange(len(word))
        word = word[:i + 1] + word[i:]
    return word


def _chat(question, answer):
    return [{"role": "user", "content": question},
            {"role": "assistant", "content": answer}]


def _tool_answer(expr, text):
    """Assistant parts: a calculator call, its output, then a sentence that ends in the
    result."""
    out = data.use_calculator(expr)
    # a whole float shown as an int: 12.0 is 12
    shown = str(int(out)) if isinstance(out, float) and out.is_integer() else str(out)
    return [{"type": "python", "text": expr},
            {"type": "python_output", "text": str(out)},
            {"type": "text", "text": text.format(shown)}]


def _identity(rng):
    while True:
        if rng.random() < 0.5:
            question = rng.choice(WHO)
        else:
            question = rng.choice(ABOUT[1]).format(rng.choice(ABOUT[0]))
        yield question, _chat(_ask(rng, question), IDENTITY)


def _arithmetic(rng):
    while True:
        # 1. the operation and its operands
        op = rng.choice("++--**/")
        a = _number(rng)
        b = _number(rng)
        if op == "/":  # exact divisions: a = b * quotient, of four digits at most
            b = max(1, b % 100)
            a = b * min(_number(rng), 9999 // b)
        # 2. the question: asked, ordered, or the numbers first
        asks, dos = ARITH[op]
        draw = rng.random()
        if draw < 0.6:
            frame = rng.choice(ASK).format(rng.choice(asks))
        elif draw < 0.85:
            frame = rng.choice(DO).format(rng.choice(dos))
        else:
            frame = rng.choice(PAIR[op])
        # 3. the answer through the calculator
        answer = _tool_answer(f"{a}{op}{b}", f"{a} {op} {b} = {{}}")
        yield f"{a}{op}{b}", _chat(_ask(rng, frame, a, b), answer)


def _counting(rng):
    while True:
        word = _word(rng)
        # a letter of the word, mostly
        if rng.random() < 0.85:
            letter = rng.choice(word)
        else:
            letter = rng.choice(string.ascii_lowercase)
        frame = rng.choice(COUNT).replace("{c}", "{0}").replace("{w}", "{1}")
        letter_said = rng.choice(LETTER).format(letter)
        word_said = rng.choice(WORD).format(word)
        question = _ask(rng, frame, letter_said, word_said)
        expr = f"'{word}'.count('{letter}')"
        answer = _tool_answer(expr, f"'{letter}' appears {{}} time(s) in '{word}'.")
        yield word, _chat(question, answer)


def _spelling(rng):
    while True:
        word = _word(rng)
        frame = rng.choice(SPELL).replace("{w}", "{}")
        question = _ask(rng, frame, rng.choice(WORD).format(word))
        yield word, _chat(question, "-".join(word))


@functools.cache
def _docstrings():
    """(name, first paragraph, its first sentence) of public stdlib functions whose
    docstring's first paragraph is short."""
    out = []
    for name, kind, doc in data.stdlib_docstrings():
        # the first paragraph on one line, and its first sentence
        para = " ".join(doc.split("\n\n")[0].split())
        first = regex.match(r"(.+?[.!?])(\s|$)", para)
        public = kind == "function" and "._" not in name
        if public and first and len(para) <= 200 and 20 <= len(first.group(1)):
            out.append((name, para, first.group(1)))
    return out


# reading: the docstring's first paragraph in the question, its first sentence asked for
DOCSTRING_FRAMES = (
    'Here is the docstring of {0}:\n"""{1}"""\nWhat does {0} do, in one sentence?',
    '{0}: """{1}"""\nSummarize what {0} does in one sentence.',
    "Docstring of {0}: {1}\nIn one sentence, what does it do?",
    'def {0}(...):\n    """{1}"""\nWhat is the first sentence of this docstring?',
    "Read this and tell me what {0} does in one sentence: {1}")


def _docstring(rng):
    """Reading: a function's docstring paragraph is in the question, the answer its
    first sentence."""
    while True:
        name, para, sentence = rng.choice(_docstrings())
        question = _ask(rng, rng.choice(DOCSTRING_FRAMES), name, para)
        yield name, _chat(question, sentence)


def recall_conversations(split):
    """Docstring questions answered from memory (the docstring is not in the prompt),
    for bits per byte only: recalling an unseen function's first sentence is more than a
    1M-parameter model can learn."""
    return [_chat(f"What does {name} do?", sentence)
            for name, _, sentence in _docstrings()
            if data.holdout(f"docstring/{name}", 20) == (split == "test")]


def task_conversations(task, split, seed=0):
    """Endless conversations of one synthetic task; 'train' and 'test' draw from
    disjoint items."""
    makers = {"identity": _identity,
              "arithmetic": _arithmetic,
              "counting": _counting,
              "spelling": _spelling,
              "docstring": _docstring}
    if task not in makers or split not in ("train", "test"):
        raise ValueError(f"unknown task {task!r} or split {split!r}: tasks are {TASKS}, "
                         "splits 'train' and 'test'")
    # an item's key decides its split: 1 in 5 held out for test (data.holdout)
    items = makers[task](random.Random(f"{task}/{split}/{seed}"))
    return (messages for key, messages in items
            if data.holdout(f"{task}/{key}", 20) == (split == "test"))


def sft_mixture(seed=0, extra=(), documents=None, text_every=8):
    """epoch -> SFT items: any user conversations (`extra`), then the tasks' train
    splits drawn by MIXTURE's weights, with a pretraining document (a str, trained on
    whole) after every `text_every` conversations when `documents` (epoch -> texts) is
    given."""
    def items(epoch):
        rng = random.Random(f"mixture/{seed}/{epoch}")
        names = list(MIXTURE)
        streams = [task_conversations(name, "train", seed=seed + 1000 * epoch)
                   for name in names]
        # a pretraining document after every text_every conversations, if any
        docs = None
        if documents and text_every:
            docs = itertools.chain.from_iterable(documents(1000 * epoch + k)
                                                 for k in itertools.count())
        # the user's conversations first, then the tasks by their weights
        yield from extra
        for i in itertools.count(1):
            pick = rng.choices(range(len(names)), MIXTURE.values())[0]
            yield next(streams[pick])
            if docs is not None and i % text_every == 0:
                yield next(docs)
    return items

# ------------------------------------------------------------------------------ grading


def _final_answer(text, numeric):
    """The text after the last calculator output; numeric: its last number, as a
    float."""
    after = text.rsplit("<|output_end|>", 1)[-1]
    text = after.replace("<|assistant_end|>", "").strip()
    if not numeric:
        return text
    numbers = regex.findall(r"-?\d+(?:\.\d+)?", text)
    return float(numbers[-1]) if numbers else None  # as a number: 12.0 is 12


def check(messages, generated):
    """Exact match of a decoded completion with a task conversation's last (reference)
    message: the last number of the final text if the reference calls the calculator,
    else the whole text."""
    ref = messages[-1]["content"]
    if isinstance(ref, str):
        return _final_answer(generated, False) == ref.strip()
    got = _final_answer(generated, True)
    return got is not None and got == _final_answer(ref[-1]["text"], True)


def load_questions(path):
    """Hand-written questions of a .jsonl file, a line each: {"skill": one of TASKS but
    docstring, "question", "answer"}."""
    rows = []
    for n, row in data.json_lines(path, "a JSON object"):
        # a dict whose question and answer are strings
        ok = isinstance(row, dict) and all(isinstance(row.get(k), str)
                                           for k in ("question", "answer"))
        if not ok or row.get("skill") not in TASKS[:4]:
            raise ValueError(f'{path}:{n}: want {{"skill": one of {TASKS[:4]}, '
                             '"question": str, "answer": str}')
        rows.append(row)
    return rows


def grade(skill, answer, generated):
    """Whether a decoded completion answers a hand-written question: the last number of
    the final text for arithmetic and counting, its letters for spelling, the answer
    named for identity."""
    text = _final_answer(generated, False)
    if skill in ("arithmetic", "counting"):
        return _final_answer(generated, True) == float(answer)
    if skill == "spelling":
        return "".join(regex.findall(r"[a-z]", text.lower())) == answer.lower()
    return answer.lower() in text.lower()

# -------------------------------------------------------- nanochat's chat_eval datasets

# nanochat's chat_eval tasks: (Hugging Face dataset, its subset, centring baseline)
CHAT_TASKS = {
    "ARC-Easy": ("allenai/ai2_arc", "ARC-Easy", 0.25),
    "ARC-Challenge": ("allenai/ai2_arc", "ARC-Challenge", 0.25),
    "MMLU": ("cais/mmlu", "all", 0.25),
    "GSM8K": ("openai/gsm8k", "main", 0.0),
    "HumanEval": ("openai/openai_humaneval", "openai_humaneval", 0.0),
}
GSM_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def render_mc(question, letters, choices):
    """nanochat's multiple-choice prompt: each choice followed by =letter (no space: the
    reply is the bare letter)."""
    lines = "".join(f"- {c}={letter}\n" for letter, c in zip(letters, choices))
    return (f"Multiple Choice question: {question}\n{lines}"
            "\nRespond only with the letter of the correct answer.")


def gsm8k_parts(answer):
    """A GSM8K solution as assistant parts: each <<expr=result>> a calculator call, its
    output."""
    parts = []
    for piece in re.split(r"(<<[^>]+>>)", answer):
        if not (piece.startswith("<<") and piece.endswith(">>")):
            parts.append({"type": "text", "text": piece})
            continue
        # a call: expr=result, or an expression alone (no output)
        call = piece[2:-2]
        expr, result = call, ""
        if "=" in piece:
            expr, _, result = call.rpartition("=")
        parts += [{"type": "python", "text": expr},
                  {"type": "python_output", "text": result}]
    return parts


def chat_conversation(name, row):
    """A dataset row (Hugging Face's fields) as nanochat's task conversation:
    {"messages": the question and the reference answer, "letters": a categorical task's
    choices}, and HumanEval's test and entry point."""
    letters = None
    extra = {}
    # ARC: the choices' labels as letters (AI2's .jsonl nests them in the question)
    if name.startswith("ARC"):
        if isinstance(row["question"], dict):
            choices = row["question"]["choices"]
            row = {"question": row["question"]["stem"],
                   "answerKey": row["answerKey"],
                   "choices": {k: [c[k] for c in choices] for k in ("text", "label")}}
        letters = row["choices"]["label"]
        question = render_mc(row["question"], letters, row["choices"]["text"])
        answer = row["answerKey"]
    # MMLU: four choices, the answer an index
    elif name == "MMLU":
        letters = ("A", "B", "C", "D")
        question = render_mc(row["question"], letters, row["choices"])
        answer = letters[row["answer"]]
    # GSM8K: the solution with its calculator calls
    elif name == "GSM8K":
        question = row["question"]
        answer = gsm8k_parts(row["answer"])
    else:  # HumanEval: the prompt completed by the canonical solution
        question = row["prompt"]
        answer = f"{row['prompt']}\n{row['canonical_solution']}"
        extra = {"test": row["test"], "entry_point": row["entry_point"]}
    if letters is not None and answer not in letters:
        raise ValueError(f"the answer {answer!r} is not one of the letters "
                         f"{list(letters)}")
    return {"messages": _chat(question, answer), "letters": letters, **extra}


def _rows(path):
    """The rows of a .parquet (needs pyarrow) or .jsonl file, as dicts."""
    if not path.endswith(".parquet"):
        return [row for _, row in data.json_lines(path, "a JSON object")]
    try:
        import pyarrow.parquet as pq  # optional, as for nanochat's pretraining shards
    except ImportError:
        raise ImportError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow "
                          "(or pass .jsonl)") from None
    return pq.read_table(path).to_pylist()


def load_chat_task(root, name, split="test"):
    """Task `name`'s conversations from the split's .parquet or .jsonl files under
    root/<dataset>/<subset>/ (a Hugging Face snapshot's layout), in nanochat's order
    (shuffled by numpy's default_rng(42))."""
    # 1. the split's files
    repo, subset, _ = CHAT_TASKS[name]
    folder = os.path.join(root, repo.split("/")[1], subset)
    files = sorted(f for ext in ("parquet", "jsonl")
                   for f in glob.glob(os.path.join(folder, f"{split}*.{ext}")))
    if not files:
        raise FileNotFoundError(f"{folder}: no {split}*.parquet or {split}*.jsonl; get "
                                f"them with `huggingface-cli download {repo} "
                                "--repo-type dataset --local-dir "
                                f"{os.path.dirname(folder)}`")
    # 2. their rows in nanochat's order, each as a conversation
    rows = [row for f in files for row in _rows(f)]
    convs = []
    for i in np.random.default_rng(42).permutation(len(rows)):
        try:
            convs.append(chat_conversation(name, rows[i]))
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
            what = str(e) or type(e).__name__
            if isinstance(e, KeyError):
                what = f"no field {e}"
            raise ValueError(f"{folder}: row {i}: {what}; want the layout of Hugging "
                             f"Face's {repo}") from None
    return convs


def load_chat_tasks(root, max_problems=-1, names=tuple(CHAT_TASKS), log=print):
    """{name: its first max_problems test conversations} of the ChatCORE tasks found
    under root; one line names the missing ones and how to get them."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such directory; it should hold the "
                                "ChatCORE datasets (docs/evaluations.md)")
    found = {}
    missing = []  # how to get each missing task
    for name in names:
        try:
            convs = load_chat_task(root, name)
        except FileNotFoundError as e:
            missing.append(str(e).split("; ", 1)[1])
            continue
        found[name] = convs[:max_problems if max_problems > 0 else None]
    if not found:
        raise FileNotFoundError(f"{root}: none of the ChatCORE datasets; "
                                + "; ".join(missing))
    if missing:
        log(f"ChatCORE needs all 5 tasks; {len(missing)} missing: " + "; ".join(missing))
    return found


def gsm8k_answer(text):
    """The number after '####' (GSM8K's answer line), commas dropped, or None."""
    found = GSM_RE.search(text)
    return found.group(1).strip().replace(",", "") if found else None


def humaneval_program(conversation, completion):
    """HumanEval's test program: the prompt's imports, the completion's code (its first
    ``` block, if any), the task's tests and check(entry_point)."""
    # 1. the imports at the top of the prompt
    imports = []
    for line in conversation["messages"][0]["content"].split("\n"):
        if line.strip().startswith(("import ", "from ")):
            imports.append(line.strip())
        elif line.strip() and not line.strip().startswith("#"):
            break
    # 2. the completion's code, its tests, the call that runs them
    blocks = re.findall(r"```(?:python)?\s*\n(.*?)\n```", completion, re.DOTALL)
    code = blocks[0].strip() if blocks else completion.strip()
    test = conversation["test"]
    entry = conversation["entry_point"]
    return "\n".join(imports) + f"\n\n{code}\n\n{test}\ncheck({entry})"


def gsm8k_correct(messages, completion):
    """GSM8K's check (and RL reward): the completion's '####' number equals the
    reference's."""
    reference = messages[-1]["content"][-1]["text"]
    return gsm8k_answer(completion) == gsm8k_answer(reference)


def chat_check(name, conversation, completion):
    """nanochat's task.evaluate: whether a decoded completion solves the task."""
    if name == "GSM8K":
        return gsm8k_correct(conversation["messages"], completion)
    if name == "HumanEval":
        program = humaneval_program(conversation, completion)
        return execution.run_program(program)[0]
    return completion == conversation["messages"][-1]["content"]

# ------------------------------------------------------------------------ RL's task set


def rl_tasks(names, seed, chat_data=None, fits=lambda messages: True):
    """{task: (train(step, count) -> that step's conversations, test() -> test
    conversations, reward(conversation, completion), train size or None)}. Our tasks
    draw from streams seeded by (seed, step), so a resumed run samples the same prompts;
    GSM8K (from chat_data) walks its shuffled train split in order as nanochat's chat_rl
    does, keeping the prompts that `fits`."""
    # 1. ours: a stream per step
    def ours(task):
        def train(step, count):
            stream = task_conversations(task, "train", seed=f"{seed}/rl{step}")
            return list(itertools.islice(stream, count))
        return train, lambda: task_conversations(task, "test"), check, None
    out = {name: ours(name) for name in names if name != "gsm8k"}
    if "gsm8k" not in names:
        return out
    # 2. GSM8K: its splits' questions that fit, the train split walked round and round
    if not chat_data:
        raise FileNotFoundError("--rl-tasks gsm8k reads GSM8K from --chat-data DIR "
                                "(docs/evaluations.md)")

    def fitting(split):
        convs = load_chat_task(chat_data, "GSM8K", split)
        return [c["messages"] for c in convs if fits(c["messages"])]
    train = fitting("train")
    test = fitting("test")
    if not train:
        raise ValueError("no GSM8K question fits in the model's context")

    def gsm8k_train(step, count):
        return [train[(step * count + i) % len(train)] for i in range(count)]
    out["gsm8k"] = (gsm8k_train, lambda: iter(test), gsm8k_correct, len(train))
    return out
