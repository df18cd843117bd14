"""Prompts as TRL and veRL hold them: a left-padded ``(B, P)`` tensor with its attention mask.

``sequence_logprobs`` packs such rows exactly as it packs token lists, so the log-probs equal
the list path's bit for bit (batch-invariant mode or not) whatever the amount of padding, for
a titan_models model and a transformers one.
"""

from __future__ import annotations

import pytest
import torch

from titan_rl import batch_invariant, pack_sequences, sequence_logprobs

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [[1, 5, 9], [2, 7, 3, 3, 8, 1], [4], [6, 6]]
RESPONSES = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0], [8, 9, 10, 11], [12, 0, 13, 0]])
# Row 3 has a masked-out token between two real ones (an environment's, multi-turn).
RESPONSE_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]]).bool()


def left_padded(prompts: list[list[int]], extra: int = 0, pad_id: int = 0):
    """``(B, P)`` ids and 0/1 mask, left padding to the longest prompt plus ``extra`` columns
    (as TRL's ``pad(..., padding_side="left")`` and veRL's data loader build them)."""
    P = max(map(len, prompts)) + extra
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, P - len(p) :] = torch.tensor(p)
        mask[row, P - len(p) :] = 1
    return ids, mask


def hf_llama() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
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


def test_packing_a_left_padded_tensor_gives_the_list_rows():
    want_BS, want_starts = pack_sequences(PROMPTS, RESPONSES, RESPONSE_MASK)
    for extra, pad_id in ((0, 0), (5, 47)):
        ids, mask = left_padded(PROMPTS, extra, pad_id)
        got_BS, starts = pack_sequences(ids, RESPONSES, RESPONSE_MASK, prompt_mask=mask)
        assert torch.equal(got_BS, want_BS)
        assert torch.equal(starts, want_starts)


@pytest.mark.parametrize("family", ["titan", "hf"])
@pytest.mark.parametrize("invariant", [True, False])
def test_left_padded_prompts_give_the_list_paths_bits_at_any_padding(
    family, invariant, model_factory
):
    """Guards the positions: were the pad tokens fed to the model (or positions counted from
    column 0 of the padded row), the log-probs would move with the amount of padding."""
    model = model_factory() if family == "titan" else hf_llama()
    mode = batch_invariant if invariant else torch.enable_grad
    with torch.no_grad(), mode():
        want = sequence_logprobs(model, PROMPTS, RESPONSES, RESPONSE_MASK, temperature=0.7)
        for extra in (0, 3, 11):
            ids, mask = left_padded(PROMPTS, extra)
            got = sequence_logprobs(
                model, ids, RESPONSES, RESPONSE_MASK, prompt_mask=mask, temperature=0.7
            )
            assert torch.equal(got, want), extra
    assert (want[RESPONSE_MASK] < 0).all() and (want[~RESPONSE_MASK] == 0).all()


def test_left_padded_prompts_match_an_hf_forward_with_attention_mask_and_positions():
    """The layout veRL's actor runs: the whole left-padded row with its attention mask and
    positions counted over real tokens (``cumsum(mask) - 1``), logits of the response span.
    Its attention mask covers a masked-out environment token (context, not trained on)."""
    model = hf_llama().double()  # fp64: the two paths differ only by rounding
    ids, prompt_mask = left_padded(PROMPTS, extra=2)
    P, T = ids.shape[1], RESPONSES.shape[1]
    input_ids = torch.cat([ids, RESPONSES], 1)
    last_B = (RESPONSE_MASK * torch.arange(1, T + 1)).amax(1)
    in_row_BT = torch.arange(T)[None, :] < last_B[:, None]
    attention_mask = torch.cat([prompt_mask, in_row_BT.long()], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    ref = logits[:, P - 1 : -1].log_softmax(-1).gather(-1, RESPONSES[..., None])[..., 0]
    got = sequence_logprobs(model, ids, RESPONSES, RESPONSE_MASK, prompt_mask=prompt_mask)
    torch.testing.assert_close(got[RESPONSE_MASK], ref[RESPONSE_MASK], rtol=0, atol=1e-12)


def test_entropy_comes_from_the_same_forward(tiny_model):
    ids, mask = left_padded(PROMPTS, extra=1)
    lp, entropy = sequence_logprobs(
        tiny_model, ids, RESPONSES, RESPONSE_MASK, prompt_mask=mask, with_entropy=True
    )
    assert torch.equal(lp, sequence_logprobs(tiny_model, PROMPTS, RESPONSES, RESPONSE_MASK))
    seq_BS, starts = pack_sequences(PROMPTS, RESPONSES, RESPONSE_MASK)
    logits = tiny_model(seq_BS)
    for row in range(len(PROMPTS)):
        for t in RESPONSE_MASK[row].nonzero().flatten().tolist():
            p = logits[row, int(starts[row]) + t - 1].float().softmax(-1)
            want = -(p * p.log()).sum()
            torch.testing.assert_close(entropy[row, t], want, rtol=1e-5, atol=1e-5)
    assert (entropy[~RESPONSE_MASK] == 0).all()
    entropy.sum().backward()  # differentiable: an entropy bonus trains through it
    assert tiny_model.output.weight.grad is not None


@pytest.mark.parametrize(
    ("prompt_mask", "match"),
    [
        ([[1, 1, 0], [0, 1, 1], [1, 1, 1], [0, 0, 1]], r"row 0 is \[1, 1, 0\].*left padding"),
        ([[0, 1, 1], [1, 0, 1], [1, 1, 1], [0, 0, 1]], r"row 1 is \[1, 0, 1\]"),
        ([[0, 1, 1], [0, 1, 1], [0, 0, 0], [0, 0, 1]], r"row 2 .* at least one real token"),
        ([[1, 1], [1, 1], [1, 1], [1, 1]], r"prompt_mask \(4, 2\) must have the shape"),
    ],
)
def test_a_prompt_mask_that_is_not_left_padding_is_refused(prompt_mask, match):
    ids = torch.ones(4, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        pack_sequences(ids, RESPONSES, RESPONSE_MASK, prompt_mask=torch.tensor(prompt_mask))


def test_bad_prompts_are_refused_before_the_forward(tiny_model):
    with pytest.raises(ValueError, match="prompt_mask is for a left-padded"):
        sequence_logprobs(
            tiny_model, PROMPTS, RESPONSES, RESPONSE_MASK, prompt_mask=torch.ones(4, 6)
        )
    with pytest.raises(ValueError, match=r"integer ids \(B, P\) with B = 4"):
        sequence_logprobs(tiny_model, torch.ones(3, 5, dtype=torch.long), RESPONSES, RESPONSE_MASK)
    with pytest.raises(ValueError, match="integer ids"):
        sequence_logprobs(tiny_model, torch.ones(4, 5), RESPONSES, RESPONSE_MASK)
    with pytest.raises(ValueError, match="at least one token"):
        sequence_logprobs(tiny_model, [[1], [], [2], [3]], RESPONSES, RESPONSE_MASK)
    with pytest.raises(ValueError, match="3 prompts for 4 responses"):
        sequence_logprobs(tiny_model, PROMPTS[:3], RESPONSES, RESPONSE_MASK)
    with pytest.raises(TypeError, match="prompts must be a list"):
        sequence_logprobs(tiny_model, "1 2 3", RESPONSES, RESPONSE_MASK)
