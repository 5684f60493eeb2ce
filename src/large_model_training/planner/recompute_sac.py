"""`--recompute sac` in the planner: what the per-op policy (memory/op_checkpoint.py) holds, rebuilds and costs.

Each block is one checkpoint whose policy keeps the outputs of the attention kernel and of every other matmul in
forward order; with our four GEMMs per dense block (fused qkv, output projection, fused gate/up or up, down) the
kept ones are qkv's and gate/up's. Per block and micro-batch, one tp rank (n tokens, r = t under SP):

  held        the block input n h B / r (the checkpoint's input) + qkv's output n d (a/t + 2 k_r) B + the MLP's first
              GEMM output (swiglu 2 n (f/t) B, gelu n (f/t) B) + the flash kernel's output n (a/t) d B and fp32
              log-sum-exp 4 n a/t (none on PyTorch's CPU math path, dropout > 0, nor on a stack that materialises
              the scores: there attention is recomputed whole)
  rebuilt     in backward, the block's full saved set (activations.layer_activation_terms) less what the cache
              hands back (gate and up are halves of the kept gate/up output; the attention output and
              log-sum-exp) and less the block input where the first norm saves that very storage
  time        backward adds the block's elementwise forward and the output projection's GEMM (with its tp
              collective); the down projection is not run again (the recomputation stops once the last saved
              tensor, its input, is rebuilt)

`tests/test_recompute.py` holds held bytes and the stage peak to the saved-tensor counter within 5% (the counter
sees the cache through memory/op_checkpoint.py's counting mode).
"""

from __future__ import annotations

from large_model_training.config import ModelConfig
from large_model_training.planner.shapes import kv_heads_per_rank


def kept_outputs(cfg: ModelConfig, n: int, tp: int, B: int, attention_kept: bool) -> tuple[float, float]:
    """(bytes of the kept matmul outputs, bytes of the kept attention outputs) of one block."""
    a_r, k_r, f_r = cfg.n_heads // tp, kv_heads_per_rank(cfg, tp), cfg.ffn_hidden_size // tp
    matmuls = n * cfg.head_dim * (a_r + 2 * k_r) * B + (2 if cfg.mlp == "swiglu" else 1) * n * f_r * B
    attention = n * a_r * cfg.head_dim * B + 4.0 * n * a_r if attention_kept else 0.0
    return matmuls, attention


def sac_held_bytes(cfg: ModelConfig, n: int, tp: int, B: int, boundary: float, attention_kept: bool) -> float:
    """Bytes one block holds between its forward and its backward under sac (boundary: the block input)."""
    return boundary + sum(kept_outputs(cfg, n, tp, B, attention_kept))


def sac_transient_bytes(
    cfg: ModelConfig, n: int, tp: int, B: int, full_set: float, overlap: float, attention_kept: bool
) -> float:
    """Bytes the recomputation of one block adds in backward: its full saved set less what the cache returns
    (gate and up, or gelu's pre-activation; the attention output and log-sum-exp) and less `overlap` (the block
    input, when the first norm saves that storage)."""
    _, attention = kept_outputs(cfg, n, tp, B, attention_kept)
    first_gemm = (2 if cfg.mlp == "swiglu" else 1) * n * (cfg.ffn_hidden_size // tp) * B
    return full_set - first_gemm - attention - overlap


def sac_recompute_time(elementwise_forward: float, gemm_list: list[float], tp_one: float = 0.0) -> float:
    """Seconds the recomputation adds to a block's backward: its elementwise forward and the output projection
    (the second of the block's GEMMs) with its tp collective; the kept GEMMs and attention are not run again."""
    return elementwise_forward + gemm_list[1] + tp_one
