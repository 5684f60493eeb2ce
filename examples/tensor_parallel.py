"""Tensor-parallel training on 2 ranks: the seed's example 5.1 ("张量并行训练") with the real API.

    python examples/tensor_parallel.py            # 2 gloo ranks on the CPU (2 accelerators if present), ~30 s

The seed's sketch maps onto lmt like this:
    trainer = lmt.TensorParallelism(num_devices=8)  ->  tp = lmt.TensorParallelism(mesh)   (devices: mesh's tp axis)
    trainer.split_tensor(model.weight, dim=0)       ->  model = tp.parallelize(model_cfg, seed): this rank's
                                                        slices, exactly tp.split_tensor(full_weight, dim)
    compute_gradients / all_reduce / update_model   ->  loss.backward() (the Megatron all-reduces run inside),
                                                        tp.all_reduce for the global gradient norm, opt.step()
Each rank holds half of every projection, of the embedding and of the head; the loss printed is the
full model's loss (vocab-parallel cross-entropy), identical on both ranks, and it falls as training goes on.
"""

import torch

import large_model_training as lmt
from large_model_training.config import DataConfig, model_from_preset
from large_model_training.data.dataset import load_training_data
from large_model_training.data.loader import BatchLoader, Shard
from large_model_training.parallel.tensor import tp_layouts

TP, STEPS, BATCH, SEQ_LEN, SEED = 2, 100, 8, 128, 0


def train(steps: int) -> list[float]:
    mesh = lmt.ParallelMesh.for_this_rank(pp=1, dp=1, tp=TP)
    tp = lmt.TensorParallelism(mesh)
    model_cfg = model_from_preset("tiny")  # 0.9M parameters, byte-level
    model = tp.parallelize(model_cfg, SEED)

    # A shard is the matching slice of the single-device model's weight (same seed, same full weights).
    full_wq = lmt.build_model(model_cfg, None, SEED).layers["0"].attn.wq.weight
    assert torch.equal(tp.split_tensor(full_wq, dim=0), model.layers["0"].attn.wq.weight.cpu())

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    replicated = {name for name, layout in tp_layouts(model).items() if layout.replicated}
    # Both tp ranks read the same batches: tp splits the model, not the data.
    tokens = load_training_data(DataConfig(), prepare_missing=True).train  # prepared once, memory-mapped
    loader = BatchLoader(tokens, SEQ_LEN, Shard(0, 1, BATCH, BATCH), SEED,
                         mesh.device)
    losses = []
    for step in range(steps):
        inputs, targets = loader.next()[0]
        loss = model.loss_fn(model(inputs), targets)
        loss.backward()
        tp.sync_partial_gradients(model)  # no-op here; needed with sequence parallelism or few kv heads

        # Global gradient norm: sharded gradients summed over tp, replicated ones (norms) counted once.
        sq = sum(p.grad.pow(2).sum() / (tp.num_devices if name in replicated else 1)
                 for name, p in model.named_parameters())
        norm = tp.all_reduce(sq).sqrt()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm=1.0, total_norm=norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

        losses.append(float(loss.detach()))
        if mesh.rank == 0 and (step + 1) % 10 == 0:  # mean of the last 10 steps: one batch's loss is noisy
            print(f"step {step + 1:3d}  loss {sum(losses[-10:]) / 10:.4f}  grad norm {float(norm):.3f}", flush=True)
    return losses


if __name__ == "__main__":
    per_rank = lmt.run_on_ranks(train, TP, (STEPS,))
    assert per_rank[0] == per_rank[1], "every tp rank computes the same (full-model) loss"
    first, last = per_rank[0][:10], per_rank[0][-10:]
    print(f"tp={TP}: mean loss of the first 10 steps {sum(first) / 10:.3f}, of the last 10 {sum(last) / 10:.3f}")
