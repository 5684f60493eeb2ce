"""Data: prepared folders (format, determinism, resume, damage), blends, the sample order, and dp sharding."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from large_model_training.config import DataConfig
from large_model_training.data.blend import Blend, parse_blend
from large_model_training.data.dataset import load_training_data, resolve_data
from large_model_training.data.loader import BatchLoader, Permutation, Shard
from large_model_training.data.prepare import PrepareRequest, prepare
from large_model_training.data.prepared import open_prepared, verify_prepared
from large_model_training.data.sources import stdlib_files
from large_model_training.errors import ConfigError


def _loader(tokens, dp_rank, dp_size, global_batch=12, micro=2, start_step=0, prefetch=False, **kw):
    return BatchLoader(
        tokens,
        seq_len=8,
        shard=Shard(dp_rank, dp_size, global_batch, micro),
        seed=7,
        device=torch.device("cpu"),
        start_step=start_step,
        prefetch=prefetch,
        **kw,
    )


def _documents(folder, n=60):
    """n small JSONL documents ("doc 0 ..." of varying length) in two files: the prepare tests' input."""
    os.makedirs(folder, exist_ok=True)
    texts = [f"doc {i} " + "x" * (i % 17) + "\n" for i in range(n)]
    for part in range(2):
        with open(os.path.join(folder, f"part{part}.jsonl"), "w") as f:
            for text in texts[part * n // 2 : (part + 1) * n // 2]:
                f.write(json.dumps({"text": text}) + "\n")
    return texts


def _files(folder) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


# ---- the loader ----------------------------------------------------------------------------------------------
def test_dp_shards_are_disjoint_and_cover_the_global_batch():
    tokens = np.arange(10_000, dtype=np.int64)  # token value = position: samples are identifiable
    single = _loader(tokens, 0, 1)
    for step in range(3):
        whole = torch.cat([x for x, _ in single.next()])
        for dp in (2, 3):
            parts = [torch.cat([x for x, _ in _loader(tokens, r, dp, start_step=step).next()]) for r in range(dp)]
            firsts = [set(p[:, 0].tolist()) for p in parts]
            assert all(a.isdisjoint(b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])
            assert torch.equal(torch.cat(parts), whole)  # same samples, same order as one process


def test_targets_are_inputs_shifted_prefetch_changes_nothing_and_resume_is_exact():
    tokens = np.arange(5_000, dtype=np.int64)
    plain, prefetched = _loader(tokens, 0, 1), _loader(tokens, 0, 1, prefetch=True)
    for step in range(4):
        a, b = plain.next(), prefetched.next()
        resumed = _loader(tokens, 0, 1, start_step=step).next()  # a loader built at this step: the same batch
        for (x, y), (x2, y2), (x3, _) in zip(a, b, resumed):
            assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(x, x3)
            assert torch.equal(x[:, 1:], y[:, :-1])
    assert prefetched.state_dict() == {"next_step": 4}


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_the_sample_permutation_is_a_seeded_bijection(n):
    a, b = Permutation(n, [1, 0, 0]), Permutation(n, [2, 0, 0])
    pa, pb = a(np.arange(n)), b(np.arange(n))
    assert sorted(pa.tolist()) == list(range(n)) and sorted(pb.tolist()) == list(range(n))
    if n >= 64:
        assert not np.array_equal(pa, pb) and not np.array_equal(pa, np.arange(n))
    assert np.array_equal(a(np.arange(n)[::-1]), pa[::-1])  # pointwise: any subset, any order


def test_epochs_visit_every_window_once_each():
    tokens = np.arange(8 * 30 + 1, dtype=np.int64)  # 30 windows of 8
    loader = _loader(tokens, 0, 1, global_batch=10)
    firsts = [int(x[i, 0]) // 8 for _ in range(6) for x, _ in loader.next() for i in range(len(x))]
    assert sorted(firsts[:30]) == list(range(30)) and sorted(firsts[30:]) == list(range(30))
    assert firsts[:30] != firsts[30:]  # a new order each epoch


# ---- blends -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [0.5, 0.3, 0.15, 0.05], [0.01, 0.99]])
def test_blend_counts_follow_the_weights_at_every_prefix_and_steps_are_stateless(weights):
    blend = Blend(weights)
    sources, numbers = blend.assign(0, 20_000)
    shares = np.array(weights) / sum(weights)
    for n in (10, 100, 1234, 20_000):
        counts = np.bincount(sources[:n], minlength=len(weights))
        assert np.all(np.abs(counts - n * shares) <= 1.0 + 1e-9), (n, counts)  # within one sample, always
        assert counts.tolist() == [blend.count(k, n) for k in range(len(weights))]
    for k in range(len(weights)):  # each source's own samples in order, none skipped
        assert np.array_equal(numbers[sources == k], np.arange((sources == k).sum()))
    later = blend.assign(5_000, 512)  # a step computed alone equals the same slice of the whole
    assert np.array_equal(later[0], sources[5_000:5_512]) and np.array_equal(later[1], numbers[5_000:5_512])


def test_blend_spec_parsing_and_bad_weights():
    assert parse_blend("") == [(1.0, "")] and parse_blend("some/dir") == [(1.0, "some/dir")]
    assert parse_blend("0.7:a,0.3:b") == [(0.7, "a"), (0.3, "b")]
    for bad in ("0:a,1:b", "-1:a,2:b", "a,b", "nan:a,1:b", "0.5:,0.5:b"):
        with pytest.raises(ConfigError, match="blend"):
            parse_blend(bad)


def test_loader_samples_of_a_blend_follow_its_weights_within_one_percent():
    a, b = np.zeros(8 * 50 + 1, dtype=np.int64), np.ones(8 * 7 + 1, dtype=np.int64)  # b repeats (epochs)
    loader = _loader([a, b], 0, 1, global_batch=100, weights=[0.7, 0.3])
    firsts = np.concatenate([x[:, 0].numpy() for _ in range(10) for x, _ in loader.next()])
    assert abs(firsts.mean() - 0.3) < 0.01 and loader.samples_per_source(10) == [700, 300]


# ---- lmt prepare ----------------------------------------------------------------------------------------------
def test_prepare_writes_documents_with_eod_and_holds_out_every_kth(tmp_path):
    texts = _documents(tmp_path / "in")
    manifest = prepare(
        PrepareRequest(inputs=[str(tmp_path / "in")], val_fraction=0.1, shard_mb=0.0002),
        str(tmp_path / "out"),
        progress=False,
    )
    data = open_prepared(str(tmp_path / "out"))
    assert manifest["dtype"] == "uint8" and data.eod_id == 0 and data.vocab_size == 256
    assert len(manifest["splits"]["train"]["shards"]) > 2  # small shards: several groups
    train = data.train.read(0, data.train.num_tokens).tobytes()
    val = data.val.read(0, data.val.num_tokens).tobytes()
    assert val == b"".join(t.encode() + b"\0" for t in texts[::10])
    assert train == b"".join(t.encode() + b"\0" for i, t in enumerate(texts) if i % 10)
    assert data.train.documents() == 54 and manifest["documents"] == 60
    ends = np.concatenate([e + s for e, s in zip(data.train.doc_ends, data.train.starts)])
    assert np.all(data.train.read(0, data.train.num_tokens)[ends - 1] == 0)  # every document ends with EOD
    assert verify_prepared(str(tmp_path / "out")) == manifest


def test_prepare_output_is_the_same_for_any_worker_count(tmp_path):
    _documents(tmp_path / "in", n=200)
    request = dict(inputs=[str(tmp_path / "in")], shard_mb=0.001)
    for workers in (1, 3):
        prepare(PrepareRequest(**request), str(tmp_path / f"w{workers}"), workers=workers, progress=False)
    assert _files(tmp_path / "w1") == _files(tmp_path / "w3")


def test_a_killed_prepare_resumes_without_redoing_finished_shards(tmp_path):
    _documents(tmp_path / "in", n=200)
    request = PrepareRequest(inputs=[str(tmp_path / "in")], shard_mb=0.0005)
    prepare(request, str(tmp_path / "whole"), progress=False)

    class Killed(Exception):
        pass

    def kill_after(k):
        if k == 2:
            raise Killed

    with pytest.raises(Killed):
        prepare(request, str(tmp_path / "resumed"), progress=False, on_group=kill_after)
    assert not os.path.exists(tmp_path / "resumed" / "manifest.json")  # unfinished: never looks complete
    with pytest.raises(ConfigError, match="unfinished lmt prepare"):
        resolve_data(DataConfig(path=str(tmp_path / "resumed")))
    finished = {
        f: os.stat(tmp_path / "resumed" / f).st_mtime_ns
        for f in os.listdir(tmp_path / "resumed")
        if f.startswith(("train-0000", "val-0000")) and f[-5] in "012"
    }
    written = []
    prepare(request, str(tmp_path / "resumed"), progress=False, on_group=written.append)
    assert written[0] == 3  # groups 0-2 were kept
    assert all(os.stat(tmp_path / "resumed" / f).st_mtime_ns == t for f, t in finished.items())
    assert _files(tmp_path / "whole") == _files(tmp_path / "resumed")


def test_a_single_document_holds_out_its_tail(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    prepare(PrepareRequest(inputs=[str(tmp_path / "a.txt")], val_fraction=0.1), str(tmp_path / "out"), progress=False)
    data = open_prepared(str(tmp_path / "out"))
    both = data.train.read(0, data.train.num_tokens).tobytes() + data.val.read(0, data.val.num_tokens).tobytes()
    assert both == b"hello world\n" * 50 + b"\0" and data.val.num_tokens == 60


def test_damaged_prepared_folders_are_refused_naming_the_file(tmp_path):
    _documents(tmp_path / "in")
    out = tmp_path / "out"
    prepare(PrepareRequest(inputs=[str(tmp_path / "in")]), str(out), progress=False)
    shard = out / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[5] ^= 1
    shard.write_bytes(bytes(data))
    open_prepared(str(out))  # same size: opening is O(1) and does not notice
    with pytest.raises(ConfigError, match="train-00000.bin does not match its checksum"):
        verify_prepared(str(out))
    shard.write_bytes(bytes(data[:-3]))
    with pytest.raises(ConfigError, match="train-00000.bin is .* bytes but the manifest says"):
        open_prepared(str(out))
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match="manifest.json is not valid JSON"):
        open_prepared(str(out))
    with pytest.raises(ConfigError, match="already holds prepared data"):
        prepare(PrepareRequest(inputs=[str(tmp_path / "in")]), str(out), progress=False)


def test_raw_input_is_prepared_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LMT_DATA_CACHE", str(tmp_path / "cache"))
    _documents(tmp_path / "in")
    cfg = DataConfig(path=str(tmp_path / "in"))
    with pytest.raises(ConfigError, match="not prepared yet"):
        resolve_data(cfg, prepare_missing=False)
    first = resolve_data(cfg)[0].folder
    assert resolve_data(cfg, prepare_missing=False)[0].folder == first
    (tmp_path / "in" / "part0.jsonl").write_text('{"text": "changed"}\n')  # new content: a new cache entry
    assert resolve_data(cfg)[0].folder != first
    blend = load_training_data(DataConfig(path=f"0.7:{first},0.3:{tmp_path / 'in'}"))
    assert blend.weights == [0.7, 0.3] and [p.label for p in blend.parts][1] == "in"


def test_the_default_corpus_is_the_stdlib_prepared_with_eod(tmp_path, monkeypatch):
    monkeypatch.setenv("LMT_DATA_CACHE", os.environ.get("LMT_DATA_CACHE", str(tmp_path)))
    files = stdlib_files()
    assert files == sorted(files) and not any("/test/" in f or "site-packages" in f for f in files)
    data = load_training_data(DataConfig(), prepare_missing=True)
    every = round(1 / DataConfig().val_fraction)
    texts = [open(f, "rb").read().decode("utf-8", errors="replace").replace("\0", "").encode() for f in files]
    assert data.vocab_size == 256 and data.sources[0].val.documents() == len(texts[::every])
    assert data.val[0].read(0, data.val[0].num_tokens).tobytes() == b"".join(t + b"\0" for t in texts[::every])
