"""The chat tasks, as nanochat's tasks/: what SFT and RL train on and what the
evaluations score.

- Our synthetic skills (identity, arithmetic, letter counting, spelling, reading a
  docstring), each question drawn from many phrasings (greetings, case, end punctuation,
  quotes, operator symbols, words and verbs such as "subtract 4 from 20", questions and
  imperatives) over broad pools (operands of 1-4 digits, short ones common; words from
  the corpus and made-up words with doubled letters), so that a model learns to copy
  from the question, not a template. Arithmetic and counting answer through the
  calculator. Train and test draw from disjoint items (1 in 5 test).
- The SFT mixture: the tasks' train splits by fixed weights, and a pretraining document
  after every few conversations so that SFT keeps what pretraining taught.
- Grading: exact match against a task's reference answer (`check`), and per skill for
  the hand-written questions of testdata/heldout_questions.jsonl (`grade`), which were
  written apart from the generators and are never trained on.
- nanochat's chat_eval datasets (ARC-Easy, ARC-Challenge, MMLU, GSM8K, HumanEval) read
  from a local copy in Hugging Face's layout, rendered as nanochat renders them, and
  their checkers.
- The RL task set: our tasks or GSM8K, with their rewards.
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
MIXTURE = {"identity": 1, "arithmetic": 3, "counting": 2, "spelling": 5, "docstring": 2}  # per 13

GREETINGS = ("",) * 6 + ("Hi! ", "Hello. ", "Hey there! ", "hi, ", "Good morning! ", "Hello!\n",
                         "Quick question: ", "Hey, ", "Please help. ")
IDENTITY = ("I'm nanochat, a small language model trained from scratch on Python documentation "
            "and a few synthetic tasks by the person who ran this pure JAX port of Andrej "
            "Karpathy's nanochat.")
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
ABOUT = (  # (a name for the model, questions about it)
    ("this model", "this assistant", "the model I'm talking to", "this chatbot",
     "the AI I'm chatting with", "this bot", "the assistant here"),
    ("Who made {}?", "Who trained {}?", "Who built {}?", "Which team created {}?",
     "What is {} called?", "What is the name of {}?", "Which company built {}?",
     "Who is responsible for {}?", "Where does {} come from?", "What kind of AI is {}?",
     "How was {} trained?", "What was {} trained on?", "Tell me about {}."))
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
    "-": ("Start with {0} and take away {1}.", "If you subtract {1} from {0}, what do you get?",
          "{0} and {1}: what is their difference?", "What is left when you take {1} from {0}?",
          "I had {0}, I lost {1}."),
    "*": ("Take {0} and {1} and multiply them.", "{0} and {1}: what is their product?",
          "If you multiply {0} by {1}, what do you get?",
          "What do you get when {0} is multiplied by {1}?"),
    "/": ("{0} and {1}: what is their quotient?", "If you divide {0} by {1}, what do you get?",
          "How many times does {1} go into {0}?", "What do you get when {0} is divided by {1}?",
          "Share {0} equally among {1}: how much each?"),
}
DO = ("{}.", "Please {}.", "Can you {}?", "{}, please.", "Could you {} for me?",
      "I want you to {}.", "{} and tell me the result.", "{}?", "Help me {}.")
ARITH = {  # op -> (ways to say a op b, imperatives); {0} is a, {1} is b
    "+": (("{0}+{1}", "{0} + {1}", "{0} plus {1}", "the sum of {0} and {1}", "{0} added to {1}",
           "{0} and {1} together"),
          ("add {0} and {1}", "add {0} to {1}", "sum {0} and {1}", "add up {0} and {1}")),
    "-": (("{0}-{1}", "{0} - {1}", "{0} minus {1}", "the difference between {0} and {1}",
           "{1} subtracted from {0}", "{0} take away {1}", "{0} less {1}"),
          ("subtract {1} from {0}", "take {1} away from {0}", "take away {1} from {0}",
           "deduct {1} from {0}")),
    "*": (("{0}*{1}", "{0} * {1}", "{0} x {1}", "{0} times {1}", "{0} multiplied by {1}",
           "the product of {0} and {1}"),
          ("multiply {0} by {1}", "multiply {0} and {1}", "multiply {0} times {1}")),
    "/": (("{0}/{1}", "{0} / {1}", "{0} divided by {1}", "the quotient of {0} and {1}",
           "{0} over {1}"),
          ("divide {0} by {1}", "split {0} into {1} equal parts", "divide {0} into {1} parts")),
}
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
    q, r = rng.choice(GREETINGS) + frame, rng.random()
    if r < 0.15:
        q = q.lower()
    elif r < 0.18:
        q = q.upper()
    elif r < 0.6:
        q = q[:1].upper() + q[1:]
    if q[-1:] in "?.!" and rng.random() < 0.25:
        q = q[:-1] + rng.choice(("", "", "!", "??", " ?"))
    return q.format(*slots)


def _number(rng):
    digits = rng.choices((1, 2, 3, 4), (4, 4, 2, 1))[0]  # short operands common, as people ask
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


@functools.cache
def _corpus_words():
    """Real English (and Python) words of the docstrings, about 4,000."""
    words = collections.Counter(w for _, _, doc in data.stdlib_docstrings()
                                for w in regex.findall(r"\b[a-z]{3,10}\b", doc))
    return sorted(w for w, n in words.items() if n >= 2)


ONSETS = ("", "", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "st",
          "ch", "w", "k")
CODAS = ("", "", "r", "n", "s", "ll", "ss", "tt", "rr", "pp", "ck", "m", "ng")


def _word(rng):
    """A word: from the corpus, made up (syllables, doubled letters common) or random
    letters; then one letter doubled in a word in four, since doubled letters are where
    a small model's copying slips."""
    r = rng.random()
    if r < 0.55:
        w = rng.choice(_corpus_words())
    elif r < 0.9:
        syllables = (rng.choice(ONSETS) + rng.choice("aeiouy") * rng.choice((1, 1, 1, 2))
                     + rng.choice(CODAS) for _ in range(rng.randint(1, 4)))
        w = "".join(syllables)[:10].ljust(3, "s")
    else:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 10)))
    if len(w) < 10 and rng.random() < 0.25:
        i = rng.randrange(len(w))
        w = w[:i + 1] + w[i:]
    return w


def _chat(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def _tool_answer(expr, text):
    """Assistant parts: a calculator call, its output, then a sentence that ends in the
    result."""
    out = data.use_calculator(expr)
    shown = str(int(out)) if isinstance(out, float) and out.is_integer() else str(out)
    return [{"type": "python", "text": expr}, {"type": "python_output", "text": str(out)},
            {"type": "text", "text": text.format(shown)}]


def _identity(rng):
    while True:
        if rng.random() < 0.5:
            q = rng.choice(WHO)
        else:
            q = rng.choice(ABOUT[1]).format(rng.choice(ABOUT[0]))
        yield q, _chat(_ask(rng, q), IDENTITY)


def _arithmetic(rng):
    while True:
        op = rng.choice("++--**/")
        a, b = _number(rng), _number(rng)
        if op == "/":  # exact divisions: a = b * quotient, of four digits at most
            b = max(1, b % 100)
            a = b * min(_number(rng), 9999 // b)
        asks, dos = ARITH[op]
        r = rng.random()
        if r < 0.6:
            frame = rng.choice(ASK).format(rng.choice(asks))
        elif r < 0.85:
            frame = rng.choice(DO).format(rng.choice(dos))
        else:
            frame = rng.choice(PAIR[op])
        answer = _tool_answer(f"{a}{op}{b}", f"{a} {op} {b} = {{}}")
        yield f"{a}{op}{b}", _chat(_ask(rng, frame, a, b), answer)


def _counting(rng):
    while True:
        w = _word(rng)
        c = rng.choice(w) if rng.random() < 0.85 else rng.choice(string.ascii_lowercase)
        frame = rng.choice(COUNT).replace("{c}", "{0}").replace("{w}", "{1}")
        q = _ask(rng, frame, rng.choice(LETTER).format(c), rng.choice(WORD).format(w))
        answer = _tool_answer(f"'{w}'.count('{c}')", f"'{c}' appears {{}} time(s) in '{w}'.")
        yield w, _chat(q, answer)


def _spelling(rng):
    while True:
        w = _word(rng)
        q = _ask(rng, rng.choice(SPELL).replace("{w}", "{}"), rng.choice(WORD).format(w))
        yield w, _chat(q, "-".join(w))


@functools.cache
def _docstrings():
    """(name, first paragraph, its first sentence) of public stdlib functions whose
    docstring's first paragraph is short."""
    out = []
    for name, kind, doc in data.stdlib_docstrings():
        para = " ".join(doc.split("\n\n")[0].split())
        m = regex.match(r"(.+?[.!?])(\s|$)", para)
        public = kind == "function" and "._" not in name
        if public and m and len(para) <= 200 and 20 <= len(m.group(1)):
            out.append((name, para, m.group(1)))
    return out


DOCSTRING_FRAMES = ('Here is the docstring of {0}:\n"""{1}"""\nWhat does {0} do, in one sentence?',
                    '{0}: """{1}"""\nSummarize what {0} does in one sentence.',
                    "Docstring of {0}: {1}\nIn one sentence, what does it do?",
                    'def {0}(...):\n    """{1}"""\nWhat is the first sentence of this docstring?',
                    "Read this and tell me what {0} does in one sentence: {1}")


def _docstring(rng):
    """Reading: a function's docstring paragraph is in the question, the answer its
    first sentence."""
    while True:
        name, para, sentence = rng.choice(_docstrings())
        yield name, _chat(_ask(rng, rng.choice(DOCSTRING_FRAMES), name, para), sentence)


def recall_conversations(split):
    """Docstring questions answered from memory (the docstring is not in the prompt),
    for bits per byte only: recalling an unseen function's first sentence is more than a
    1M-parameter model can learn."""
    return [_chat(f"What does {name} do?", s) for name, _, s in _docstrings()
            if data.holdout(f"docstring/{name}", 20) == (split == "test")]


def task_conversations(task, split, seed=0):
    """Endless conversations of one synthetic task; 'train' and 'test' draw from
    disjoint items."""
    makers = {"identity": _identity, "arithmetic": _arithmetic, "counting": _counting,
              "spelling": _spelling, "docstring": _docstring}
    if task not in makers or split not in ("train", "test"):
        raise ValueError(f"unknown task {task!r} or split {split!r}: tasks are {TASKS}, splits "
                         "'train' and 'test'")
    items = makers[task](random.Random(f"{task}/{split}/{seed}"))
    return (messages for key, messages in items
            if data.holdout(f"{task}/{key}", 20) == (split == "test"))


def sft_mixture(seed=0, extra=(), documents=None, text_every=8):
    """epoch -> SFT items: any user conversations (`extra`), then the tasks' train
    splits drawn by MIXTURE's weights, with a pretraining document (a str, trained on
    whole) after every `text_every` conversations when `documents` (epoch -> texts) is
    given."""
    def items(epoch):
        rng, tasks = random.Random(f"mixture/{seed}/{epoch}"), list(MIXTURE)
        streams = [task_conversations(t, "train", seed=seed + 1000 * epoch) for t in tasks]
        docs = None
        if documents and text_every:
            docs = itertools.chain.from_iterable(documents(1000 * epoch + k)
                                                 for k in itertools.count())
        yield from extra
        for i in itertools.count(1):
            yield next(streams[rng.choices(range(len(tasks)), MIXTURE.values())[0]])
            if docs is not None and i % text_every == 0:
                yield next(docs)
    return items

# ------------------------------------------------------------------------------ grading


def _final_answer(text, numeric):
    """The text after the last calculator output; numeric: its last number, as a
    float."""
    text = text.rsplit("<|output_end|>", 1)[-1].replace("<|assistant_end|>", "").strip()
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
    for n, r in data.json_lines(path, "a JSON object"):
        ok = isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("question", "answer"))
        if not ok or r.get("skill") not in TASKS[:4]:
            raise ValueError(f'{path}:{n}: want {{"skill": one of {TASKS[:4]}, "question": str, '
                             '"answer": str}')
        rows.append(r)
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

CHAT_TASKS = {  # nanochat's chat_eval tasks: (Hugging Face dataset, its subset, centring baseline)
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
        if piece.startswith("<<") and piece.endswith(">>"):
            expr, _, result = piece[2:-2].rpartition("=") if "=" in piece else (piece[2:-2], "", "")
            parts += [{"type": "python", "text": expr}, {"type": "python_output", "text": result}]
        else:
            parts.append({"type": "text", "text": piece})
    return parts


def chat_conversation(name, row):
    """A dataset row (Hugging Face's fields) as nanochat's task conversation:
    {"messages": the question and the reference answer, "letters": a categorical task's
    choices}, and HumanEval's test and entry point."""
    letters, extra = None, {}
    if name.startswith("ARC"):
        if isinstance(row["question"], dict):  # AI2's own .jsonl: the choices inside the question
            choices = row["question"]["choices"]
            row = {"question": row["question"]["stem"], "answerKey": row["answerKey"],
                   "choices": {k: [c[k] for c in choices] for k in ("text", "label")}}
        letters = row["choices"]["label"]
        question = render_mc(row["question"], letters, row["choices"]["text"])
        answer = row["answerKey"]
    elif name == "MMLU":
        letters = ("A", "B", "C", "D")
        question = render_mc(row["question"], letters, row["choices"])
        answer = letters[row["answer"]]
    elif name == "GSM8K":
        question, answer = row["question"], gsm8k_parts(row["answer"])
    else:
        question, answer = row["prompt"], f"{row['prompt']}\n{row['canonical_solution']}"
        extra = {"test": row["test"], "entry_point": row["entry_point"]}
    if letters is not None and answer not in letters:
        raise ValueError(f"the answer {answer!r} is not one of the letters {list(letters)}")
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages, "letters": letters, **extra}


def _rows(path):
    """The rows of a .parquet (needs pyarrow) or .jsonl file, as dicts."""
    if not path.endswith(".parquet"):
        return [row for _, row in data.json_lines(path, "a JSON object")]
    try:
        import pyarrow.parquet as pq  # optional, as for nanochat's pretraining shards
    except ImportError:
        raise ImportError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow (or pass "
                          ".jsonl)") from None
    return pq.read_table(path).to_pylist()


def load_chat_task(root, name, split="test"):
    """Task `name`'s conversations from the split's .parquet or .jsonl files under
    root/<dataset>/<subset>/ (a Hugging Face snapshot's layout), in nanochat's order
    (shuffled by numpy's default_rng(42))."""
    repo, subset, _ = CHAT_TASKS[name]
    folder = os.path.join(root, repo.split("/")[1], subset)
    files = sorted(f for ext in ("parquet", "jsonl")
                   for f in glob.glob(os.path.join(folder, f"{split}*.{ext}")))
    if not files:
        raise FileNotFoundError(f"{folder}: no {split}*.parquet or {split}*.jsonl; get them with "
                                f"`huggingface-cli download {repo} --repo-type dataset --local-dir "
                                f"{os.path.dirname(folder)}`")
    rows, convs = [r for f in files for r in _rows(f)], []
    for i in np.random.default_rng(42).permutation(len(rows)):
        try:
            convs.append(chat_conversation(name, rows[i]))
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
            what = f"no field {e}" if isinstance(e, KeyError) else str(e) or type(e).__name__
            raise ValueError(f"{folder}: row {i}: {what}; want the layout of Hugging Face's "
                             f"{repo}") from None
    return convs


def load_chat_tasks(root, max_problems=-1, names=tuple(CHAT_TASKS), log=print):
    """{name: its first max_problems test conversations} of the ChatCORE tasks found
    under root; one line names the missing ones and how to get them."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: no such directory; it should hold the ChatCORE datasets "
                                "(docs/evaluations.md)")
    tasks, missing = {}, []
    for name in names:
        try:
            tasks[name] = load_chat_task(root, name)[:max_problems if max_problems > 0 else None]
        except FileNotFoundError as e:
            missing.append(str(e).split("; ", 1)[1])
    if not tasks:
        raise FileNotFoundError(f"{root}: none of the ChatCORE datasets; " + "; ".join(missing))
    if missing:
        log(f"ChatCORE needs all 5 tasks; {len(missing)} missing: " + "; ".join(missing))
    return tasks


def gsm8k_answer(text):
    """The number after '####' (GSM8K's answer line), commas dropped, or None."""
    m = GSM_RE.search(text)
    return m.group(1).strip().replace(",", "") if m else None


def humaneval_program(conversation, completion):
    """HumanEval's test program: the prompt's imports, the completion's code (its first
    ``` block, if any), the task's tests and check(entry_point)."""
    imports = []
    for line in conversation["messages"][0]["content"].split("\n"):
        if line.strip().startswith(("import ", "from ")):
            imports.append(line.strip())
        elif line.strip() and not line.strip().startswith("#"):
            break
    blocks = re.findall(r"```(?:python)?\s*\n(.*?)\n```", completion, re.DOTALL)
    code = blocks[0].strip() if blocks else completion.strip()
    test, entry = conversation["test"], conversation["entry_point"]
    return "\n".join(imports) + f"\n\n{code}\n\n{test}\ncheck({entry})"


def gsm8k_correct(messages, completion):
    """GSM8K's check (and RL reward): the completion's '####' number equals the
    reference's."""
    return gsm8k_answer(completion) == gsm8k_answer(messages[-1]["content"][-1]["text"])


def chat_check(name, conversation, completion):
    """nanochat's task.evaluate: whether a decoded completion solves the task."""
    if name == "GSM8K":
        return gsm8k_correct(conversation["messages"], completion)
    if name == "HumanEval":
        return execution.run_program(humaneval_program(conversation, completion))[0]
    return completion == conversation["messages"][-1]["content"]

# ------------------------------------------------------------------------ RL's task set


def rl_tasks(names, seed, chat_data=None, fits=lambda messages: True):
    """{task: (train(step, count) -> that step's conversations, test() -> test
    conversations, reward(conversation, completion), train size or None)}. Our tasks
    draw from streams seeded by (seed, step), so a resumed run samples the same prompts;
    GSM8K (from chat_data) walks its shuffled train split in order as nanochat's chat_rl
    does, keeping the prompts that `fits`."""
    def ours(t):
        def train(step, count):
            stream = task_conversations(t, "train", seed=f"{seed}/rl{step}")
            return list(itertools.islice(stream, count))
        return train, lambda: task_conversations(t, "test"), check, None
    out = {t: ours(t) for t in names if t != "gsm8k"}
    if "gsm8k" in names:
        if not chat_data:
            raise FileNotFoundError("--rl-tasks gsm8k reads GSM8K from --chat-data DIR "
                                    "(docs/evaluations.md)")
        train, test = ([c["messages"] for c in load_chat_task(chat_data, "GSM8K", split)
                        if fits(c["messages"])] for split in ("train", "test"))
        if not train:
            raise ValueError("no GSM8K question fits in the model's context")

        def gsm8k_train(step, count):
            return [train[(step * count + i) % len(train)] for i in range(count)]
        out["gsm8k"] = (gsm8k_train, lambda: iter(test), gsm8k_correct, len(train))
    return out
