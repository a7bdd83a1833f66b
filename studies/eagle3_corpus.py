"""The prompts an EAGLE-3 head is trained on here (studies/train_eagle3.py): text the
project ships, which the target then answers (the head learns what the target says).

For an instruct model, in its chat template, half chat and half code editing, as
studies/spec_decode.py measures them:

- chat: the questions of the bench's ShareGPT sample (bench/data), questions written
  here (a few forms over a list of topics), and the docs' paragraphs to explain;
- code: short functions of the project's studies/ and bench/ to edit (a docstring,
  clearer names, type annotations, an empty input handled, a simpler body).

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
]  # fmt: skip


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z]+", text.lower()))


def questions(excluded: list[str]) -> list[str]:
    """The ShareGPT sample's questions and the written ones, less any that starts
    like one of `excluded` (the measured questions)."""
    sample = [q for q, _ in load_sharegpt(DEFAULT_SHAREGPT)]
    written = [form.format(topic) for topic in TOPICS for form in QUESTION_FORMS]
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


def functions(limit: int) -> list[str]:
    """Short functions of studies/*.py and bench/*.py, as written (the measured
    snippets' length)."""
    found = []
    for path in sorted(glob.glob("studies/*.py") + glob.glob("bench/*.py")):
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


def prompts(tokenizer, count: int, excluded: list[str]) -> list[list[int]]:
    """Token ids of `count` prompts, chat and code alternating (see the module's
    docstring); a base model's: the paragraphs' first third to continue."""
    if not getattr(tokenizer, "chat_template", None):
        return [tokenizer.encode(p[: len(p) // 3]) for p in paragraphs(count)]
    rng = random.Random(2)
    chat = questions(excluded)
    chat += [rng.choice(CHAT_TASKS).format(text=p) for p in paragraphs(count)]
    code = [rng.choice(CODE_TASKS).format(text=c) for c in functions(count)]
    rng.shuffle(chat)
    # alternating, as many of each
    texts = [t for pair in zip(chat, code, strict=False) for t in pair]
    return [chat_ids(tokenizer, text) for text in texts[:count]]
