"""One meaning of an FQN glob in every library that takes one.

flexshard (``Bucket.match``), torch_remat (``units=``, policy keys) and titan_models (plan
patterns) each hold the same ``fqn.py`` (they may not import one another): ``*`` stays inside
one dotted segment, a ``**`` segment spans zero or more segments, nothing else is special.
Every row below runs through all three functions.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import flexshard
import titan_models
import torch_remat

ROOT = Path(__file__).resolve().parents[1]
COPIES = {
    "flexshard": (flexshard.fqn_matches, "libs/flexshard/src/flexshard/fqn.py"),
    "torch_remat": (torch_remat.fqn_matches, "libs/torch_remat/src/torch_remat/fqn.py"),
    "titan_models": (titan_models.fqn_matches, "libs/titan_models/src/titan_models/fqn.py"),
}

ROWS = [
    # (pattern, fqn, matches)
    ("layers.0.attention.wq", "layers.0.attention.wq", True),  # literal
    ("layers.0.attention.wq", "layers.0.attention.wk", False),
    ("layers.*", "layers.7", True),  # each block...
    ("layers.*", "layers.7.attention", False),  # ...but nothing inside one
    ("layers.*", "layers", False),
    ("layers.*.attention.wq", "layers.12.attention.wq", True),
    ("layers.*.attention.wq", "layers.1.attention.wk", False),
    ("*", "norm", True),
    ("*", "norm.weight", False),  # `*` never crosses a dot (fnmatch's would)
    ("layers.*.w*.weight", "layers.3.wq.weight", True),  # inside a segment
    ("layers.*.w*.weight", "layers.3.attention.wq.weight", False),
    ("*_norm", "attention_norm", True),
    ("layers.**", "layers", True),  # zero segments
    ("layers.**", "layers.0.attention.wq.weight", True),
    ("layers.**", "tok_embeddings.weight", False),
    ("**", "tok_embeddings.weight", True),
    ("**.bias", "bias", True),
    ("**.bias", "layers.0.mlp.bias", True),
    ("**.bias", "layers.0.mlp.bias_scale", False),
    ("layers.**.experts.w_up", "layers.3.feed_forward.experts.w_up", True),
    ("layers.**.experts.w_up", "layers.experts.w_up", True),
    ("layers.**.experts.w_up", "layers.3.feed_forward.experts.w_down", False),
    ("a?", "ab", False),  # no other character is special
    ("a[0]", "a0", False),
    ("a[0]", "a[0]", True),
    ("layers.0", "layers.01", False),  # whole segments
    ("layers.1*", "layers.12", True),
]


@pytest.mark.parametrize("library", sorted(COPIES))
def test_every_library_matches_the_table(library):
    matches, _ = COPIES[library]
    got = [(p, f, matches(p, f)) for p, f, _ in ROWS]
    assert got == ROWS


@pytest.mark.parametrize("library", sorted(COPIES))
def test_a_double_star_inside_a_segment_is_refused(library):
    matches, _ = COPIES[library]
    with pytest.raises(ValueError, match=r"'layers\.a\*\*'.*whole segment"):
        matches("layers.a**", "layers.ab")
    with pytest.raises(ValueError, match="non-empty"):
        matches("", "layers")


def test_the_three_copies_are_one_file():
    texts = {lib: (ROOT / path).read_text() for lib, (_, path) in COPIES.items()}
    assert len(set(texts.values())) == 1, "libs/*/src/*/fqn.py differ: edit all three"
