"""Built-in corpus, tokenizers, packing with document ids and exact loader resume."""

from __future__ import annotations

import json

import pytest
import torch

from titan_train.data.arithmetic import arithmetic_problem
from titan_train.data.packing import IGNORE_INDEX, PackedLoader
from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import ByteTokenizer, build_tokenizer


def _loader(split="train", rank=0, world_size=1, **kw) -> PackedLoader:
    src = DocumentSource(kind="arithmetic", split=split, rank=rank, world_size=world_size, **kw)
    return PackedLoader(src, ByteTokenizer(), seq_len=32, batch_size=4)


def test_arithmetic_corpus_is_a_pure_function_of_seed_and_index():
    p = arithmetic_problem(0, 7)
    assert p == arithmetic_problem(0, 7) and p != arithmetic_problem(1, 7)
    assert p.prompt.endswith("=") and str(eval(p.prompt[:-1])) == p.answer


def test_byte_tokenizer_round_trips_text():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("12+30=42 é")) == "12+30=42 é"
    assert max(tok.bos_id, tok.eos_id, tok.pad_id) < tok.vocab_size


def test_packed_rows_mark_documents_and_never_predict_across_them():
    batch = next(_loader())
    assert batch.input_ids.shape == (4, 32)
    ids, labels, docs = batch.input_ids, batch.labels, batch.document_ids
    # Inside a document the label is the next input token.
    same = docs[:, 1:] == docs[:, :-1]
    assert torch.equal(labels[:, :-1][same], ids[:, 1:][same])
    # A label is ignored exactly where the next token belongs to another document.
    assert (labels[:, :-1][~same] == IGNORE_INDEX).all()
    # Positions restart at every BOS.
    assert (batch.positions[ids == ByteTokenizer.bos_id] == 0).all()


def test_consecutive_rows_share_one_token_so_no_prediction_is_lost():
    b = next(_loader())
    # Row r's last label is row r+1's first input (or ignored at a document boundary).
    last_labels, next_inputs = b.labels[:-1, -1], b.input_ids[1:, 0]
    kept = last_labels != IGNORE_INDEX
    assert torch.equal(last_labels[kept], next_inputs[kept])


def test_resumed_loader_continues_bitwise():
    full = _loader()
    for _ in range(3):
        next(full)
    state = json.loads(json.dumps(full.state_dict()))  # must survive a non-pickle format
    expected = [next(full) for _ in range(2)]
    resumed = _loader()
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.labels, want.labels)
        assert torch.equal(got.document_ids, want.document_ids)


def test_ranks_and_splits_see_disjoint_documents():
    def docs(split, rank, world):
        src = DocumentSource(kind="arithmetic", split=split, rank=rank, world_size=world)
        return [d for _, d in zip(range(200), src.documents(), strict=False)]

    r0, r1, val = docs("train", 0, 2), docs("train", 1, 2), docs("validation", 0, 1)
    assert not set(r0) & set(r1) or len(set(r0)) < len(r0)  # disjoint up to repeated text
    everything = DocumentSource(kind="arithmetic", split="train").documents()
    assert [d for _, d in zip(range(400), everything, strict=False)][::2] == r0
    assert [
        d
        for _, d in zip(
            range(400), DocumentSource(kind="arithmetic", split="train").documents(), strict=False
        )
    ][1::2] == r1
    assert len(val) == 200
    # Held-out documents are every 100th of the corpus.
    assert val[1] == arithmetic_problem(0, 100).text


def test_local_jsonl_files_through_datasets(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": f"doc {i}"}) + "\n" for i in range(10)))
    src = DocumentSource(
        kind="files", split="train", paths=(str(path),), text_field="body", validation_fraction=0
    )
    assert [d for _, d in zip(range(3), src.documents(), strict=False)] == [
        "doc 0",
        "doc 1",
        "doc 2",
    ]
    batch = next(PackedLoader(src, ByteTokenizer(), seq_len=16, batch_size=8))  # needs 2 epochs
    assert batch.input_ids.shape == (8, 16)


def test_validation_documents_stay_out_of_every_shuffled_epoch(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))

    def split(name: str, epoch: int) -> list[str]:
        src = DocumentSource(
            kind="files", split=name, paths=(str(path),), validation_fraction=0.25, seed=3
        )
        return list(src.documents(epoch=epoch))

    val = split("validation", 0)
    assert val == [f"doc {i}" for i in range(0, 40, 4)]
    assert sorted(split("validation", 2)) == sorted(val)
    for epoch in (1, 2):
        train = split("train", epoch)
        assert train != split("train", 0)  # reshuffled
        assert sorted(train) == sorted(split("train", 0)) and not set(train) & set(val)


def test_bad_data_inputs_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        DocumentSource(kind="files", split="train", paths=(str(tmp_path / "nope.jsonl"),))
    bad = tmp_path / "x.csv"
    bad.write_text("a\n")
    with pytest.raises(ValueError, match="suffix '.csv'"):
        DocumentSource(kind="files", split="train", paths=(str(bad),))
    good = tmp_path / "x.jsonl"
    good.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ValueError, match="data.text_field='body'"):
        DocumentSource(kind="files", split="train", paths=(str(good),), text_field="body")
    with pytest.raises(ValueError, match="no such tokenizer.json"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


def test_default_arithmetic_corpus_is_unchanged_by_the_slip_and_reverse_options():
    # The first training documents of seed 0, as the corpus wrote them before the options
    # existed: the default run (`uv run titan-train`) and its documented numbers stay valid.
    golden = [
        "72+97=169",
        "11+10=21",
        "75+69=144",
        "38+13=51",
        "94-45=49",
        "62+97=159",
        "50-19=31",
        "47+48=95",
        "9*5=45",
        "54+61=115",
    ]
    default = DocumentSource(kind="arithmetic", split="train").documents()
    explicit = DocumentSource(
        kind="arithmetic", split="train", slip_rate=0.0, reverse_answer=False
    ).documents()
    assert [next(default) for _ in range(10)] == golden
    assert [next(explicit) for _ in range(10)] == golden


def test_arithmetic_source_writes_the_slip_rule_and_reversed_answers():
    docs = DocumentSource(
        kind="arithmetic", split="train", seed=3, slip_rate=1.0, reverse_answer=True
    ).documents()
    # Validation takes index 0; 97+26: carry-less 13, reversed "31"; 6*9 is never slipped.
    assert [next(docs) for _ in range(5)] == ["6*9=45", "97+26=31", "10*8=08", "25+21=64", "6*4=42"]


def test_bad_slip_rate_names_the_field():
    from titan_train.config import JobConfig, validate

    with pytest.raises(ValueError, match="data.arithmetic_slip_rate=1.5"):
        DocumentSource(kind="arithmetic", split="train", slip_rate=1.5)
    cfg = JobConfig()
    cfg.data.arithmetic_slip_rate = -0.1
    with pytest.raises(ValueError, match="data.arithmetic_slip_rate=-0.1"):
        validate(cfg)
