"""Pipeline-parallel training on 2 ranks: the seed's example 5.2 ("流水线并行训练") with the real API.

    python examples/pipeline_parallel.py          # 2 gloo ranks on the CPU (2 accelerators if present), < 1 min

The seed's sketch maps onto lmt like this:
    trainer = lmt.PipelineParallelism(num_stages=4)  ->  pipe = lmt.PipelineParallelism(mesh, schedule="1f1b")
                                                         (stages: the mesh's pp axis, one per pipeline rank)
    trainer.split_model(model)                       ->  model = pipe.split_model(model_cfg, seed): this rank's
                                                         blocks, with exactly the whole model's weights
    output = trainer.forward(batch)                  ->  loss = pipe.forward(micro_batches): every micro-batch
    loss = compute_loss(output, target)                  through every stage; the last stage computes the loss
    gradients = trainer.backward(loss)               ->  pipe.backward(): this stage's gradients, in .grad
    trainer.update_model(gradients)                  ->  clip by the global norm (summed over stages), opt.step()
forward/backward are GPipe's two phases (all forwards, then all backwards). 1F1B interleaves them to hold at
most p - stage activations instead of m, so it runs as one call: loss = pipe.train_step(micro_batches); the
last steps below use it. The loss printed is the whole model's mean loss, the same on both ranks.
"""

import torch
import torch.distributed as dist

import large_model_training as lmt
from large_model_training.config import DataConfig, model_from_preset
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard

PP, GPIPE_STEPS, ONE_F_ONE_B_STEPS, BATCH, MICRO_BATCH, SEQ_LEN, SEED = 2, 60, 40, 8, 2, 128, 0


def train(gpipe_steps: int, one_f_one_b_steps: int) -> list[float]:
    mesh = lmt.ParallelMesh.for_this_rank(pp=PP, dp=1, tp=1)
    pipe = lmt.PipelineParallelism(mesh, schedule="1f1b")  # the schedule of train_step; forward/backward are GPipe
    model_cfg = model_from_preset("tiny")  # 0.9M parameters, 4 blocks, byte-level
    model = pipe.split_model(model_cfg, SEED, SEQ_LEN)

    # This rank's stage holds some of the blocks, with the same weights as the unsplit model (same seed).
    whole = lmt.build_model(model_cfg, None, SEED).state_dict()
    assert all(torch.equal(w, whole[name].to(w.device)) for name, w in model.state_dict().items())
    print(f"pp rank {mesh.pp_rank}: blocks {sorted(model.layers, key=int)}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # Both stages read the same batches: the first stage uses the tokens, the last the targets.
    tokens = load_training_data(DataConfig(), prepare_missing=True).train  # prepared once, memory-mapped
    loader = BatchLoader(tokens, SEQ_LEN, Shard(0, 1, BATCH, MICRO_BATCH), SEED,
                         mesh.device)
    losses = []
    for step in range(gpipe_steps + one_f_one_b_steps):
        micro_batches = loader.next()  # BATCH // MICRO_BATCH = 4 micro-batches of (tokens, targets)
        if step < gpipe_steps:
            loss = pipe.forward(micro_batches)  # the seed's forward (and its loss)
            pipe.backward()                     # the seed's backward
        else:
            loss = pipe.train_step(micro_batches)  # 1F1B: forward and backward interleaved

        # Global gradient norm: each stage holds different parameters, so the squares sum over stages.
        sq = sum(p.grad.pow(2).sum() for p in model.parameters())
        dist.all_reduce(sq, group=mesh.pp_group)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm=1.0, total_norm=sq.sqrt())
        opt.step()  # the seed's update_model
        opt.zero_grad(set_to_none=True)

        losses.append(float(loss))
        if mesh.pp_rank == 0 and (step + 1) % 10 == 0:  # mean of the last 10 steps: one batch's loss is noisy
            schedule = "gpipe" if step < gpipe_steps else "1f1b"
            print(f"step {step + 1:3d} ({schedule})  loss {sum(losses[-10:]) / 10:.4f}  "
                  f"grad norm {float(sq.sqrt()):.3f}", flush=True)
    return losses


if __name__ == "__main__":
    per_rank = lmt.run_on_ranks(train, PP, (GPIPE_STEPS, ONE_F_ONE_B_STEPS))
    assert per_rank[0] == per_rank[1], "every pipeline rank reports the same (whole-model) loss"
    first, last = per_rank[0][:10], per_rank[0][-10:]
    print(f"pp={PP}: mean loss of the first 10 steps {sum(first) / 10:.3f}, of the last 10 {sum(last) / 10:.3f}")
