"""The prompts an EAGLE-3 head is trained on here (studies/train_eagle3.py): text the
project ships, which the target then answers (the head learns what the target says).

For an instruct model, in its chat template, half chat and half code editing, as
studies/spec_decode.py measures them:

- chat: the questions of the bench's ShareGPT sample (bench/data), questions written
  for it (studies/eagle3_written.py: forms over a list of topics, how-to requests,
  why-questions, pairs to compare), and the docs' paragraphs to explain;
- code: small functions written for it and short functions of the project's packages to
  edit (a docstring, clearer names, type annotations, an empty input handled, a simpler
  body, comments, input checks).

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
from studies.eagle3_written import (
    CHAT_TASKS,
    CODE_TASKS,
    HOW_FORMS,
    HOW_TO,
    PAIRS,
    QUESTION_FORMS,
    SMALL_FUNCTIONS,
    TOPICS,
    WHY,
)


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
