"""Chat SFT data: conversations rendered by titan_rl's renderer, the loss only on assistant
tokens, packed with document ids, overlong samples truncated or dropped and counted, exactly
resumable."""

from __future__ import annotations

import json

import pytest

import titan_rl
from titan_train.config import JobConfig, validate
from titan_train.data.chat import ChatSource
from titan_train.data.packing import IGNORE_INDEX, PackedLoader
from titan_train.data.tokenizers import ByteTokenizer
from titan_train.environments import ENVIRONMENTS, get_environment

TOK = ByteTokenizer()
CONVO = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6"},
]


def _source(**kw) -> ChatSource:
    kw.setdefault("conversations", lambda i: CONVO)
    return ChatSource(
        split="train",
        renderer=titan_rl.SimpleChatRenderer(TOK),
        max_tokens=kw.pop("max_tokens", 128),
        validation_fraction=0.0,
        **kw,
    )


def test_only_assistant_tokens_carry_a_loss():
    rendered = titan_rl.SimpleChatRenderer(TOK).render(CONVO)
    loader = PackedLoader(_source(), TOK, seq_len=len(rendered.ids) - 1, batch_size=1)
    batch = next(loader)
    targets = batch.labels[0]
    trained = targets != IGNORE_INDEX
    # Target t is token t + 1: trained exactly where the renderer's mask is on.
    assert trained.tolist() == rendered.mask[1:]
    assert TOK.decode(targets[trained].tolist()) == "46"
    assert (targets[trained] == TOK.eos_id).sum() == 2  # each turn's stop token is learned


def test_train_on_all_tokens_and_a_second_conversation_starts_a_new_document():
    rendered = titan_rl.SimpleChatRenderer(TOK).render(CONVO)
    n = len(rendered.ids)
    loader = PackedLoader(_source(train_on="all"), TOK, seq_len=2 * n, batch_size=1)
    batch = next(loader)
    assert batch.document_ids[0, n - 1] == 0 and batch.document_ids[0, n] == 1
    assert batch.positions[0, n] == 0
    labels = batch.labels[0]
    assert labels[n - 1] == IGNORE_INDEX  # never predict across documents
    assert (labels[: n - 1] != IGNORE_INDEX).all()


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_conversations_are_truncated_or_dropped_and_counted(overlong):
    fits = len(titan_rl.SimpleChatRenderer(TOK).render(CONVO).ids)
    long = [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y"}]
    convos = [long, CONVO, long, CONVO]
    source = _source(conversations=lambda i: convos[i % 4], max_tokens=fits, overlong=overlong)
    docs = list(zip(range(4), source.documents(), strict=False))
    assert source.overlong_count == 2
    lengths = [len(doc[0]) for _, doc in docs]
    if overlong == "drop":
        assert lengths[0] == lengths[2] == 0  # consumed, so a resume skips them again
    else:
        assert lengths[0] == lengths[2] == fits
    assert lengths[1] == fits


def test_resumed_loader_continues_exactly():
    ref = PackedLoader(_source(), TOK, seq_len=32, batch_size=2)
    first = [next(ref) for _ in range(3)]
    resumed = PackedLoader(_source(), TOK, seq_len=32, batch_size=2)
    resumed.load_state_dict(json.loads(json.dumps(_state_after(2))))
    assert resumed.__next__().labels.tolist() == first[2].labels.tolist()


def _state_after(n: int) -> dict:
    loader = PackedLoader(_source(), TOK, seq_len=32, batch_size=2)
    for _ in range(n):
        next(loader)
    return loader.state_dict()


def test_messages_files_and_their_errors(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CONVO, "id": i}) for i in range(5)))
    source = ChatSource(
        split="train",
        renderer=titan_rl.SimpleChatRenderer(TOK),
        max_tokens=128,
        paths=(str(path),),
        validation_fraction=0.0,
    )
    assert len(list(source.documents())) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no messages"}))
    with pytest.raises(ValueError, match=r"data.messages_field='messages'.*fields: \['text'\]"):
        ChatSource(
            split="train",
            renderer=titan_rl.SimpleChatRenderer(TOK),
            max_tokens=128,
            paths=(str(bad),),
        )


def test_chat_config_needs_exactly_one_source():
    cfg = JobConfig()
    cfg.data.source = "chat"
    with pytest.raises(ValueError, match="either data.paths .* or data.chat_environment"):
        validate(cfg)
    with pytest.raises(ValueError, match="environment 'nope' is unknown"):
        get_environment("nope")


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_each_environment_corpus_is_a_correct_deterministic_demonstration(name):
    spec = get_environment(name)
    a, b = spec.demonstrations(0), spec.demonstrations(0)
    for i in range(3):
        convo = a(i)
        assert convo == b(i) and convo != spec.demonstrations(1)(i)
        assert convo[-1].role == "assistant"
        rendered = titan_rl.SimpleChatRenderer(TOK).render(convo)
        assert any(rendered.mask) and not all(rendered.mask)


def test_a_chat_sample_never_straddles_two_rows():
    # A sample split across rows would be trained, in its second row, to answer without its
    # question: every conversation must sit whole inside one row (the rest of a row padded,
    # with no loss).
    rendered = titan_rl.SimpleChatRenderer(TOK).render(CONVO)
    n = len(rendered.ids)
    seq_len = n + n // 2  # one sample fits a row, two do not
    loader = PackedLoader(_source(), TOK, seq_len=seq_len, batch_size=4)
    batch = next(loader)
    for row in range(4):
        docs = batch.document_ids[row]
        labels = batch.labels[row]
        trained = labels != IGNORE_INDEX
        # The trained targets of a row are exactly one conversation's assistant tokens.
        assert TOK.decode(labels[trained].tolist()) == "46", row
        assert int((docs == docs[0]).sum()) in (n, seq_len)  # a whole sample or padding
    assert (batch.input_ids == TOK.pad_id).any()


def test_digits_corpus_answers_are_right_and_held_out_conversations_differ():
    from titan_train.data.chat_corpus import builtin_conversations

    train = builtin_conversations("digits", 0)
    for i in range(200):
        convo = train(i)
        assert convo == train(i) and len(convo) in (2, 4)
        for user, reply in zip(convo[::2], convo[1::2], strict=True):
            task, digits = user.content.split(": ")
            ds = digits.split()
            want = {
                "reverse": " ".join(ds[::-1]),
                "first": ds[0],
                "last": ds[-1],
            }[task]
            assert reply.role == "assistant" and reply.content == want
    assert train(0) != builtin_conversations("digits", 1)(0)
    with pytest.raises(ValueError, match="not a built-in chat corpus; known: code, digits"):
        builtin_conversations("nope", 0)


def test_exact_match_counts_a_sample_right_only_when_every_trained_token_is():
    import torch

    from titan_train.evaluation import evaluate

    source = _source(
        conversations=lambda i: [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i % 7}"},
        ]
    )
    loader = PackedLoader(source, TOK, seq_len=64, batch_size=2)
    batch = next(PackedLoader(source, TOK, seq_len=64, batch_size=2))
    samples = len(set(batch.document_ids[batch.labels != IGNORE_INDEX].tolist()))

    class Oracle(torch.nn.Module):  # logits that predict the labels, but for one token
        def __init__(self, wrong: int) -> None:
            super().__init__()
            self.wrong = wrong

        def forward(self, ids, **_):
            labels = batch.labels.clamp(min=0).clone()
            trained = (batch.labels != IGNORE_INDEX).flatten().nonzero().flatten()
            if self.wrong >= 0:
                labels.view(-1)[trained[self.wrong]] += 1
            return torch.nn.functional.one_hot(labels, TOK.vocab_size + 2).float() * 9

    _, _, right, answers = evaluate(Oracle(-1), loader, 1, torch.device("cpu"), exact_match=True)
    assert (right, answers) == (samples, samples) and samples > 3
    loader = PackedLoader(source, TOK, seq_len=64, batch_size=2)
    _, _, right, answers = evaluate(Oracle(0), loader, 1, torch.device("cpu"), exact_match=True)
    assert (right, answers) == (samples - 1, samples)


def test_facts_corpus_answers_come_from_its_tables():
    from titan_train.data import chat_corpus as cc

    convos = [cc.builtin_conversations("facts", 0)(i) for i in range(300)]
    for convo in convos:
        assert 2 <= len(convo) <= 6
        for user, reply in zip(convo[::2], convo[1::2], strict=True):
            q = user.content.removeprefix("Please tell me: ")
            if q.startswith("What is the capital of "):
                want = cc._CAPITALS[q[23:-1]]
            elif q.startswith("What is the opposite of "):
                want = cc._OPPOSITES[q[24:-1]]
            elif q.startswith("Which day comes after "):
                want = cc._DAYS[(cc._DAYS.index(q[22:-1]) + 1) % 7]
            else:
                a, b = q.removeprefix("What is ").removesuffix("?").split(" + ")
                want = str(int(a) + int(b))
            assert reply.content == want
    assert convos[0] == cc.builtin_conversations("facts", 0)(0)
    # Every fact equally often (a table's share follows its size): the 100 sums are not
    # seen a quarter as often as the 30 capitals, which left them unlearned.
    asked = [
        m.content.removeprefix("Please tell me: ")
        for i in range(3000)
        for m in cc.builtin_conversations("facts", 1)(i)
        if m.role == "user"
    ]
    assert len(set(asked)) == len(cc._FACTS) == 157
    sums = sum(q.startswith("What is ") and "+" in q for q in asked) / len(asked)
    assert abs(sums - 100 / 157) < 0.03, sums
