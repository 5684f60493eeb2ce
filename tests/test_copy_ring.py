"""The in-memory copies' partner stream (reliability/copy_ring.py) and their files in a holder, in one process:
a world of one rank is its own partner, so the ring's both ends run here over a real socket."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from large_model_training.reliability.copy_ring import HELLO, CopyRing, accept_from, reachable_address
from large_model_training.reliability.local_checkpoint import KEEP, LocalCheckpoints, held_copies, read_copy


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def test_the_ring_delivers_each_copy_whole_and_in_order_and_waits_for_the_sources(one_rank):
    got: list[tuple[int, bytes]] = []
    buffers: dict[int, bytearray] = {}

    def buffer_for(step: int, nbytes: int) -> memoryview:
        buffers[step] = bytearray(nbytes)
        return memoryview(buffers[step])

    ring = CopyRing(one_rank, 0, 0, buffer_for, lambda step, n: got.append((step, bytes(buffers[step]))), 10)
    big = torch.arange(3 << 20, dtype=torch.int32).numpy()  # 12 MB: more than the socket buffers take at once
    sender = threading.Thread(target=lambda: [ring.send(s, [s.to_bytes(8, "little"), big]) for s in (1, 2, 3)])
    sender.start()
    ring.wait_for(3)
    sender.join()
    assert [s for s, _ in got] == [1, 2, 3]
    assert all(data == s.to_bytes(8, "little") + big.tobytes() for s, data in got)
    ring.close()
    with pytest.raises(ConnectionError, match="no copy of step 4 from rank 0"):
        ring.wait_for(4)  # the stream ended: a step never sent is an error, not a hang


def test_a_connection_without_the_sources_token_is_turned_away():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    token = os.urandom(16)
    stranger = socket.create_connection(("127.0.0.1", port))
    stranger.sendall(HELLO.pack(0, os.urandom(16)))  # the right rank, a wrong token
    impostor = socket.create_connection(("127.0.0.1", port))
    impostor.sendall(HELLO.pack(1, token))  # the right token, the wrong rank
    source = socket.create_connection(("127.0.0.1", port))
    source.sendall(HELLO.pack(0, token))
    conn = accept_from(listener, 0, token, time.monotonic() + 5)
    source.sendall(b"copy")
    assert conn.recv(4) == b"copy"
    assert stranger.recv(1) == b"" and impostor.recv(1) == b""  # closed by the listener's side
    with pytest.raises(socket.timeout):
        accept_from(listener, 0, token, time.monotonic() + 0.2)  # nobody else comes: a deadline, not a hang
    for s in (conn, stranger, impostor, source, listener):
        s.close()


def test_the_address_a_rank_gives_its_source_is_loopback_only_for_a_job_on_one_host(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert reachable_address() == "127.0.0.1"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two hosts, the master's named by a loopback alias
    address = reachable_address()
    default_route = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        default_route.connect(("192.0.2.1", 9))
        assert address == default_route.getsockname()[0]
    except OSError:  # no route out of this machine at all: loopback is all there is
        assert address == "127.0.0.1"
    finally:
        default_route.close()


def test_a_holder_keeps_the_newest_copies_whole_and_writes_each_into_a_retired_file(one_rank, tmp_path):
    run_dir = str(tmp_path / "run")
    copies = LocalCheckpoints(run_dir, 1)
    copies.clear()
    try:
        inodes = []
        for step in range(1, 7):
            copies.save(step, {"w": torch.full((1000,), float(step)), "step": step})
            copies.wait()
            inodes.append(os.stat(os.path.join(copies.holder, f"step_{step}", "rank_0.pt")).st_ino)
        assert held_copies(copies.holder) == {s: [0] for s in range(7 - KEEP, 7)}  # older folders are gone
        for step in range(7 - KEEP, 7):
            back = read_copy(os.path.join(copies.holder, f"step_{step}", "rank_0.pt"))
            assert back["step"] == step and torch.equal(back["w"], torch.full((1000,), float(step)))
        # steady state: one file more than the copies kept, each new copy written into the one retired before
        assert len(set(inodes)) == KEEP + 1 and inodes[KEEP + 1 :] == inodes[: len(inodes) - KEEP - 1]
        assert len(os.listdir(os.path.join(copies.holder, "free"))) == 1
    finally:
        copies.close(finished=True)
    assert not os.path.exists(copies.holder)
    shutil.rmtree(os.path.dirname(copies.holder), ignore_errors=True)


def _small_config(**overrides):
    from large_model_training.config import build_config
    from large_model_training.layout import validate

    fields = {"model.hidden_size": 32, "model.n_layers": 1, "model.n_heads": 2, "model.ffn_hidden_size": 64,
              "train.seq_len": 32, "train.global_batch_size": 2, "train.micro_batch_size": 2,
              "train.eval_every": 0, "train.steps": 10}  # fmt: skip
    cfg = build_config(None, {**fields, **overrides})
    validate(cfg, None)  # (dp resolved from the world)
    return cfg


def _restored_steps_as_taken(cfg, run_dir: str) -> list[tuple[float, float]]:
    """Train 3 steps, copy the engine's local state, restore it into a fresh engine; both take 2 more steps.
    Returns each step's (loss before, loss restored); asserts the parameters end equal."""
    from large_model_training.mesh import ParallelMesh
    from large_model_training.reliability import flat_state
    from large_model_training.train.trainer import Trainer

    p = cfg.parallel
    mesh = ParallelMesh.for_this_rank(p.pp, p.dp, p.tp, p.cp, p.ep)
    first = Trainer(cfg, mesh, os.path.join(run_dir, "a"))
    for step in range(3):
        first.timed_step(step)
    snapshot = flat_state.Snapshot()
    snapshot.take(first.engine.local_state_dict(), lambda n: torch.empty(n, dtype=torch.uint8))
    copy = flat_state.parse(snapshot.payload().numpy().tobytes() + b"".join(flat_state.tail(snapshot.header())))
    second = Trainer(cfg, mesh, os.path.join(run_dir, "b"))
    second.engine.load_local_state_dict(copy)
    for _ in range(3):
        second.loader.next()  # the same batches from here on
    losses = [(first.timed_step(s)["loss"], second.timed_step(s)["loss"]) for s in (3, 4)]
    for a, b in zip(first.engine.model.parameters(), second.engine.model.parameters()):
        assert torch.equal(getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b))
    for a, b in zip(first.engine.model.buffers(), second.engine.model.buffers()):
        assert torch.equal(a, b)  # (MoE's expert bias, moved every step)
    for t in (first, second):
        t.loader.close()
    return losses


@pytest.mark.parametrize("precision,states", [("fp32", "fp32"), ("bf16", "bf16")])
def test_an_engine_restored_from_its_local_state_steps_exactly_as_the_one_it_was_taken_from(
    one_rank, tmp_path, precision, states
):
    """The copies hold the engine's tensors as they lie (flat buffer, masters, per-piece moments): restored into a
    fresh engine they give the same next steps, bit for bit (bf16: the fp32 masters, not the bf16 parameters)."""
    cfg = _small_config(**{"train.precision": precision, "train.optimizer_states": states})
    for before, restored in _restored_steps_as_taken(cfg, str(tmp_path)):
        assert before == restored


MOE = {
    "model.moe_experts": 4,
    "model.moe_top_k": 2,
    "model.moe_ffn_hidden_size": 32,
    "model.moe_bias_update_rate": 0.01,
}
TWO_RANKS = {  # name: the layout's fields, over 2 ranks (ZeRO-3's shards: test_local_recovery's whole run)
    "moe-ep2": {**MOE, "parallel.dp": 2, "parallel.ep": 2},  # dense and expert engines, the router's bias
}


def _two_rank_layout(run_dir: str, name: str):
    cfg = _small_config(**TWO_RANKS[name], **{"train.global_batch_size": 4})
    return _restored_steps_as_taken(cfg, os.path.join(run_dir, str(torch.distributed.get_rank())))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO_RANKS))
def test_every_engine_restored_from_its_shards_steps_exactly_as_the_one_they_were_taken_from(tmp_path, name):
    """Each rank's tensors as they lie (nothing gathered over dp), restored into a fresh engine: the same steps."""
    from large_model_training.launch import run_on_ranks

    for per_rank in run_on_ranks(_two_rank_layout, 2, (str(tmp_path), name), timeout_s=120):
        for before, restored in per_rank:
            assert before == restored


def test_a_mapped_file_written_again_ends_where_its_newest_copy_ends(tmp_path):
    from large_model_training.reliability.mapped_file import MappedFile

    copy = MappedFile(str(tmp_path / "free" / "rank_0.1"))
    copy.tensor(100).fill_(7)
    copy.finish(100, [b"head", b"er"])
    copy.move(str(tmp_path / "step_1" / "rank_0.pt"))
    assert (tmp_path / "step_1" / "rank_0.pt").read_bytes() == bytes([7] * 100) + b"header"
    copy.view(10)[:] = b"0123456789"  # written again, shorter: the old bytes past it are cut
    copy.finish(10, [b"!"])
    assert (tmp_path / "step_1" / "rank_0.pt").read_bytes() == b"0123456789!"
    copy.tensor(5000).fill_(1)  # longer than its mapping: mapped again, the file grows
    copy.finish(5000, [])
    assert (tmp_path / "step_1" / "rank_0.pt").read_bytes() == bytes([1] * 5000)
    assert copy.tensor(0).numel() == 0 and len(copy.view(0)) == 0  # an empty state: nothing mapped
    copy.close()


def test_a_source_that_sends_nothing_is_a_timeout_not_a_hang(one_rank):
    ring = CopyRing(one_rank, 0, 0, lambda step, n: memoryview(bytearray(n)), lambda step, n: None, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="no copy of step 1 from rank 0 in 0.3 s"):
        ring.wait_for(1)
    ring.close()
