"""Each library README opens with code taken verbatim from one of these examples.

The examples run in CI (their own tests), so the README's "use it in your own loop" code
runs as written. Add a row when a README opens with another example.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_EXAMPLES = {
    "libs/flexshard/README.md": "examples/hf_llama_flexshard.py",
    "libs/pipeline/README.md": "examples/plain_pipeline.py",
    "libs/torch_checkpointing/README.md": "examples/fsdp2_checkpoint.py",
    "libs/torch_remat/README.md": "examples/hf_remat.py",
    "libs/titan_rl/README.md": "examples/verl_style_rl.py",
}


def _first_python_block(readme: str) -> str:
    return readme.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("readme", sorted(README_EXAMPLES))
def test_readme_opens_with_a_verbatim_excerpt_of_its_example(readme):
    block = _first_python_block((ROOT / readme).read_text()).rstrip("\n").split("\n")
    script = (ROOT / README_EXAMPLES[readme]).read_text().split("\n")
    starts = [i for i, line in enumerate(script) if line.strip() == block[0].strip()]
    windows = [textwrap.dedent("\n".join(script[i : i + len(block)])) for i in starts]
    assert "\n".join(block) in windows, (
        f"the first python block of {readme} is not a contiguous excerpt of "
        f"{README_EXAMPLES[readme]} (same lines, same relative indentation)"
    )
