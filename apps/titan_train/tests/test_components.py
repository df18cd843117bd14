"""Component overrides: replacements keep the parameters and FQNs and compute the same thing;
chunked cross-entropy never holds the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_remat
from titan_train.cli import main, parse_config
from titan_train.components import ChunkedCrossEntropyHead, chunked_cross_entropy_sum
from titan_train.trainer import train


class _Loss(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, chunked: bool) -> None:
        super().__init__()
        self.weight, self.chunked = torch.nn.Parameter(weight.clone()), chunked

    def forward(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.chunked:
            return chunked_cross_entropy_sum(h, self.weight, y, 256)
        return F.cross_entropy(F.linear(h, self.weight), y, ignore_index=-100, reduction="sum")


def test_chunked_cross_entropy_equals_the_full_one_and_saves_the_logits():
    torch.manual_seed(0)
    tokens, dim, vocab = 1024, 64, 4096
    weight = torch.randn(vocab, dim) * 0.05
    y = torch.randint(0, vocab, (tokens,))
    y[::7] = -100
    results = {}
    for chunked in (False, True):
        h = torch.randn(tokens, dim, generator=torch.Generator().manual_seed(1)).requires_grad_()
        mod = _Loss(weight, chunked)
        loss = mod(h, y)
        loss.backward()
        results[chunked] = (loss.detach(), h.grad, mod.weight.grad)
        h2 = torch.randn(tokens, dim, requires_grad=True)
        m = torch_remat.measure(mod, (h2, y), loss_fn=lambda out: out, steps=1, warmup=0)
        results[chunked] += (m.peak_bytes,)
    full, chunk = results[False], results[True]
    torch.testing.assert_close(chunk[0], full[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(chunk[1], full[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(chunk[2], full[2], rtol=0, atol=1e-5)
    logits_bytes = tokens * vocab * 4
    # The full loss holds (at least) the logits and their log-softmax; a chunk holds 1/4 of them.
    assert full[3] >= 2 * logits_bytes
    assert chunk[3] <= full[3] / 3, (chunk[3], full[3])


def test_overrides_train_like_the_original_model_with_the_same_state_keys(tmp_path):
    common = ["--output-dir", str(tmp_path), "--training.steps", "3", "--metrics.validate-every",
              "0", "--metrics.no-tensorboard", "--metrics.peak-flops", "1e11",
              "--checkpoint.interval", "0"]  # fmt: skip
    plain = train(parse_config([*common, "--name", "plain"]))
    swapped = train(
        parse_config(
            [*common, "--name", "swapped", "--model.overrides",
             "output=chunked_cross_entropy"]
        )
    )  # fmt: skip
    assert isinstance(swapped["model"].output, ChunkedCrossEntropyHead)
    assert list(swapped["model"].state_dict()) == list(plain["model"].state_dict())
    torch.testing.assert_close(swapped["losses"], plain["losses"], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("output", "must read 'module-glob=replacement'"),
        ("output=fast_head", "unknown replacement 'fast_head'"),
        ("layers.*.nope=chunked_cross_entropy", "matches no module"),
        ("layers.*.attention=chunked_cross_entropy", "cannot replace 'layers.0.attention'"),
    ],
)
def test_bad_override_is_one_error_line_and_writes_nothing(tmp_path, capsys, override, message):
    rc = main(["--output-dir", str(tmp_path), "--model.overrides", override])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_local_compile_trains_like_eager(tmp_path):
    common = ["--output-dir", str(tmp_path), "--training.steps", "3", "--metrics.validate-every",
              "0", "--metrics.no-tensorboard", "--metrics.peak-flops", "1e11",
              "--checkpoint.interval", "0"]  # fmt: skip
    eager = train(parse_config([*common, "--name", "eager"]))
    compiled = train(parse_config([*common, "--name", "compiled", "--compile.enabled"]))
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=0, atol=1e-4)


def test_chunked_head_keeps_a_soft_capped_heads_logit_map():
    """Muse Spark's head scales and soft-caps its logits: the chunked loss applies the same
    map per chunk, so its loss and gradients equal the plain head's."""
    import titan_models
    from titan_train.components import apply_overrides

    _, config = titan_models.get_model("muse_spark", "debug")
    head = titan_models.SoftCappedLinear(
        config.dim, 512, multiplier=config.output_multiplier, cap=2.0
    )
    model = torch.nn.Module()
    model.output = head
    torch.manual_seed(0)
    h = torch.randn(300, config.dim) * 4
    y = torch.randint(0, 512, (300,))
    plain = F.cross_entropy(head(h), y, reduction="sum")
    (plain_grad,) = torch.autograd.grad(plain, head.weight)
    assert apply_overrides(model, ("output=chunked_cross_entropy",)) == {
        "output": "chunked_cross_entropy"
    }
    chunked_head = model.output
    assert isinstance(chunked_head, ChunkedCrossEntropyHead)
    with chunked_head.targets(y):
        loss = chunked_head(h)
    (grad,) = torch.autograd.grad(loss, chunked_head.weight)
    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, plain_grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked_head(h), head(h))  # no targets: the capped logits
