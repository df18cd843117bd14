"""The built-in image-text corpus: pictures of coloured shapes drawn with Pillow from
``(seed, index)``, each with one question whose answer is checkable.

Three kinds of question, drawn uniformly:

- ``count``: "how many?" over 1-4 shapes of any colours (answer ``"1"``..``"4"``);
- ``colour``: "colour?" over one shape (``red`` / ``green`` / ``blue`` / ``yellow``);
- ``side``: "left or right?" over one shape drawn inside one half (``left`` / ``right``).

A model that ignores the image can do no better than guessing each kind's answer:
``CHANCE_ACCURACY`` = mean(1/4, 1/4, 1/2) = 1/3. Image sides are 2 or 3 times ``unit``
pixels (the model's patch × merge size), so images come in four exact patch grids: variable
resolution without resizing. Every shape fills most of its own ``unit × unit`` cell (one
placeholder token's worth of pixels).
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 220, 40),
}
KINDS = ("count", "colour", "side")
QUESTIONS = {"count": "how many?", "colour": "colour?", "side": "left or right?"}
"""Short questions: with the byte tokenizer every character is a token of the budget."""
ANSWERS: dict[str, tuple[str, ...]] = {
    "count": ("1", "2", "3", "4"),
    "colour": tuple(COLOURS),
    "side": ("left", "right"),
}
CHANCE_ACCURACY = sum(1 / len(ANSWERS[k]) for k in KINDS) / len(KINDS)
"""Expected exact-match accuracy of guessing: the baseline validation accuracy is read against."""


class ShapesSample(NamedTuple):
    """One picture and its question."""

    image: Any
    """A ``PIL.Image.Image`` in RGB."""
    kind: str
    """``count``, ``colour`` or ``side``."""
    question: str
    """The question text."""
    answer: str
    """Its answer (one of ``ANSWERS[kind]``)."""


def shapes_sample(seed: int, index: int, *, unit: int = 16) -> ShapesSample:
    """The ``index``-th sample of the corpus for ``seed``; image sides are 2-3 ``unit``s."""
    from PIL import Image, ImageDraw

    if unit < 8:
        raise ValueError(f"shapes corpus: unit={unit} pixels must be >= 8")
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choice(KINDS)
    width, height = rng.randint(2, 3) * unit, rng.randint(2, 3) * unit
    cells = [(x, y) for x in range(width // unit) for y in range(height // unit)]
    if kind == "count":
        count = rng.randint(1, 4)
        placed = rng.sample(cells, count)
        colours = [rng.choice(list(COLOURS)) for _ in placed]
        answer = str(count)
    else:
        half = rng.choice(("left", "right"))
        columns = width // unit
        mine = [c for c in cells if (c[0] < columns // 2) == (half == "left")]
        mine = [c for c in mine if not (columns % 2 and c[0] == columns // 2)]
        placed = [rng.choice(mine)]
        colours = [rng.choice(list(COLOURS))]
        answer = colours[0] if kind == "colour" else half
    image = Image.new("RGB", (width, height), (30, 30, 30))
    draw = ImageDraw.Draw(image)
    for (cx, cy), colour in zip(placed, colours, strict=True):
        size = rng.randint(unit - unit // 4, unit)  # a shape fills most of its cell
        x0 = cx * unit + rng.randint(0, unit - size)
        y0 = cy * unit + rng.randint(0, unit - size)
        box = (x0, y0, x0 + size - 1, y0 + size - 1)
        shape = rng.choice(("square", "circle", "triangle"))
        fill = COLOURS[colour]
        if shape == "square":
            draw.rectangle(box, fill=fill)
        elif shape == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(x0, box[3]), (box[2], box[3]), ((x0 + box[2]) // 2, y0)], fill=fill)
    return ShapesSample(image, kind, QUESTIONS[kind], answer)
