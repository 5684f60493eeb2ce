"""--sync local:H / streaming:H (DiLoCo, parallel/diloco.py): the outer optimizer's math, the identity cases,
replicas that diverge between syncs and agree after, the streaming schedule, the bytes on the wire, exact
resume at and between syncs, and the one-line refusals."""

from __future__ import annotations

import math
import os

import pytest
import torch

from large_model_training.choices import SyncMode
from large_model_training.cli import main
from large_model_training.errors import ConfigError
from large_model_training.parallel.diloco import fragment_spans, nesterov_step
from tests.helpers import Runs, assert_close_curves, losses, model_flags

MODEL = [*model_flags(), "--seq-len", "32", "--micro-batch-size", "2", "--eval-every", "0", "--bucket-mb", "0.1"]
IDENTITY = ["--sync.outer_lr", "1", "--sync.outer_momentum", "0"]


# ---- fast lane ---------------------------------------------------------------------------------------
def test_nesterov_step_is_torch_sgd_nesterov():
    torch.manual_seed(0)
    start = torch.randn(10)
    grads = [torch.randn(10) for _ in range(5)]
    ref = start.clone().requires_grad_(True)
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    ours, buf = start.clone(), torch.zeros(10)
    for g in grads:
        ref.grad = g.clone()
        sgd.step()
        nesterov_step(ours, buf, g, 0.7, 0.9)
    torch.testing.assert_close(ours, ref.detach(), rtol=1e-6, atol=1e-7)


def test_nesterov_hand_example():
    """outer_lr 0.5, momentum 0.5, gradients 1 then 1: buf 1 -> 1.5; steps 0.5 (1 + 0.5) and 0.5 (1 + 0.75)."""
    p, buf = torch.tensor([1.0]), torch.zeros(1)
    nesterov_step(p, buf, torch.tensor([1.0]), 0.5, 0.5)
    assert p.item() == pytest.approx(0.25) and buf.item() == 1.0
    nesterov_step(p, buf, torch.tensor([1.0]), 0.5, 0.5)
    assert p.item() == pytest.approx(0.25 - 0.875) and buf.item() == 1.5


def test_outer_lr_1_momentum_0_is_averaging():
    anchor, buf = torch.tensor([2.0, 4.0]), torch.zeros(2)
    replicas = torch.tensor([[1.0, 5.0], [3.0, 1.0]])
    nesterov_step(anchor, buf, (anchor - replicas).mean(0), 1.0, 0.0)
    assert anchor.tolist() == [2.0, 3.0]


class _Piece:
    def __init__(self, params):
        self.params = params  # (name, a, b, start)


def test_fragments_are_contiguous_and_balanced():
    pieces = [_Piece([("c", 0, 40, 0), ("b", 40, 50, 0)]), _Piece([("a", 0, 50, 0)])]
    frags = fragment_spans(pieces, ["a", "b", "c"], 2)
    assert frags == [[(1, 0, 50)], [(0, 40, 50), (0, 0, 40)]]
    assert fragment_spans(pieces, ["a", "b", "c"], 1) == [[(1, 0, 50), (0, 40, 50), (0, 0, 40)]]


def test_sync_mode_parses():
    assert SyncMode.parse("local:50") == SyncMode("local", 50) and str(SyncMode.parse("Streaming:8")) == "streaming:8"
    assert not SyncMode.parse("every-step").infrequent
    for bad in ("local", "local:0", "sometimes", "every-step:2", "local:x"):
        with pytest.raises(ConfigError):
            SyncMode.parse(bad)


BAD = {
    "H missing": ["--sync", "local"],
    "H zero": ["--sync", "local:0"],
    "unknown mode": ["--sync", "sometimes:4"],
    "with ZeRO-1": ["--dp", "2", "--sync", "local:4", "--zero", "1"],
    "with gradient compression": ["--dp", "2", "--sync", "local:4", "--compression", "int8"],
    "with update compression": ["--dp", "2", "--sync", "local:4", "--compression-target", "update"],
    "more fragments than H": ["--sync", "streaming:2", "--sync.fragments", "4"],
    "overlap past H": ["--sync", "streaming:4", "--sync.fragments", "2", "--sync.overlap", "4"],
    "unknown exchange format": ["--sync", "local:4", "--sync.compression", "fp8"],
    "momentum 1": ["--sync", "local:4", "--sync.outer_momentum", "1"],
    "outer lr 0": ["--sync", "local:4", "--sync.outer_lr", "0"],
    "with onebit-adam": ["--dp", "2", "--sync", "local:4", "--optimizer", "onebit-adam"],
}
# What each case must say (exit code 2 alone would pass a case refused for another reason).
BAD_ERRORS = {
    "H missing": "sync.mode local:H needs an integer H",
    "H zero": "sync.mode local:H needs H >= 1, got H=0",
    "unknown mode": "sync.mode must be every-step, local:H or streaming:H, got 'sometimes:4'",
    "with ZeRO-1": "--sync local:4 composes with --zero 0 only",
    "with gradient compression": "--sync local:4 sends no per-step gradients to compress",
    "with update compression": "--sync local:4 sends no per-step gradients to compress",
    "more fragments than H": "sync.mode streaming:2 needs H >= sync.fragments (4)",
    "overlap past H": "sync.overlap (4) must be below H (4) of streaming:4",
    "unknown exchange format": "sync.compression must be one of none, bf16, int8, int4, sign, got 'fp8'",
    "momentum 1": "sync.outer_momentum must be in [0, 1), got 1.0",
    "outer lr 0": "sync.outer_lr must be positive, got 0.0",
    "with onebit-adam": "it does not compose with --optimizer onebit-adam",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_sync_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    code = main(["train", "--out", str(tmp_path / "run"), *MODEL, *BAD[case]])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("lmt: error: ") and BAD_ERRORS[case] in err, err


def test_help_lists_sync(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "--sync " in text and "--sync.outer_lr" in text and "--sync.compression" in text


def test_planner_divides_dp_volume_by_h():
    from large_model_training.config import SyncConfig
    from large_model_training.planner.sync import outer_bytes_per_step

    every = outer_bytes_per_step(1_000_000, 4, SyncConfig())
    assert every is None
    local = outer_bytes_per_step(1_000_000, 4, SyncConfig(mode=SyncMode("local", 50)))
    assert local == pytest.approx(4e6 / 50)
    stages = 1 + 1 / 4  # the two-stage average: the all-to-all of the message, the all-gather of a shard's
    int8 = outer_bytes_per_step(1_000_000, 4, SyncConfig(mode=SyncMode("local", 50), compression="int8"))
    assert int8 == pytest.approx(1e6 * (1 + 4 / 256) * stages / 50)
    int4 = outer_bytes_per_step(1_000_000, 4, SyncConfig(mode=SyncMode("local", 50), compression="int4"))
    assert int4 == pytest.approx(1e6 * (0.5 + 4 / 256) * stages / 50)
    sign = outer_bytes_per_step(1_000_000, 4, SyncConfig(mode=SyncMode("local", 50), compression="sign"))
    assert sign == pytest.approx(1e6 * (1 / 8 + 4 / 256) * stages / 50)


def test_wire_bytes_shrink_by_the_format_at_any_dp():
    """On each rank's link the two-stage sign exchange every 2 steps is 4 x 2 / (1/8 + 4/256) = 56.9x below the
    dense fp32 ring all-reduce, whatever dp (an all-gather of every replica's message would fall to 28x at 4)."""
    from large_model_training.config import SyncConfig
    from large_model_training.planner.comm import ring_all_reduce
    from large_model_training.planner.sync import outer_wire_bytes_per_step

    sync = SyncConfig(mode=SyncMode("local", 2), compression="sign")
    for dp in (2, 4, 64):
        ratio = ring_all_reduce(4e6, dp) / outer_wire_bytes_per_step(1_000_000, dp, sync)
        assert ratio == pytest.approx(8 / (1 / 8 + 4 / 256))


def test_planner_step_time_and_memory_know_the_outer_step():
    from large_model_training.config import build_config
    from large_model_training.planner.estimate import estimate_memory, predict_step_time

    def cfg(mode: str):
        return build_config(
            None,
            {
                "model.preset": "llama3-8b",
                "parallel.tp": 8,
                "parallel.dp": 64,
                "train.micro_batch_size": 1,
                "train.seq_len": 4096,
                "train.precision": "bf16",
                "sync.mode": mode,
            },
        )

    every, local = predict_step_time(cfg("every-step"), "h100-sxm"), predict_step_time(cfg("local:50"), "h100-sxm")
    assert local < every
    outer = estimate_memory(cfg("local:50")).optimizer_states
    assert outer > estimate_memory(cfg("every-step")).optimizer_states


# ---- multi-rank runs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_corpus) -> Runs:
    root = tmp_path_factory.mktemp("diloco")
    common = [*MODEL, "--data", small_corpus]
    dp2 = [*common, "--dp", "2", "--global-batch-size", "4"]
    unclipped = ["--steps", "6", "--train.grad_clip", "0"]
    args = {
        "one-rank": [*common, "--steps", "6"],
        "one-rank-local1": [*common, "--steps", "6", "--sync", "local:1", *IDENTITY],
        "update-avg": [*dp2, *unclipped, "--compression-target", "update"],
        "local1": [*dp2, *unclipped, "--sync", "local:1", *IDENTITY],
        "local4": [*dp2, "--steps", "8", "--sync", "local:4", "--save-every", "2"],
        "stream-f1": [*dp2, "--steps", "8", "--sync", "streaming:4", "--sync.fragments", "1", "--sync.overlap", "0"],
        "stream": [*dp2, "--steps", "9", "--sync", "streaming:4", "--sync.fragments", "2", "--save-every", "4"],
        "warmup": [*dp2, "--steps", "6", "--sync", "local:3", "--sync.warmup", "2"],
        "bf16-wire": [*dp2, "--steps", "4", "--sync", "local:2", "--sync.compression", "bf16"],
        "int8": [*dp2, "--steps", "4", "--sync", "local:2", "--sync.compression", "int8", "--save-every", "2"],
        "int4": [*dp2, "--steps", "4", "--sync", "local:2", "--sync.compression", "int4"],
        "sign": [*dp2, "--steps", "4", "--sync", "local:2", "--sync.compression", "sign"],
    }
    args["bf16"] = [*dp2, "--steps", "4", "--sync", "local:2", "--precision", "bf16", "--save-every", "1"]
    args["tp2"] = [
        *common,
        "--dp",
        "2",
        "--tp",
        "2",
        "--global-batch-size",
        "4",
        "--steps",
        "4",
        "--sync",
        "streaming:2",
        "--sync.fragments",
        "2",
        "--sync.compression",
        "int8",
        "--save-every",
        "3",
    ]
    args["bf16-from1"] = [*args["bf16"], "--resume", str(root / "bf16" / "checkpoints" / "step_1")]
    args["tp2-from3"] = [*args["tp2"], "--resume", str(root / "tp2" / "checkpoints" / "step_3")]
    for step in (2, 4):
        ckpt = root / "local4" / "checkpoints" / f"step_{step}"
        args[f"local4-from{step}"] = [*args["local4"], "--resume", str(ckpt)]
    args["stream-from4"] = [*args["stream"], "--resume", str(root / "stream" / "checkpoints" / "step_4")]
    args["int8-from2"] = [*args["int8"], "--resume", str(root / "int8" / "checkpoints" / "step_2")]
    return Runs(root, args)


def _replica_params(runs: Runs, run: str, step: int) -> list[torch.Tensor]:
    ckpt = runs.folder(run) / "checkpoints" / f"step_{step}"
    return [
        torch.cat([m.reshape(-1) for m in torch.load(ckpt / f"rank_{r}.pt")["engine"]["masters"]]) for r in range(2)
    ]


@pytest.mark.slow
def test_local_1_on_one_rank_is_plain_training(runs):
    assert_close_curves(losses(runs["one-rank-local1"]), losses(runs["one-rank"]), rtol=1e-5, what="dp=1 local:1")


@pytest.mark.slow
def test_local_1_outer_lr_1_is_data_parallel_with_averaged_adamw_updates(runs):
    """Averaging the replicas' parameters after one AdamW step each is dense dp averaging AdamW's updates (each
    rank's moments from its own gradients): equal to float rounding. (Averaging gradients instead differs: AdamW
    is not linear in them; docs/slow_links.md.)"""
    local, dense = runs["local1"], runs["update-avg"]
    assert_close_curves(losses(local), losses(dense), rtol=1e-5, what="local:1 vs update averaging")
    assert all(r["sync_outer"] == 1 for r in local)
    assert all(r["comm_bytes_dp"] == local[0]["comm_bytes_dp"] > 0 for r in local)


@pytest.mark.slow
def test_replicas_diverge_between_syncs_and_agree_after(runs):
    rows = runs["local4"]
    assert [r["sync_outer"] for r in rows] == [0, 0, 0, 1, 0, 0, 0, 1]
    assert [r["comm_bytes_dp"] > 0 for r in rows] == [bool(r["sync_outer"]) for r in rows]
    a, b = _replica_params(runs, "local4", 2)  # between syncs
    assert (a - b).abs().max() > 1e-4
    for step in (4, 8):  # right after an outer step
        a, b = _replica_params(runs, "local4", step)
        assert torch.equal(a, b)


@pytest.mark.slow
def test_outer_state_is_in_the_checkpoint(runs):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = runs.folder("local4") / "checkpoints" / "step_2"
    keys = set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    assert "optim.outer_anchor.layers.0.attention.wq.weight" in keys or any(
        k.startswith("optim.outer_anchor.") for k in keys
    )
    assert any(k.startswith("optim.outer_momentum.") for k in keys) and "optim.outer_steps" in keys


@pytest.mark.slow
@pytest.mark.parametrize("step", [2, 4])
def test_resume_between_and_at_syncs_is_exact(runs, step):
    full, resumed = runs["local4"], runs[f"local4-from{step}"]
    assert [r["step"] for r in resumed] == list(range(step + 1, 9))
    assert losses(resumed) == losses(full)[step:]
    assert [r["sync_outer"] for r in resumed] == [r["sync_outer"] for r in full[step:]]


@pytest.mark.slow
def test_a_checkpoint_with_the_old_rank_state_key_resumes_exactly(runs, tmp_path):
    """Checkpoints from before the neutral key held every engine's per-rank state under "compression"."""
    import json
    import shutil

    from large_model_training.train.checkpoint import _manifest
    from tests.dist import train_together
    from tests.helpers import metrics

    old = tmp_path / "step_2"
    shutil.copytree(runs.folder("local4") / "checkpoints" / "step_2", old)
    for path in old.glob("rank_*.pt"):
        state = torch.load(path, weights_only=True)
        state["compression"] = state.pop("engine")
        torch.save(state, path)
    meta = json.loads((old / "meta.json").read_text())
    meta["files"] = _manifest(str(old))
    (old / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "resumed"
    train_together(2, {str(out): [*runs.args["local4"], "--resume", str(old)]})
    assert losses(metrics(out)) == losses(runs["local4"])[2:]


@pytest.mark.slow
def test_streaming_with_one_fragment_and_no_overlap_is_local(runs):
    assert losses(runs["stream-f1"]) == losses(runs["local4"])


@pytest.mark.slow
def test_streaming_fragments_sync_on_their_own_schedule(runs):
    """H = 4, 2 fragments: offsets 0 and 2; each exchange starts after its step and lands one step later."""
    rows, whole = runs["stream"], runs["local4"][3]["comm_bytes_dp"]
    applied = {r["step"]: r["sync_fragments"] for r in rows if r["sync_fragments"]}
    assert applied == {3: [1], 5: [0], 7: [1], 9: [0]}
    sent = {r["step"]: r["comm_bytes_dp"] for r in rows if r["comm_bytes_dp"]}
    assert sorted(sent) == [2, 4, 6, 8]
    assert sent[2] + sent[4] == whole and sent[2] == sent[6] and sent[4] == sent[8]


@pytest.mark.slow
def test_streaming_resume_with_an_exchange_in_flight_is_exact(runs):
    full, resumed = runs["stream"], runs["stream-from4"]
    assert losses(resumed) == losses(full)[4:]


@pytest.mark.slow
def test_compressed_exchanges_count_their_bytes(runs):
    """bf16: the all-reduce's input; the coded formats: the two-stage average at dp = 2, each rank's two shard
    messages to the all-to-all and its one served shard's message to the all-gather."""
    numel = runs["local4"][3]["comm_bytes_dp"] // 4
    assert [r["comm_bytes_dp"] for r in runs["bf16-wire"]] == [0, 2 * numel, 0, 2 * numel]
    shard = math.ceil(numel / 2)
    for kind, message in (
        ("int8", shard + 4 * math.ceil(shard / 256)),
        ("int4", math.ceil(shard / 2) + 4 * math.ceil(shard / 256)),
        ("sign", math.ceil(shard / 8) + 4 * math.ceil(shard / 256)),
    ):
        assert [r["comm_bytes_dp"] for r in runs[kind]] == [0, 3 * message, 0, 3 * message], kind
    for name in ("bf16-wire", "int8", "int4", "sign"):
        assert losses(runs[name])[-1] < losses(runs[name])[0]


@pytest.mark.slow
def test_int8_residuals_resume_exactly(runs):
    ckpt = runs.folder("int8") / "checkpoints" / "step_2"
    saved = torch.load(os.path.join(ckpt, "rank_0.pt"))["engine"]
    for residuals in (saved["residuals"], saved["server_residuals"]):
        assert residuals and any(r.abs().sum() > 0 for r in residuals)
    assert losses(runs["int8-from2"]) == losses(runs["int8"])[2:]


def test_gradient_compression_api_reaches_sync():
    import large_model_training as lmt

    s = lmt.GradientCompression.sync("streaming:8", compression="bf16", fragments=2)
    assert str(s.mode) == "streaming:8" and s.compression == "bf16" and s.fragments == 2
    with pytest.raises(ConfigError):
        lmt.GradientCompression.sync("local:4", compression="fp8")
    assert lmt.GradientCompression.sync("local:4", fragments="3").fragments == 3  # typed as from a TOML file
    with pytest.raises(ConfigError, match="unknown setting 'sync.fragmentz'"):
        lmt.GradientCompression.sync("local:4", fragmentz=3)


@pytest.mark.slow
def test_bf16_precision_resumes_exactly_between_syncs(runs):
    """bf16 parameters with fp32 masters: each replica's own masters come back from its rank file."""
    assert losses(runs["bf16-from1"]) == losses(runs["bf16"])[1:]


@pytest.mark.slow
def test_tensor_parallel_replicas_resume_exactly(runs):
    """tp = 2 inside each replica: the outer state is saved by name through DTensors, the exchange is int8 of each
    rank's shard. Offsets 0 and 1: a fragment starts every step; the save of step 3 holds fragment 1's exchange
    in flight (applied at step 4)."""
    rows = runs["tp2"]
    assert all(r["comm_bytes_dp"] > 0 for r in rows) and [r["sync_fragments"] for r in rows] == [[], [1], [0], [1]]
    assert losses(runs["tp2-from3"]) == losses(rows)[3:]


@pytest.mark.slow
def test_warmup_averages_every_step_then_follows_the_schedule(runs):
    rows, whole = runs["warmup"], runs["local4"][3]["comm_bytes_dp"]
    assert [r["sync_outer"] for r in rows] == [1, 1, 1, 0, 0, 1]
    assert [r["comm_bytes_dp"] for r in rows] == [whole if r["sync_outer"] else 0 for r in rows]
