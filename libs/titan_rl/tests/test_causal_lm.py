"""Any causal LM (titan_rl.CausalLM): a transformers model through the generator, the trainer's
log-probs and the GRPO loop, batch-invariant bitwise equality included."""

from __future__ import annotations

import pytest
import torch

from titan_rl import (
    GRPOConfig,
    GRPOTrainer,
    LossConfig,
    Prompt,
    RewardResult,
    SamplingParams,
    TorchGenerator,
    batch_invariant,
    causal_lm_logits,
    sequence_logprobs,
)

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[1, 5, 9], [2, 7, 3, 3, 8, 1], [4]]


def hf_llama(seed: int = 0) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=48,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def test_sequence_logprobs_reads_the_logits_of_an_hf_output():
    """HF returns an output object: its ``.logits`` give each token's log-prob, as one
    unpadded forward per row does (right padding changes no real position)."""
    model = hf_llama()
    responses = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0], [8, 9, 10, 11]])
    mask = responses > 0
    got = sequence_logprobs(model, PROMPTS, responses, mask, temperature=0.7)
    for row, prompt in enumerate(PROMPTS):
        n = int(mask[row].sum())
        ids = torch.tensor([[*prompt, *responses[row, :n].tolist()]])
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + n] / 0.7
        want = logits.log_softmax(-1).gather(-1, responses[row, :n, None])[:, 0]
        torch.testing.assert_close(got[row, :n], want, rtol=0, atol=1e-5)
        assert (got[row, n:] == 0).all()
    got.sum().backward()  # differentiable: the trainer's loss goes through it
    assert model.lm_head.weight.grad is not None


def test_hf_generation_is_batch_invariant_and_equals_the_trainer_bitwise():
    model = hf_llama()
    gen = TorchGenerator(model, batch_invariant=True)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=20)
    batch = gen.generate(PROMPTS, params, seeds=[1, 2, 3])
    alone = gen.generate([PROMPTS[1]], params, seeds=[2])
    assert torch.equal(batch.tokens[1], alone.tokens[0])
    assert torch.equal(batch.logprobs[1], alone.logprobs[0])
    with torch.no_grad(), batch_invariant():
        recomputed = sequence_logprobs(model, PROMPTS, batch.tokens, batch.mask)
    assert torch.equal(recomputed, batch.logprobs)


class _LowIds:
    """Prompts of random ids; reward 1 when a response starts with an id below 24."""

    def prompts(self, start: int, count: int) -> list[Prompt]:
        g = torch.Generator().manual_seed(start)
        return [Prompt(torch.randint(0, 48, (4,), generator=g).tolist(), "") for _ in range(count)]

    def score(self, prompt: Prompt, response_ids: list[int]) -> RewardResult:
        ok = response_ids[0] < 24
        return RewardResult(float(ok), "correct" if ok else "wrong")


def test_grpo_trainer_trains_an_hf_model_with_zero_generator_trainer_gap():
    model = hf_llama()
    cfg = GRPOConfig(
        num_prompts=2,
        group_size=4,
        sampling=SamplingParams(max_new_tokens=3),
        loss=LossConfig(correction="tis"),
        batch_invariant=True,
    )
    before = model.lm_head.weight.detach().clone()
    trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _LowIds(), cfg)
    history = trainer.train(2)
    assert [h["max_abs_logprob_diff"] for h in history] == [0.0, 0.0]
    assert all(h["grad_norm"] > 0 for h in history)
    assert not torch.equal(model.lm_head.weight, before)


def test_a_model_that_returns_no_logits_is_refused_naming_the_protocol():
    class Pair(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids, input_ids

    class Flat(torch.nn.Module):
        def forward(self, input_ids):
            return torch.zeros(input_ids.shape[0], 5)

    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="titan_rl.CausalLM"):
        causal_lm_logits(Pair(), ids)
    with pytest.raises(ValueError, match=r"logits of shape \(2, 5\)"):
        causal_lm_logits(Flat(), ids)
