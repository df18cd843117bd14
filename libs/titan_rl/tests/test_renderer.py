"""Rendering conversations: the same ids and mask as transformers' apply_chat_template, and the
same ids incrementally (a rollout) as for the whole conversation (SFT)."""

from __future__ import annotations

import pytest
import torch

from titan_rl import (
    ChatTemplateRenderer,
    Generation,
    Message,
    SamplingParams,
    SimpleChatRenderer,
    StepResult,
    run_episode,
)

# A Qwen2.5-style ChatML template (tool outputs inside a user turn) and a Llama-3-style one,
# each marking the assistant's tokens with {% generation %} as TRL's templates do.
CHATML = """{%- for message in messages %}
{%- if message.role == "tool" %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
{%- set role = 'ipython' if message.role == 'tool' else message.role %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
{%- if message.role == 'assistant' %}
{% generation %}{{- message.content | trim + '<|eot_id|>' }}{% endgeneration %}
{%- else %}
{{- message.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

SPECIALS = [
    "<|begin_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Ann has 37 boxes of 48 pens. How many pens?"},
    {"role": "assistant", "content": "<calc>37*48</calc>"},
    {"role": "tool", "content": "1776"},
    {"role": "assistant", "content": "1776 pens."},
    {"role": "user", "content": "And 12 boxes?"},
    {"role": "assistant", "content": " 576 "},
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """A byte-level BPE trained here (no download) with the two templates' special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [m["content"] for m in CONVERSATION] * 20 + ["the quick brown fox jumps"] * 20
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|im_end|>"
    )


class HFTitanTokenizer:
    """The app's HFTokenizer contract (encode without added BOS/EOS, decode skipping them)."""

    def __init__(self, hf):
        self.hf = hf
        self.bos_id, self.eos_id = hf.bos_token_id, hf.eos_token_id
        self.pad_id = self.eos_id

    def encode(self, text):
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids):
        return self.hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@pytest.mark.parametrize("cut", [len(CONVERSATION), 4, 6], ids=["whole", "tool-last", "user-last"])
def test_render_matches_transformers_apply_chat_template(hf_tokenizer, template, cut):
    """Ids equal apply_chat_template's; the mask is its assistant mask (content + end token).
    A conversation ending with an environment message gets the generation prompt."""
    convo = CONVERSATION[:cut]
    gen_prompt = convo[-1]["role"] != "assistant"
    want = hf_tokenizer.apply_chat_template(
        convo,
        chat_template=template,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_generation_prompt=gen_prompt,
    )
    renderer = ChatTemplateRenderer.from_tokenizer_config(
        {"chat_template": template, "bos_token": {"content": "<|begin_of_text|>"}},
        HFTitanTokenizer(hf_tokenizer),
    )
    got = renderer.render(convo, add_generation_prompt=gen_prompt)
    assert got.ids == list(want["input_ids"])
    assert got.mask == [bool(m) for m in want["assistant_masks"]]
    assert sum(got.mask) > 0


def test_renderer_reads_a_tokenizer_config_file(hf_tokenizer, tmp_path):
    """From a model folder's tokenizer_config.json (the named-template list form too)."""
    import json

    config = {
        "chat_template": [{"name": "default", "template": LLAMA3}],
        "bos_token": "<|begin_of_text|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    renderer = ChatTemplateRenderer.from_tokenizer_config(tmp_path, HFTitanTokenizer(hf_tokenizer))
    ids = renderer.render(CONVERSATION[:2], add_generation_prompt=True).ids
    want = hf_tokenizer.apply_chat_template(
        CONVERSATION[:2],
        chat_template=LLAMA3,
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    assert ids == list(want) and ids[0] == hf_tokenizer.bos_token_id


def test_stop_token_is_the_templates_end_of_turn(hf_tokenizer):
    tok = HFTitanTokenizer(hf_tokenizer)
    chatml = ChatTemplateRenderer(tok, CHATML)
    llama = ChatTemplateRenderer(tok, LLAMA3, special_tokens={"bos_token": "<|begin_of_text|>"})
    assert chatml.stop_token_ids == (hf_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert llama.stop_token_ids == (hf_tokenizer.convert_tokens_to_ids("<|eot_id|>"),)


class ReplayGenerator:
    """Samples given turns as token ids (with their stop token), recording what it was shown."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.shown, self.weight_version = turns, [], 3

    def generate(self, prompts, params, seeds):
        (prompt,) = prompts
        self.shown.append(list(prompt))
        ids = self.turns[len(self.shown) - 1]
        assert ids[-1] in params.stop_token_ids  # the renderer's stop token is a stop
        n = len(ids)
        lp = torch.full((1, n), -0.25)
        return Generation(
            torch.tensor([ids]), torch.ones(1, n, dtype=torch.bool), lp, lp, ["stop"], 3
        )

    def update_weights(self, state_dict, version):
        pass


class ScriptedEnv:
    """Replies with the conversation's environment messages, in order."""

    def __init__(self, convo: list[Message]) -> None:
        self.convo = convo

    def reset(self, seed):
        self.pos = next(i for i, m in enumerate(self.convo) if m.role == "assistant")
        return self.convo[: self.pos]

    def step(self, message):
        assert message == self.convo[self.pos]  # the decoded turn is the sampled text
        end = self.pos + 1
        while end < len(self.convo) and self.convo[end].role != "assistant":
            end += 1
        reply, self.pos = self.convo[self.pos + 1 : end], end
        return StepResult(reply, 0.5, self.pos >= len(self.convo))


@pytest.mark.parametrize("template", [CHATML, LLAMA3, None], ids=["chatml", "llama3", "simple"])
def test_incremental_rollout_gives_the_whole_conversations_ids(hf_tokenizer, tokenizer, template):
    """A rollout renders turn by turn and appends the sampled ids verbatim; with the turns
    sampled as their canonical ids, the episode is ``render(conversation)``: ids, mask, and
    each turn's prefix is exactly what the generator was shown (no re-tokenisation drift)."""
    if template is None:
        renderer = SimpleChatRenderer(tokenizer)
        convo = [Message(m["role"], m["content"].strip()) for m in CONVERSATION]
    else:
        tok = HFTitanTokenizer(hf_tokenizer)
        specials = {"bos_token": "<|begin_of_text|>"}
        renderer = ChatTemplateRenderer(tok, template, special_tokens=specials)
        convo = [Message(m["role"], m["content"].strip()) for m in CONVERSATION]
    whole = renderer.render(convo)
    turns, history = [], []
    for m in convo:
        if m.role == "assistant":
            turns.append(renderer.assistant_ids(history, m))
        history.append(m)
    gen = ReplayGenerator(turns)
    params = SamplingParams(max_new_tokens=64)
    ep = run_episode(ScriptedEnv(convo), gen, renderer, params, seed=0, max_turns=8)
    assert ep.status == "done" and ep.turns == 3 and ep.total_reward == 1.5
    n = len(ep.prompt) + len(ep.tokens)  # the episode ends at the last turn's stop token
    assert ep.prompt + ep.tokens == whole.ids[:n]
    assert [False] * len(ep.prompt) + ep.model_mask == whole.mask[:n]
    assert not any(whole.mask[n:])  # only the template's text after the last turn is left
    assert ep.messages == convo
    for (seq, start, _), shown in zip(ep.turn_spans, gen.shown, strict=True):
        assert seq == 0 and shown == ep.prompt + ep.tokens[:start]
    lp = torch.tensor(ep.logprobs)
    assert torch.all(lp[torch.tensor(ep.model_mask)] == -0.25)
    assert torch.all(lp[~torch.tensor(ep.model_mask)] == 0.0)


def test_sampled_ids_are_kept_verbatim_not_retokenised(hf_tokenizer):
    """A turn sampled as a non-canonical tokenisation of its text stays as sampled: the
    trainer trains on what the generator produced, not on a re-encoding of it."""
    tok = HFTitanTokenizer(hf_tokenizer)
    renderer = ChatTemplateRenderer(tok, CHATML)
    convo = [Message("user", "hi"), Message("assistant", "the quick"), Message("user", "ok")]
    convo.append(Message("assistant", "fox"))
    stop = renderer.stop_token_ids[0]
    odd = [i for ch in "the quick" for i in tok.encode(ch)] + [stop]  # one id per character
    assert odd[:-1] != tok.encode("the quick")
    gen = ReplayGenerator([odd, renderer.assistant_ids(convo[:3], convo[3])])
    ep = run_episode(ScriptedEnv(convo), gen, renderer, SamplingParams(max_new_tokens=32), seed=0)
    start, end = ep.turn_spans[0][1:]
    assert ep.tokens[start:end] == odd
    assert gen.shown[1] == ep.prompt + ep.tokens[: ep.turn_spans[1][1]]
    assert ep.messages[1].content == "the quick"


def test_simple_renderer_layout(tokenizer):
    """BOS, role prefixes, EOS after each assistant turn: the byte tokenizer's chat layout."""
    renderer = SimpleChatRenderer(tokenizer)
    out = renderer.render(
        [Message("user", "2*3?"), Message("assistant", "6"), Message("tool", "ok")],
        add_generation_prompt=True,
    )
    enc = tokenizer.encode
    want = [256, *enc("user: 2*3?\nassistant: "), *enc("6"), 257, *enc("tool: ok\nassistant: ")]
    assert out.ids == want
    assert [i for i, m in zip(out.ids, out.mask, strict=True) if m] == [*enc("6"), 257]
    assert renderer.stop_token_ids == (257,)


def test_a_template_that_rewrites_earlier_turns_is_refused(hf_tokenizer):
    """A template that hides earlier assistant turns (as reasoning-stripping templates do)
    cannot be rendered incrementally: refused, not silently trained on other tokens."""
    hiding = CHATML.replace(
        "message.content + '<|im_end|>'",
        "(message.content if loop.last else '...') + '<|im_end|>'",
    )
    renderer = ChatTemplateRenderer(HFTitanTokenizer(hf_tokenizer), hiding)
    convo = [Message("user", "a"), Message("assistant", "b"), Message("user", "c")]
    with pytest.raises(ValueError, match="does not render incrementally"):
        renderer.render([*convo, Message("assistant", "d")])


def test_bad_inputs_are_refused(tokenizer):
    with pytest.raises(ValueError, match="Message.role"):
        Message("robot", "hi")
    with pytest.raises(ValueError, match="history must be empty or end with an assistant"):
        SimpleChatRenderer(tokenizer).continuation([Message("user", "a")], [])
    with pytest.raises(ValueError, match="no chat_template"):
        ChatTemplateRenderer.from_tokenizer_config({"bos_token": "<s>"}, tokenizer)
    with pytest.raises(TypeError, match="StepResult.messages"):
        StepResult("text", 0.0, False)
