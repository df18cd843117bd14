"""Environments that ship: offline, deterministic given a seed, each with an oracle's
``demonstration(seed)`` (a correct transcript, to pre-train or SFT a policy on the format).

- ``SortingEnv``: sort words; the environment says which positions are wrong.
- ``ArithmeticToolEnv``: word problems with a sandboxed calculator (``<calc>37*48</calc>``).
- ``SearchEnv``: questions about a generated corpus, BM25 search (``<search>``, ``<answer>``).
- ``CodeEnv``: write a function; hidden tests run in the sandbox.
"""

from .arithmetic import ArithmeticConfig, ArithmeticToolEnv
from .code import CodeConfig, CodeEnv
from .search import BM25, SearchConfig, SearchEnv, make_corpus
from .sorting import WORDS, SortingConfig, SortingEnv

__all__ = [
    "BM25",
    "WORDS",
    "ArithmeticConfig",
    "ArithmeticToolEnv",
    "CodeConfig",
    "CodeEnv",
    "SearchConfig",
    "SearchEnv",
    "SortingConfig",
    "SortingEnv",
    "make_corpus",
]
