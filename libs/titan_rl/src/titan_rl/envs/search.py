"""Search (Search-R1 style): questions about a generated corpus, answered by searching it.

The corpus is made in process from a seed: one short document per fictional town (its
province, founding year, population, river). A question asks one fact of one town. The
model searches (``<search>query</search>``; the best ``top_k`` documents by BM25 come back as
a tool message), then answers (``<answer>1731</answer>``), scored by exact match.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from dataclasses import dataclass

from ..environment import StepResult
from ..messages import Message
from ._tags import find_tag

_WORD = re.compile(r"[a-z0-9]+")
_SYLLABLES = ("ka", "lo", "mi", "ra", "ven", "dor", "sel", "tu", "bri", "zan", "qua", "po")
_FACTS = {  # question, the document's sentence, the answer's value range
    "founded": ("When was {t} founded?", "It was founded in {v}.", (1200, 1950)),
    "population": ("What is the population of {t}?", "Its population is {v}.", (300, 9999)),
    "province": ("Which province is {t} in?", "{t} is a town in {v} province.", None),
    "river": ("Which river runs through {t}?", "The {v} river runs through it.", None),
}


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    """Okapi BM25 over a list of documents (built in process; ``k1``, ``b`` as usual)."""

    def __init__(self, documents: list[str], *, k1: float = 1.2, b: float = 0.75) -> None:
        """Index ``documents`` (lower-cased alphanumeric words)."""
        if not documents:
            raise ValueError("BM25 needs at least one document")
        self.documents, self.k1, self.b = documents, k1, b
        self._counts = [Counter(_words(d)) for d in documents]
        self._lengths = [sum(c.values()) for c in self._counts]
        self._mean = sum(self._lengths) / len(documents)
        frequency = Counter(w for c in self._counts for w in c)
        n = len(documents)
        self._idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in frequency.items()}

    def search(self, query: str, k: int) -> list[int]:
        """Indices of the ``k`` best documents for ``query`` (ties: the lower index)."""
        terms = [w for w in _words(query) if w in self._idf]
        scores = []
        for i, counts in enumerate(self._counts):
            norm = self.k1 * (1 - self.b + self.b * self._lengths[i] / self._mean)
            score = sum(
                self._idf[w] * counts[w] * (self.k1 + 1) / (counts[w] + norm)
                for w in terms
                if w in counts
            )
            scores.append((-score, i))
        return [i for _, i in sorted(scores)[:k]]


@dataclass(kw_only=True, slots=True)
class SearchConfig:
    """The corpus and the search budget."""

    num_towns: int = 200
    """Documents in the corpus (one per town)."""
    corpus_seed: int = 0
    """Seeds the corpus (the questions are seeded by ``reset``)."""
    top_k: int = 1
    """Documents returned per search."""
    max_searches: int = 3
    """Searches allowed; the turn after the last one must answer."""

    def __post_init__(self) -> None:
        if self.num_towns < 1:
            raise ValueError(f"SearchConfig.num_towns={self.num_towns} must be >= 1")
        if self.top_k < 1:
            raise ValueError(f"SearchConfig.top_k={self.top_k} must be >= 1")
        if self.max_searches < 0:
            raise ValueError(f"SearchConfig.max_searches={self.max_searches} must be >= 0")


def make_corpus(num_towns: int, seed: int) -> list[dict[str, str]]:
    """``num_towns`` towns with distinct names and their facts (deterministic)."""
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < num_towns:
        name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in names:
            names.append(name)
    provinces = ["Alber", "Corin", "Dusk", "Elm", "Fenn", "Gale"]
    rivers = ["Ash", "Bram", "Cole", "Dane", "Esk", "Frome", "Glyn"]
    towns = []
    for name in names:
        town = {"town": name, "province": rng.choice(provinces), "river": rng.choice(rivers)}
        for fact in ("founded", "population"):
            low, high = _FACTS[fact][2]
            town[fact] = str(rng.randint(low, high))
        towns.append(town)
    return towns


def _document(town: dict[str, str]) -> str:
    return " ".join(
        sentence.format(t=town["town"], v=town[f]) for f, (_, sentence, _) in _FACTS.items()
    )


class SearchEnv:
    """Questions about the corpus's towns, answered by searching it (see the module
    docstring)."""

    def __init__(self, config: SearchConfig | None = None) -> None:
        """``config``: corpus size and seed, documents per search, search budget."""
        self.config = config or SearchConfig()
        self.towns = make_corpus(self.config.num_towns, self.config.corpus_seed)
        self.documents = [_document(t) for t in self.towns]
        self.index = BM25(self.documents)
        self._answer: str | None = None

    def problem(self, seed: int) -> tuple[str, str, str]:
        """Question ``seed``: ``(question, a query that finds it, answer)``."""
        rng = random.Random(seed)
        town = self.towns[rng.randrange(len(self.towns))]
        fact = rng.choice(list(_FACTS))
        question = _FACTS[fact][0].format(t=town["town"])
        return question, f"{town['town']} {fact}", town[fact]

    def reset(self, seed: int) -> list[Message]:
        """Question ``seed`` as a user message."""
        question, _, self._answer = self.problem(seed)
        self._searches = 0
        return [Message("user", question)]

    def search(self, query: str) -> str:
        """The text of the best ``top_k`` documents for ``query``."""
        return "\n".join(self.documents[i] for i in self.index.search(query, self.config.top_k))

    def step(self, message: Message) -> StepResult:
        """Run a search, or score the ``<answer>``."""
        if self._answer is None:
            raise RuntimeError("SearchEnv.step() before reset()")
        query = find_tag(message.content, "search")
        if query is not None and self._searches < self.config.max_searches:
            self._searches += 1
            return StepResult([Message("tool", self.search(query), name="search")], 0.0, False)
        answer = find_tag(message.content, "answer")
        info = {"searches": self._searches}
        if answer is None:
            return StepResult((), 0.0, True, {**info, "status": "unparseable"})
        correct = answer.strip().lower() == self._answer.lower()
        return StepResult(
            (), float(correct), True, {**info, "status": "correct" if correct else "wrong"}
        )

    def demonstration(self, seed: int) -> list[Message]:
        """The oracle's transcript: search the town and the fact, read, answer."""
        question, query, answer = self.problem(seed)
        return [
            Message("user", question),
            Message("assistant", f"<search>{query}</search>"),
            Message("tool", self.search(query), name="search"),
            Message("assistant", f"<answer>{answer}</answer>"),
        ]
