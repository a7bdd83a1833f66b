"""The prompts an EAGLE-3 head is trained on here (studies/train_eagle3.py): text the
project ships, which the target then answers (the head learns what the target says).

For an instruct model, in its chat template, half chat and half code editing, as
studies/spec_decode.py measures them:

- chat: the questions of the bench's ShareGPT sample (bench/data), questions written
  here (a few forms over a list of topics, how-to requests, why-questions, pairs to
  compare), and the docs' paragraphs to explain;
- code: small functions written here and short functions of the project's packages to
  edit (a docstring, clearer names, type annotations, an empty input handled, a simpler
  body).

The head learns what the target says, so the more of its answers the better: at 88
answers its held-out acceptance stopped rising while its loss fell (docs/PERF.md).

None of studies/spec_decode.py's measured questions or snippets is among them; its
code edits are asked in other words. For a base model: the docs' paragraphs' first
third to continue.
"""

from __future__ import annotations

import ast
import glob
import random
import re

from bench.datasets import DEFAULT_SHAREGPT, load_sharegpt

CHAT_TASKS = [
    "Explain this to a new user in a few sentences:\n\n{text}",
    "Summarize the following in three bullet points:\n\n{text}",
]
CODE_TASKS = [
    "Add a docstring to this function and return the whole function:\n\n```python\n{text}\n```",
    "Rename the variables of this function to clearer names:\n\n```python\n{text}\n```",
    "Add type annotations to this function and show the full result:\n\n```python\n{text}\n```",
    "Make this function cope with an empty argument and show it in full:\n\n```python\n{text}\n```",
    "Simplify this function and return the whole function:\n\n```python\n{text}\n```",
]
QUESTION_FORMS = [
    "What is {}?",
    "Explain {} to a beginner.",
    "Give me three facts about {}.",
    "Write a short paragraph about {}.",
    "What are the advantages and disadvantages of {}?",
]
TOPICS = [
    "a binary search tree", "recursion", "a database index", "machine learning",
    "the French Revolution", "climate change", "the stock market", "a solar panel",
    "the human heart", "the moon landing", "an electric car", "coffee", "sleep",
    "regular exercise", "the Roman Empire", "a neural network", "version control with git",
    "a linked list", "unit testing", "the immune system", "gravity", "electricity",
    "the printing press", "a credit card", "renewable energy", "the ocean tides",
    "earthquakes", "a smartphone", "public transport", "meditation", "chess", "the piano",
    "a healthy breakfast", "time management", "the Great Wall of China", "a rainforest",
    "baking bread", "a job interview", "recycling", "open source software",
    "a regular expression", "a REST API", "the CPU of a computer", "encryption",
    "cloud computing",
    "photosynthesis", "a volcano", "the water cycle", "a black hole", "the internet",
    "an operating system", "a compiler", "a spreadsheet", "inflation", "a mortgage",
    "vitamins", "the Olympic Games", "jazz music", "a camera lens", "the printing of money",
    "a vaccine", "DNA", "a hurricane", "the Industrial Revolution", "a bicycle",
    "a garden compost heap", "a budget for a family", "a password manager", "a firewall",
    "a cache in a computer", "a startup company", "a library card", "the metric system",
    "a thermostat", "a microwave oven", "rainbows", "the speed of light", "a democracy",
    "the Renaissance", "a marathon", "yoga", "a good night's sleep", "a podcast",
    "social media", "a search engine", "a museum", "the desert", "honey bees", "a glacier",
    "the stock of a restaurant kitchen", "a sorting algorithm", "a queue in programming",
    "object-oriented programming", "a web server", "a container like Docker",
]  # fmt: skip
# how-to requests, why-questions and pairs to compare, in other words than the
# measured questions
HOW_TO = [
    "bake a simple loaf of bread", "learn a new language", "prepare for an exam",
    "start running", "save money each month", "write a cover letter", "plant a tree",
    "clean a laptop keyboard", "make a paper airplane", "cook rice on the stove",
    "keep a houseplant alive", "organize a small kitchen", "write a good commit message",
    "debug a Python program", "back up my photos", "set up a new router",
    "improve my handwriting", "plan a trip on a budget", "stay focused while studying",
    "make friends in a new city", "brew coffee with a French press", "change a bike tire",
    "speak in front of an audience", "read a nutrition label", "sort a list in Python",
]  # fmt: skip
HOW_FORMS = ["How do I {}?", "What is the best way to {}?", "Give me three tips to {}."]
WHY = [
    "Why do leaves change color in autumn?", "Why does ice float on water?",
    "Why do we dream?", "Why is the ocean salty?", "Why do cats purr?",
    "Why does bread go stale?", "Why do planes leave white trails in the sky?",
    "Why is exercise good for the brain?", "Why do computers need memory?",
    "Why do onions make you cry?", "Why does the moon change shape?",
    "Why do some programs run slowly?", "Why is sleep important for children?",
    "Why do birds migrate?", "Why is the Pacific Ocean called pacific?",
]  # fmt: skip
PAIRS = [
    ("a list", "a tuple in Python"), ("weather", "climate"), ("a virus", "a bacterium"),
    ("RAM", "a hard drive"), ("a compiler", "an interpreter"), ("TCP", "UDP"),
    ("a stock", "a bond"), ("speed", "velocity"), ("a crocodile", "an alligator"),
    ("HTTP", "HTTPS"), ("a library", "a framework"), ("SQL", "NoSQL databases"),
]  # fmt: skip
# small functions to edit, as the measured snippets are (none of theirs)
SMALL_FUNCTIONS = [
    "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result",
    "def reverse(s):\n    out = ''\n    for ch in s:\n        out = ch + out\n    return out",
    "def count_vowels(text):\n    n = 0\n    for ch in text:\n        if ch in 'aeiou':\n            n += 1\n    return n",
    "def largest(items):\n    best = items[0]\n    for x in items:\n        if x > best:\n            best = x\n    return best",
    "def average_length(words):\n    return sum(len(w) for w in words) / len(words)",
    "def first_word(sentence):\n    return sentence.split()[0]",
    "def join_names(names):\n    text = ''\n    for name in names:\n        text += name + ', '\n    return text[:-2]",
    "def squares(n):\n    out = []\n    for i in range(n):\n        out.append(i * i)\n    return out",
    "def is_palindrome(s):\n    return s == s[::-1]",
    "def count_words(path):\n    f = open(path)\n    n = len(f.read().split())\n    f.close()\n    return n",
    "def median(values):\n    values = sorted(values)\n    mid = len(values) // 2\n    return values[mid]",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a",
    "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32",
    "def flatten(lists):\n    out = []\n    for sub in lists:\n        for x in sub:\n            out.append(x)\n    return out",
    "def unique(items):\n    seen = []\n    for x in items:\n        if x not in seen:\n            seen.append(x)\n    return seen",
    "def word_counts(text):\n    counts = {}\n    for w in text.split():\n        counts[w] = counts.get(w, 0) + 1\n    return counts",
    "def last_line(path):\n    f = open(path)\n    lines = f.readlines()\n    f.close()\n    return lines[-1]",
    "def chunk(items, size):\n    return [items[i:i + size] for i in range(0, len(items), size)]",
    "def smallest_index(xs):\n    best = 0\n    for i in range(len(xs)):\n        if xs[i] < xs[best]:\n            best = i\n    return best",
    "def percent(part, whole):\n    return 100 * part / whole",
    "def capitalize_all(words):\n    out = []\n    for w in words:\n        out.append(w.capitalize())\n    return out",
    "def dot(a, b):\n    total = 0\n    for i in range(len(a)):\n        total += a[i] * b[i]\n    return total",
    "def initials(name):\n    return ''.join(part[0] for part in name.split())",
    "def even_numbers(xs):\n    out = []\n    for x in xs:\n        if x % 2 == 0:\n            out.append(x)\n    return out",
    "def load_config(path):\n    import json\n    f = open(path)\n    data = json.load(f)\n    f.close()\n    return data",
    "def range_of(xs):\n    return max(xs) - min(xs)",
    "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n        if xs[mid] == target:\n            return mid\n        if xs[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1",
    "def title_case(s):\n    words = s.split(' ')\n    return ' '.join(w[0].upper() + w[1:] for w in words)",
    "def total_price(cart):\n    total = 0\n    for item in cart:\n        total += item['price'] * item['qty']\n    return total",
]  # fmt: skip


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z]+", text.lower()))


def questions(excluded: list[str]) -> list[str]:
    """The ShareGPT sample's questions and the written ones, less any that starts
    like one of `excluded` (the measured questions)."""
    sample = [q for q, _ in load_sharegpt(DEFAULT_SHAREGPT)]
    written = [form.format(topic) for topic in TOPICS for form in QUESTION_FORMS]
    written += [form.format(task) for task in HOW_TO for form in HOW_FORMS]
    written += WHY + [f"What is the difference between {a} and {b}?" for a, b in PAIRS]
    stems = [_words(q) for q in excluded]
    return [q for q in sample + written if not any(_words(q).startswith(s) for s in stems)]


def paragraphs(limit: int) -> list[str]:
    """Prose paragraphs of docs/*.md (no tables, code or headings), 150-500 characters."""
    found = []
    for path in sorted(glob.glob("docs/*.md")):
        with open(path) as f:
            for block in f.read().split("\n\n"):
                block = block.strip()
                if 150 <= len(block) <= 500 and block[0].isalpha():
                    found.append(block)
    random.Random(0).shuffle(found)
    return found[:limit]


SOURCES = ["studies", "bench", "gateway", "backend_gpu", "backend_local", "engine_api", "tui"]


def functions(limit: int) -> list[str]:
    """Short functions of the project's packages, as written (the measured snippets'
    length)."""
    found = []
    for path in sorted(p for d in SOURCES for p in glob.glob(f"{d}/**/*.py", recursive=True)):
        with open(path) as f:
            source = f.read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                text = ast.get_source_segment(source, node) or ""
                if 100 <= len(text) <= 350:
                    found.append(text)
    random.Random(1).shuffle(found)
    return found[:limit]


def chat_ids(tokenizer, text: str) -> list[int]:
    """A user turn in the model's chat template, ready for the answer."""
    turn = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _texts(count: int, excluded: list[str]) -> tuple[list[str], list[str]]:
    """The chat and the code prompts' texts, each shuffled (prompts' order)."""
    rng = random.Random(2)
    chat = questions(excluded)
    chat += [rng.choice(CHAT_TASKS).format(text=p) for p in paragraphs(count)]
    code = [task.format(text=c) for c in SMALL_FUNCTIONS for task in CODE_TASKS]
    code += [rng.choice(CODE_TASKS).format(text=c) for c in functions(count)]
    rng.shuffle(chat)
    rng.shuffle(code)
    return chat, code


def prompts(tokenizer, count: int, excluded: list[str]) -> list[list[int]]:
    """Token ids of `count` prompts, chat and code alternating (see the module's
    docstring); a base model's: the paragraphs' first third to continue."""
    if not getattr(tokenizer, "chat_template", None):
        return [tokenizer.encode(p[: len(p) // 3]) for p in paragraphs(count)]
    chat, code = _texts(count, excluded)
    # alternating, as many of each
    texts = [t for pair in zip(chat, code, strict=False) for t in pair]
    return [chat_ids(tokenizer, text) for text in texts[:count]]


def more_chat(
    tokenizer, count: int, excluded: list[str], taken: int, extra: int
) -> list[list[int]]:
    """Token ids of up to `extra` chat prompts that the first `taken` of
    `prompts(tokenizer, count, excluded)` do not hold (chat is the harder half to
    predict: more of it in the mix)."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    chat, code = _texts(count, excluded)
    used = min(len(chat), len(code), (taken + 1) // 2)  # the mix starts with chat
    return [chat_ids(tokenizer, text) for text in chat[used : used + extra]]
