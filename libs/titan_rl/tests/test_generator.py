"""TorchGenerator: sampling controls, seeds, stop tokens, weights, and its log-probs."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import titan_models
from titan_rl import (
    Generation,
    SamplingParams,
    TorchGenerator,
    batch_invariant,
    sequence_logprobs,
)
from titan_rl.cpu_decode import RowwiseLinear
from titan_rl.generator import _noise, _sample

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[256, 49, 43, 50, 61], [256, 55, 61], [256, 57, 57, 45, 51, 52, 61]]


def test_greedy_matches_titan_models_greedy_generate(tiny_model):
    out = TorchGenerator(tiny_model).generate(
        PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0), seeds=[0, 0, 0]
    )
    expected, _ = titan_models.greedy_generate(tiny_model, PROMPTS, 6)
    assert torch.equal(out.tokens, expected)
    assert out.finish_reasons == ["length"] * 3 and out.mask.all()
    assert torch.equal(out.processed_logprobs, torch.zeros(3, 6))  # greedy: probability one


def test_a_sample_depends_on_its_seed_not_on_its_batch_position(tiny_model):
    gen = TorchGenerator(tiny_model, batch_invariant=True)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    batch = gen.generate(PROMPTS, params, seeds=[1, 2, 3])
    alone = gen.generate([PROMPTS[2]], params, seeds=[3])
    assert torch.equal(batch.tokens[2], alone.tokens[0])
    assert torch.equal(batch.logprobs[2], alone.logprobs[0])
    again = gen.generate(PROMPTS, params, seeds=[1, 2, 3])
    assert torch.equal(batch.tokens, again.tokens)
    other = gen.generate(PROMPTS, params, seeds=[4, 5, 6])
    assert not torch.equal(batch.tokens, other.tokens)


def test_stop_tokens_end_rows_and_are_kept(tiny_model):
    gen = TorchGenerator(tiny_model)
    free = gen.generate(PROMPTS, SamplingParams(max_new_tokens=8), seeds=[7, 8, 9])
    stop = int(free.tokens[0, 2])  # make row 0's third token a stop token
    out = gen.generate(PROMPTS, SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)), [7, 8, 9])
    assert out.lengths[0] == 3 and out.finish_reasons[0] == "stop"
    assert int(out.tokens[0, 2]) == stop and not out.mask[0, 3:].any()
    assert torch.equal(out.tokens[0, :3], free.tokens[0, :3])
    for row in range(3):  # every row ends at its first stop token, or runs to the budget
        n = int(out.lengths[row])
        assert stop not in out.tokens[row, : n - 1].tolist()
        assert out.finish_reasons[row] == ("stop" if out.tokens[row, n - 1] == stop else "length")
        assert out.finish_reasons[row] == "stop" or n == 8


def test_top_k_and_top_p_restrict_the_distribution(tiny_model):
    gen = TorchGenerator(tiny_model)
    greedy = gen.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0), [0, 0, 0])
    for params in (
        SamplingParams(max_new_tokens=5, top_k=1),
        SamplingParams(max_new_tokens=5, top_p=1e-6),
    ):
        out = gen.generate(PROMPTS, params, seeds=[1, 2, 3])
        assert torch.equal(out.tokens, greedy.tokens)
        assert torch.equal(out.processed_logprobs, torch.zeros(3, 5))
        assert (out.logprobs < 0).all()  # raw log-probs are the model's, before truncation
    out = gen.generate(PROMPTS, SamplingParams(max_new_tokens=5, top_k=5), seeds=[1, 2, 3])
    assert (out.processed_logprobs >= out.logprobs).all()


def test_temperature_scales_the_raw_logprobs(tiny_model):
    gen = TorchGenerator(tiny_model, batch_invariant=True)
    for temperature in (0.5, 1.7):
        out = gen.generate(
            PROMPTS, SamplingParams(max_new_tokens=4, temperature=temperature), [1, 2, 3]
        )
        with torch.no_grad(), batch_invariant():
            lp = sequence_logprobs(
                tiny_model, PROMPTS, out.tokens, out.mask, temperature=temperature
            )
        assert torch.equal(lp, out.logprobs)


def test_sampler_draws_from_the_processed_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -30.0])
    n = 4000
    rngs = [torch.Generator().manual_seed(s) for s in range(n)]
    params = SamplingParams(max_new_tokens=1, top_k=3)
    noise = _noise(params, rngs, vocab=5, device=torch.device("cpu"))
    tokens, raw, logp = _sample(logits.expand(n, -1).clone(), params, noise)
    freq = torch.bincount(tokens, minlength=5).double() / n
    expected = torch.cat([logits[:3].softmax(0), torch.zeros(2)]).double()
    assert (freq - expected).abs().max() < 0.03  # 3 sigma of a 4000-draw frequency is ~0.022
    assert torch.allclose(logp, expected.float().log()[tokens])
    assert torch.allclose(raw, logits.log_softmax(0)[tokens])  # before top-k


def test_update_weights_copies_in_memory_and_tags_the_version(tiny_model, model_factory):
    gen = TorchGenerator(model_factory(seed=1))
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    before = gen.generate(PROMPTS, params, [0, 0, 0])
    assert before.weight_version == 0
    gen.update_weights(tiny_model.state_dict(), version=5)
    after = gen.generate(PROMPTS, params, [0, 0, 0])
    reference = TorchGenerator(tiny_model).generate(PROMPTS, params, [0, 0, 0])
    assert after.weight_version == 5 and torch.equal(after.tokens, reference.tokens)
    state = dict(tiny_model.state_dict())
    state.pop("norm.weight")
    with pytest.raises(ValueError, match="missing keys"):
        gen.update_weights(state, version=6)
    state["norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="norm.weight has shape"):
        gen.update_weights(state, version=6)
    assert gen.weight_version == 5


def test_bad_sampling_input_is_refused(tiny_model):
    gen = TorchGenerator(tiny_model)
    for kwargs, field in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 1, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 1, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 1, "top_k": -1}, "top_k"),
    ]:
        with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        gen.generate(PROMPTS, SamplingParams(max_new_tokens=1), seeds=[0, 1])
    with pytest.raises(ValueError, match="non-empty"):
        gen.generate([[1], []], SamplingParams(max_new_tokens=1), seeds=[0, 1])
    with pytest.raises(TypeError, match="torch.nn.Module causal LM"):
        TorchGenerator(lambda input_ids: input_ids)
    with pytest.raises(ValueError, match="compile_decode=True cannot be combined"):
        TorchGenerator(gen.model, batch_invariant=True, compile_decode=True)
    with pytest.raises(ValueError, match="compile_decode=True needs a titan_models Transformer"):
        TorchGenerator(AsCausalLM(gen.model), compile_decode=True)
    with pytest.raises(ValueError, match="cpu_rowwise_linear=True .* needs compile_decode=True"):
        TorchGenerator(gen.model, cpu_rowwise_linear=True)
    with pytest.raises(ValueError, match=r"parameters on \['meta'\]"):
        TorchGenerator(
            copy.deepcopy(gen.model).to("meta"), compile_decode=True, cpu_rowwise_linear=True
        )


class AsCausalLM(torch.nn.Module):
    """A titan_models model seen only through ``model(input_ids) -> logits``: the generator's
    path for any causal LM (no KV cache, the whole sequence recomputed each step)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids)


@pytest.mark.parametrize(
    "window",
    [None, {"sliding_window": 3}, {"sliding_window": 3, "sliding_window_layers": (1,)}],
    ids=["full", "all-windowed", "mixed"],
)
def test_cached_decoding_equals_recomputing_the_whole_sequence(model_factory, window):
    """The static KV cache (rings for windowed layers, prompts longer than the window) gives
    the tokens and log-probs of a forward over the whole sequence at every step."""
    model = model_factory(**(window or {}))
    params = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=30)
    cached = TorchGenerator(model).generate(PROMPTS, params, seeds=[1, 2, 3])
    full = TorchGenerator(AsCausalLM(model)).generate(PROMPTS, params, seeds=[1, 2, 3])
    assert torch.equal(cached.tokens, full.tokens) and cached.mask.all()
    torch.testing.assert_close(cached.logprobs, full.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        cached.processed_logprobs, full.processed_logprobs, rtol=0, atol=1e-5
    )


@pytest.mark.slow  # one torch.compile of the decode step (30-70 s on a shared 2-core machine)
def test_compiled_decode_equals_eager_and_compiles_once(model_factory):
    """The compiled step (the model's own forward over the static cache, with a windowed
    layer's ring, then the sampler) gives eager's tokens, log-probs within fp32 rounding, and
    one graph for every step and call, weights changed in place included."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() keeps them: graphs of earlier tests in this process would count
    model = model_factory(num_layers=2, sliding_window=3, sliding_window_layers=(1,))
    eager, compiled = TorchGenerator(model), TorchGenerator(model, compile_decode=True)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20)
    stop = int(eager.generate(PROMPTS, params, seeds=[1, 2, 3]).tokens[0, 4])  # row 0 stops
    params = dataclasses.replace(params, stop_token_ids=(stop,))
    want = eager.generate(PROMPTS, params, seeds=[1, 2, 3])
    assert want.finish_reasons[0] == "stop" and not want.mask.all()

    def check(got, want):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.mask, want.mask)
        assert got.finish_reasons == want.finish_reasons
        for name in ("logprobs", "processed_logprobs"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=1e-5)

    check(compiled.generate(PROMPTS, params, seeds=[1, 2, 3]), want)
    check(compiled.generate(PROMPTS, params, seeds=[1, 2, 3]), want)  # a new cache: no recompile
    # Weights changed in place behind the generator's back are seen by the next call.
    for p in model.parameters():
        p.data.mul_(-1.5)
    changed = eager.generate(PROMPTS, params, seeds=[1, 2, 3])
    assert not torch.equal(changed.tokens, want.tokens)
    check(compiled.generate(PROMPTS, params, seeds=[1, 2, 3]), changed)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    # The step's guards skip the model's module attributes only: other sampling settings
    # are a new graph, not the old one reused.
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    check(compiled.generate(PROMPTS, greedy, [1, 2, 3]), eager.generate(PROMPTS, greedy, [1, 2, 3]))
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.slow  # one torch.compile of the decode step (30-70 s on a shared 2-core machine)
def test_cpu_rowwise_linear_decodes_like_eager(model_factory):
    """The CPU opt-in traces the step's linears as products and sums: same greedy tokens as
    the eager model, log-probs within fp32 rounding, and the products really are in the
    graph (no extern GEMM left but the head's, whose rows are the batch too)."""
    torch._dynamo.reset()
    model = model_factory(num_layers=2)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    want = TorchGenerator(model).generate(PROMPTS, params, seeds=[1, 2, 3])
    gen = TorchGenerator(model, compile_decode=True, cpu_rowwise_linear=True)
    got = gen.generate(PROMPTS, params, seeds=[1, 2, 3])
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    with RowwiseLinear():
        linear = torch.compile(lambda x, w: F.linear(x, w), fullgraph=True)
        x, w = torch.randn(3, 16), torch.randn(5, 16)
        out, code = torch._inductor.utils.run_and_get_code(linear, x, w)
    assert not any("extern_kernels.mm(" in c for c in code)  # products and sums, not a GEMM
    torch.testing.assert_close(out, F.linear(x, w), rtol=0, atol=1e-5)


def test_generation_validate_catches_mismatched_lengths():
    ok = Generation(
        tokens=torch.zeros(2, 3, dtype=torch.long),
        mask=torch.ones(2, 3, dtype=torch.bool),
        logprobs=torch.zeros(2, 3),
        processed_logprobs=torch.zeros(2, 3),
        finish_reasons=["length", "length"],
        weight_version=0,
    )
    ok.validate(2)
    with pytest.raises(ValueError, match="for 3 prompts"):
        ok.validate(3)
    bad = Generation(
        ok.tokens, ok.mask, torch.zeros(2, 2), ok.processed_logprobs, ok.finish_reasons, 0
    )
    with pytest.raises(ValueError, match="logprobs has shape"):
        bad.validate(2)
    holes = Generation(
        ok.tokens,
        torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool),
        ok.logprobs,
        ok.processed_logprobs,
        ok.finish_reasons,
        0,
    )
    with pytest.raises(ValueError, match="prefix"):
        holes.validate(2)


def test_prompts_with_images_decode_as_the_vision_language_model_greedily_would():
    cls, config = titan_models.get_model("qwen3_vl", "debug")
    with torch.device("meta"):
        model = cls(config)
    model.init_weights(device="cpu", seed=2).eval()
    m, image = config.vision.spatial_merge_size, config.image_token_id
    grids = [(1, 4, 4), (1, 4, 6)]  # one image per prompt, of different sizes
    prompts = [
        [5, config.vision_start_token_id, *[image] * (16 // m**2), config.vision_end_token_id, 7],
        [9, 8, config.vision_start_token_id, *[image] * (24 // m**2), config.vision_end_token_id],
    ]
    pixels = torch.randn(
        16 + 24, config.vision.patch_dim, generator=torch.Generator().manual_seed(0)
    )
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    images = {"pixel_values": pixels, "image_grid_thw": grids}
    out = TorchGenerator(model).generate(prompts, params, seeds=[0, 1], images=images)
    offsets = [0, 16]
    for row, prompt in enumerate(prompts):  # the reference: the whole sequence each step
        seq = list(prompt)
        t, h, w = grids[row]
        mine = pixels[offsets[row] : offsets[row] + t * h * w]
        for _ in range(5):
            logits = model(torch.tensor([seq]), pixel_values=mine, image_grid_thw=[grids[row]])
            seq.append(int(logits[0, -1].argmax()))
        assert out.tokens[row].tolist() == seq[len(prompt) :]
    text_cls, text_config = titan_models.get_model("qwen3", "debug")
    with pytest.raises(ValueError, match="needs a titan_models vision-language model"):
        TorchGenerator(text_cls(text_config)).generate(prompts, params, [0, 1], images=images)
