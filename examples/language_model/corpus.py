"""The embedded corpus of the language-model example: the English text that ships with
every CPython installation, so nothing is downloaded.

Documents, each a stretch of English prose written by Python's developers:

- one per entry of ``pydoc_data.topics`` (the language reference and library chapters
  that ``help()`` shows: statements, operators, methods of the built-in types...);
- one per module of the standard library (``sysconfig.get_paths()['stdlib']``, without
  ``site-packages``, the test suites, and the character tables of ``encodings`` and
  ``html.entities``): its docstrings and comments, in source order.

All of it is CPython's own text, under the PSF License Agreement (Python Software
Foundation License Version 2, the ``LICENSE`` file of every Python installation). The
exact text depends on the Python version (``platform.python_version()``); Python 3.11.7
gives 674 documents and 566,468 words (sentence ends included); with the defaults,
537,507 training words, 28,961 validation words (679 of them ``<unk>``) and a
vocabulary of 13,371 words.

Words: the text is lowercased; a word is a run of letters, possibly joined by
apostrophes (``don't``); digits, punctuation and symbols separate words and are
dropped. A sentence ends at ``.``, ``!`` or ``?`` followed by white space, and at a
blank line (the end of a paragraph, a comment block or a docstring); each sentence is
its words followed by ``<eos>``.

Split: the documents, sorted by name, are shuffled with seed 0; documents are moved to
the validation set, in that order, until it holds ``val_fraction`` of the words; the
rest, in the same order, is the training set. The same on every worker.

Reading: extracting the docstrings and comments parses every module (about 10 s), so the
documents are kept in a cache file, ``lm-corpus-<python version>-<key>.json.gz`` under
``$DG_CORPUS_CACHE`` (default ``~/.cache/dist_gluon``): later runs read them in a
fraction of a second. The key covers this file and the Python build and library read,
so a change to either reads the text again. Without a writable cache directory every
run reads the text.

Vocabulary: ``<unk>``, ``<eos>``, then every word seen at least ``min_count`` times in
the training set, the most frequent first (ties alphabetically). Other words, in either
set, become ``<unk>``.
"""
from __future__ import annotations

import ast
import collections
import gzip
import hashlib
import json
import os
import platform
import re
import sys
import sysconfig
import tempfile
import tokenize
from dataclasses import dataclass
from pathlib import Path

import numpy as np

UNK, EOS = "<unk>", "<eos>"
LICENCE = "PSF License Version 2 (the LICENSE file of the Python installation)"
# Not the library's prose: third-party packages, the test suites, and the codec tables
# of ``encodings`` (a comment naming each character: "LATIN SMALL LETTER A").
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test",
                 "__pycache__", "encodings"}
# Tables too: html's entity names, each with a comment naming its character.
_SKIPPED_FILES = {os.path.join("html", "entities.py")}
_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")


@dataclass
class Corpus:
    """Token ids of the training and validation sets and the vocabulary."""
    train_documents: list[np.ndarray]   # int32 ids of each training document, in order
    val: np.ndarray            # int32 ids, the validation documents one after another
    vocab: list[str]           # id -> word; vocab[0] == '<unk>', vocab[1] == '<eos>'
    documents: int             # documents in the corpus (both sets)
    val_documents: int
    source: str                # one line naming the text and the Python it came from

    @property
    def train(self) -> np.ndarray:
        """The whole training set: its documents one after another."""
        return np.concatenate(self.train_documents)

    def train_part(self, fraction: float) -> np.ndarray:
        """A smaller training set drawn from every document: the first ``fraction`` of
        each training document's words (at least one), one document after another."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        return np.concatenate([ids[:max(1, round(fraction * len(ids)))]
                               for ids in self.train_documents])

    @property
    def unknown_val_words(self) -> int:
        """Validation words that are not in the vocabulary (counted as ``<unk>``)."""
        return int(np.count_nonzero(self.val == 0))


def load_corpus(val_fraction: float = 0.05, min_count: int = 1) -> Corpus:
    """Read, tokenise and split the corpus (see the module docstring); a few seconds."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if min_count < 1:
        raise ValueError(f"min_count must be at least 1, got {min_count}")
    documents = _read_documents()
    tokenised = [(name, tokenise(text)) for name, text in documents]
    tokenised = [(name, words) for name, words in tokenised if words]
    order = np.random.RandomState(0).permutation(len(tokenised))
    total = sum(len(words) for _, words in tokenised)
    val, train, val_words = [], [], 0
    for i in order:
        words = tokenised[i][1]
        if val_words < val_fraction * total:
            val.append(words)
            val_words += len(words)
        else:
            train.append(words)
    counts = collections.Counter(word for words in train for word in words)
    del counts[EOS]
    kept = sorted((w for w, c in counts.items() if c >= min_count),
                  key=lambda w: (-counts[w], w))
    vocab = [UNK, EOS, *kept]
    ids = {word: i for i, word in enumerate(vocab)}

    def encode(words: list[str]) -> np.ndarray:
        return np.array([ids.get(word, 0) for word in words], dtype=np.int32)

    modules = sum(1 for name, _ in tokenised if name.startswith("module:"))
    source = (f"Python {platform.python_version()}'s documentation topics (pydoc_data) "
              f"and the docstrings and comments of {modules} standard-library modules; "
              f"licence: {LICENCE}")
    return Corpus(train_documents=[encode(words) for words in train],
                  val=np.concatenate([encode(words) for words in val]), vocab=vocab,
                  documents=len(tokenised), val_documents=len(val), source=source)


def tokenise(text: str) -> list[str]:
    """Lowercased words of ``text``, each sentence followed by ``<eos>``."""
    words = []
    for sentence in _SENTENCE_END.split(text.lower()):
        found = _WORD.findall(sentence)
        if found:
            words.extend(found)
            words.append(EOS)
    return words


def _read_documents() -> list[tuple[str, str]]:
    """(name, text) of every document, sorted by name: from the cache file when it holds
    this Python's, otherwise read and then written there for the next run."""
    root = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(b"\0".join([Path(__file__).read_bytes(), sys.version.encode(),
                                      root.encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("DG_CORPUS_CACHE")
                 or Path.home() / ".cache" / "dist_gluon")
    path = cache / f"lm-corpus-{platform.python_version()}-{key}.json.gz"
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [(name, text) for name, text in json.load(f)]
    except (OSError, EOFError, ValueError):     # no cache yet, or one cut short
        pass
    documents = sorted(_documents())
    try:
        cache.mkdir(parents=True, exist_ok=True)
        # written aside and renamed: workers reading at the same time see all or nothing
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".tmp", delete=False) as tmp:
            with gzip.open(tmp, "wt", encoding="utf-8") as f:
                json.dump(documents, f)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, path)
    except OSError:
        pass                            # a read-only home: read the text every run
    return documents


def _documents():
    """(name, text) of every document: the pydoc topics, then the stdlib modules."""
    from pydoc_data.topics import topics

    for key, text in topics.items():
        yield f"topic:{key}", text
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for filename in sorted(filenames):
            path = os.path.join(dirpath, filename)
            name = os.path.relpath(path, root)
            if filename.endswith(".py") and name not in _SKIPPED_FILES:
                text = _module_text(path)
                if text:
                    yield f"module:{name}", text


def _module_text(path: str) -> str:
    """The docstrings and comment blocks of one source file, in source order, separated
    by blank lines; '' for a file Python cannot read."""
    try:
        with tokenize.open(path) as f:
            source = f.read()
        tree = ast.parse(source)
        comments = [(token.start[0], token.string.lstrip("#").strip())
                    for token in tokenize.generate_tokens(iter(source.splitlines(True))
                                                          .__next__)
                    if token.type == tokenize.COMMENT]
    except (SyntaxError, UnicodeDecodeError, ValueError, tokenize.TokenError):
        return ""
    pieces = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node)
            if docstring:
                pieces.append((node.body[0].lineno, docstring))
    # consecutive comment lines are one block (one paragraph)
    blocks: list[tuple[int, list[str]]] = []
    for line, comment in comments:
        if blocks and line == blocks[-1][0] + len(blocks[-1][1]):
            blocks[-1][1].append(comment)
        else:
            blocks.append((line, [comment]))
    pieces.extend((line, "\n".join(block)) for line, block in blocks)
    pieces.sort(key=lambda piece: piece[0])
    return "\n\n".join(text for _, text in pieces)
