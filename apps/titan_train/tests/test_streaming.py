"""``--data.streaming``: each data-parallel rank streams its own files (HF ``datasets``),
shuffled per epoch through a seeded buffer, and resumes exactly, also after kill -9."""

from __future__ import annotations

import builtins
import json
import os
import signal
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import titan_rl
from titan_testing import DistributedTestError, run_distributed
from titan_train.cli import main
from titan_train.config import JobConfig, validate
from titan_train.data.chat import ChatSource
from titan_train.data.file_records import FileRecords
from titan_train.data.packing import PackedLoader
from titan_train.data.sources import DocumentSource
from titan_train.data.tokenizers import ByteTokenizer
from titan_train.loaders import loaders

FILES, ROWS = 4, 12


def _shards(folder: Path, files: int = FILES, rows: int = ROWS) -> tuple[str, ...]:
    """``files`` parquet shards of ``rows`` short documents, named ``f<file>r<row>``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        path = folder / f"shard-{f}.parquet"
        pq.write_table(
            pa.table({"text": [f"f{f}r{r} " + "x" * (r % 5) for r in range(rows)]}), path
        )
        paths.append(str(path))
    return tuple(paths)


def _docs(paths, *, rank=0, world=2, epoch=0, split="train", fraction=0.0, **kw) -> list[str]:
    src = DocumentSource(
        kind="files",
        split=split,
        paths=paths,
        rank=rank,
        world_size=world,
        validation_fraction=fraction,
        streaming=True,
        **kw,
    )
    return [d.split()[0] for d in src.documents(epoch=epoch)]


def test_each_rank_opens_only_its_own_files_every_epoch(tmp_path, monkeypatch):
    paths = _shards(tmp_path)
    opened: list[str] = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        if str(file).endswith(".parquet"):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    # (Building a rank's stream checks 8 bytes of every file and reads the first file's schema
    # and first record, to check formats and fields; records come from its own files only.)
    for epoch in (0, 1, 2):
        seen = []
        for rank in (0, 1):
            records = FileRecords(
                paths, seed=5, shuffle_buffer=8, rank=rank, world_size=2, streaming=True
            )
            opened.clear()
            monkeypatch.setattr(builtins, "open", spy)
            docs = [rec["text"].split()[0] for rec in records.split("train", 0.0, epoch=epoch)]
            monkeypatch.setattr(builtins, "open", real_open)
            files = {paths[int(d[1 : d.index("r")])] for d in docs}
            assert set(opened) == files and len(files) == FILES // 2  # opened = read from
            seen.append((files, docs))
        (files0, docs0), (files1, docs1) = seen
        assert not files0 & files1 and files0 | files1 == set(paths)
        assert sorted(docs0 + docs1) == sorted(
            f"f{f}r{r}" for f in range(FILES) for r in range(ROWS)
        )


def test_the_file_deal_is_reshuffled_between_epochs(tmp_path):
    paths = _shards(tmp_path)
    by_epoch = [
        {_file_set(_docs(paths, rank=r, epoch=e, shuffle_buffer=8)) for r in (0, 1)}
        for e in range(4)
    ]
    assert len({frozenset(x) for x in by_epoch}) > 1  # the file deal is reshuffled


def _file_set(docs: list[str]) -> frozenset[str]:
    return frozenset(d.split("r")[0] for d in docs)


def test_fewer_files_than_ranks_is_an_error_naming_the_field(tmp_path):
    paths = _shards(tmp_path, files=1)
    with pytest.raises(
        ValueError, match=r"data.streaming: data.paths has 1 file\(s\) for 2 data-parallel ranks"
    ):
        _docs(paths)
    # Without streaming every rank reads every file: one file is fine.
    src = DocumentSource(kind="files", split="train", paths=paths, rank=1, world_size=2)
    assert next(src.documents())


def test_shuffle_is_a_function_of_seed_and_epoch(tmp_path):
    paths = _shards(tmp_path)
    order = {
        (s, e): _docs(paths, rank=1, epoch=e, seed=s, shuffle_buffer=8)
        for s in (0, 1)
        for e in (0, 1)
    }
    assert order[0, 0] == _docs(paths, rank=1, epoch=0, seed=0, shuffle_buffer=8)  # reproducible
    assert len({tuple(o) for o in order.values()}) == 4  # each seed and epoch its own order
    assert order[0, 0] != sorted(order[0, 0], key=lambda d: (int(d[1]), int(d[3:])))  # shuffled
    # Buffer 0: the files' order, rank r taking files r, r + 2, ... in every epoch.
    fixed = _docs(paths, rank=1, epoch=3, shuffle_buffer=0)
    assert fixed == [f"f{f}r{r}" for f in (1, 3) for r in range(ROWS)]


def test_validation_records_stay_out_of_every_epoch_on_every_rank(tmp_path):
    paths = _shards(tmp_path)
    common = dict(fraction=0.25, shuffle_buffer=8, seed=2)
    val = {d for r in (0, 1) for d in _docs(paths, rank=r, split="validation", **common)}
    assert len(val) == FILES * ROWS // 4
    for epoch in (0, 1, 2):
        train = [d for r in (0, 1) for d in _docs(paths, rank=r, epoch=epoch, **common)]
        assert len(train) == len(set(train)) == FILES * ROWS - len(val) and not set(train) & val


def test_chat_files_stream_per_rank_too(tmp_path):
    paths = []
    for f in range(2):
        path = tmp_path / f"chat-{f}.jsonl"
        lines = [
            {
                "messages": [
                    {"role": "user", "content": f"f{f}r{r}"},
                    {"role": "assistant", "content": "ok"},
                ]
            }
            for r in range(5)
        ]
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        paths.append(str(path))
    tok = ByteTokenizer()
    seen = []
    for rank in (0, 1):
        src = ChatSource(
            split="train",
            renderer=titan_rl.SimpleChatRenderer(tok),
            max_tokens=64,
            rank=rank,
            world_size=2,
            validation_fraction=0.0,
            paths=tuple(paths),
            streaming=True,
            shuffle_buffer=4,
        )
        texts = [tok.decode(ids) for ids, _ in src.documents()]
        seen.append({f for f in ("f0", "f1") for t in texts if f"{f}r" in t})
        assert len(texts) == 5
    assert seen[0] | seen[1] == {"f0", "f1"} and not seen[0] & seen[1]


def test_without_streaming_validation_records_stay_out_of_shuffled_epochs_of_several_files(
    tmp_path,
):
    # Guards: a record's split index was its position in the epoch's stream, which moved with
    # the shuffled file order, so validation records of one epoch were trained on in another.
    paths = _shards(tmp_path)

    def docs(split: str, epoch: int) -> list[str]:
        src = DocumentSource(
            kind="files",
            split=split,
            paths=paths,
            validation_fraction=0.25,
            shuffle_buffer=8,
            seed=1,
        )
        return [d.split()[0] for d in src.documents(epoch=epoch)]

    val = set(docs("validation", 0))
    assert len(val) == FILES * ROWS // 4
    for epoch in (1, 2):
        train = docs("train", epoch)
        assert sorted(train) == sorted(docs("train", 0)) and not set(train) & val


STREAM = ["--data.source", "files", "--data.streaming", "--data.paths"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data.streaming"], "data.streaming needs data.source='files', or 'chat' with"),
        ([*STREAM, "{one}", "--data.shuffle-buffer", "-1"], "data.shuffle_buffer=-1 must be >= 0"),
        ([*STREAM, "{one}"], "data.paths has 1 file(s) for 2 data-parallel ranks"),
        ([*STREAM, "{fake}", "{one}"], "fake.parquet' is not a parquet file, but its suffix"),
    ],
)
def test_a_bad_streaming_setting_is_one_error_line_before_any_process(
    tmp_path, capsys, argv, message
):
    (one,) = _shards(tmp_path, files=1)
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"text": "json, not parquet"}\n')
    argv = [a.format(one=one, fake=fake) for a in argv]
    runs = tmp_path / "runs"
    assert main(["--output-dir", str(runs), "--training.steps", "1", "--nproc", "2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("titan-train: error: ") and len(err.splitlines()) == 1, err
    assert message in err, err
    assert not runs.exists()


def _streaming_loader(paths, rank=0, world=2) -> PackedLoader:
    src = DocumentSource(
        kind="files",
        split="train",
        paths=paths,
        rank=rank,
        world_size=world,
        validation_fraction=0.1,
        streaming=True,
        shuffle_buffer=8,
        seed=7,
    )
    return PackedLoader(src, ByteTokenizer(), seq_len=16, batch_size=2)


def test_resume_is_exact_mid_epoch_and_across_an_epoch_boundary(tmp_path):
    paths = _shards(tmp_path)
    full = _streaming_loader(paths, rank=1)
    states, batches = [], []
    for _ in range(24):  # a rank's epoch is ~14 batches: this crosses into epoch 1
        states.append(json.loads(json.dumps(full.state_dict())))  # no pickle needed
        batches.append(next(full).input_ids)
    cuts = [5, next(i for i, s in enumerate(states) if s["epoch"] == 1 and s["consumed"] > 0)]
    assert states[cuts[0]]["epoch"] == 0 and states[cuts[0]]["consumed"] > 0
    for cut in cuts:
        resumed = _streaming_loader(paths, rank=1)
        resumed.load_state_dict(states[cut])
        for want in batches[cut:]:
            assert torch.equal(next(resumed).input_ids, want)


def test_bad_streaming_inputs_name_the_field_value_and_what_is_allowed(tmp_path):
    paths = _shards(tmp_path)
    with pytest.raises(ValueError, match="data.paths: .*nope.parquet' does not exist"):
        _docs((*paths[:1], str(tmp_path / "nope.parquet")))
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"text": "json, not parquet"}\n')
    with pytest.raises(ValueError, match=r"data.paths: .*fake.parquet' is not a parquet file"):
        _docs((*paths[:1], str(fake)), world=1)
    renamed = tmp_path / "parquet.jsonl"
    renamed.write_bytes(Path(paths[1]).read_bytes())
    with pytest.raises(
        ValueError, match=r"parquet.jsonl' is a parquet file, but its suffix says json"
    ):
        _docs((str(renamed),), world=1)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"data.paths=.*broken.jsonl.* as json: "):
        _docs((str(broken),), world=1)
    mixed = tmp_path / "more.jsonl"
    mixed.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"data.paths mixes formats \['json', 'parquet'\]"):
        _docs((paths[0], str(mixed)))
    with pytest.raises(ValueError, match=r"data.shuffle_buffer=-1 must be >= 0"):
        _docs(paths, shuffle_buffer=-1)
    with pytest.raises(ValueError, match="data.streaming needs files to stream"):
        DocumentSource(kind="arithmetic", split="train", streaming=True)
    for source, extra in (
        ("arithmetic", {}),
        ("shapes", {}),
        ("image_files", {"paths": paths}),
        ("chat", {"chat_environment": "x"}),
    ):
        cfg = JobConfig()
        cfg.data.source, cfg.data.streaming = source, True
        for k, v in extra.items():
            setattr(cfg.data, k, v)
        with pytest.raises(ValueError, match=f"data.streaming needs .* got data.source='{source}"):
            validate(cfg)
    cfg = JobConfig()
    cfg.data.shuffle_buffer = -3
    with pytest.raises(ValueError, match=r"data.shuffle_buffer=-3 must be >= 0"):
        validate(cfg)


# --- kill -9 of a 2-rank job and resume --------------------------------------------------

STEPS, SAVE_AT, KILL_AFTER = 12, 4, 6
"""Steps of the job, its checkpoint interval, and the step after which rank 1 is killed."""


def _job_config(paths: tuple[str, ...]) -> JobConfig:
    cfg = JobConfig()
    d, t = cfg.data, cfg.training
    d.source, d.paths, d.streaming, d.shuffle_buffer = "files", paths, True, 8
    d.validation_fraction, t.seq_len, t.batch_size, t.seed = 0.1, 16, 2, 3
    validate(cfg)
    return cfg


def _stream_job(paths: tuple[str, ...], out: str, *, resume: bool, hang_after: int) -> list:
    """One rank of a job that reads the app's streaming loader, saves the loader's state as
    the app does (``PerRank`` item ``data``) every ``SAVE_AT`` steps, and logs each step's
    token ids; it stops (hangs) after step ``hang_after``, where the test kills it."""
    import torch.distributed as dist

    from torch_checkpointing import CheckpointManager, PerRank

    rank = dist.get_rank()
    Path(out, f"pid{rank}").write_text(str(os.getpid()))
    loader, _ = loaders(_job_config(paths), ByteTokenizer(), dp_rank=rank, dp_size=2)
    steps = []
    log_path = Path(out, f"tokens{rank}.jsonl")
    with CheckpointManager(Path(out, "ckpt"), async_mode="off") as ckpt, log_path.open("a") as log:
        step = 0
        if resume:
            step = ckpt.latest_step()
            ckpt.load({"data": PerRank(loader)}, step)
        while step < STEPS:
            ids = next(loader).input_ids.tolist()
            step += 1
            steps.append((step, ids, loader.state_dict()["epoch"]))
            log.write(json.dumps({"step": step, "ids": ids}) + "\n")
            log.flush()
            if step % SAVE_AT == 0:
                ckpt.save(step, {"data": PerRank(loader)})
            if step == hang_after:
                while True:  # mid-stream, until SIGKILL
                    time.sleep(1)
    return steps


@pytest.mark.slow  # two 2-rank jobs: ~45 s on 2 busy shared cores
def test_kill_9_of_two_ranks_then_resume_gives_the_uninterrupted_token_stream(tmp_path):
    paths = _shards(tmp_path / "data")
    # The uninterrupted stream of each rank: its loader (rank-local, no collectives) read
    # here; the killed job's steps before the kill must match it too.
    reference = []
    for rank in (0, 1):
        loader, _ = loaders(_job_config(paths), ByteTokenizer(), dp_rank=rank, dp_size=2)
        reference.append([next(loader).input_ids.tolist() for _ in range(STEPS)])
        assert loader.state_dict()["epoch"] >= 1  # the stream crossed an epoch boundary

    out = tmp_path / "job"
    out.mkdir()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            run_distributed(
                _stream_job, 2, paths, str(out), resume=False, hang_after=KILL_AFTER, grace=1
            )
        except DistributedTestError as e:
            errors.append(e)

    job = threading.Thread(target=run)
    job.start()
    deadline = time.monotonic() + 120
    while not all(_logged_steps(out / f"tokens{r}.jsonl") >= KILL_AFTER for r in (0, 1)):
        assert time.monotonic() < deadline and job.is_alive(), (
            "the job never reached the kill point"
        )
        time.sleep(0.1)
    os.kill(int((out / "pid1").read_text()), signal.SIGKILL)  # a real kill -9, mid-stream
    job.join(timeout=60)
    assert errors and "killed by signal 9" in str(errors[0]), errors
    before = [
        [json.loads(x) for x in (out / f"tokens{r}.jsonl").read_text().splitlines()] for r in (0, 1)
    ]

    resumed = run_distributed(_stream_job, 2, paths, str(out), resume=True, hang_after=-1)
    for rank in (0, 1):
        assert [rec["step"] for rec in before[rank]] == list(range(1, KILL_AFTER + 1))
        assert [rec["ids"] for rec in before[rank]] == reference[rank][:KILL_AFTER]
        assert [step for step, _, _ in resumed[rank]] == list(range(SAVE_AT + 1, STEPS + 1))
        assert [ids for _, ids, _ in resumed[rank]] == reference[rank][SAVE_AT:]


def _logged_steps(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0
