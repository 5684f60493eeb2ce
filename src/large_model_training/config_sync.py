"""The `sync` section of the configuration (how dp replicas synchronise), apart from config.py so that each
section's file stays readable; config.py re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

from large_model_training.choices import SyncCompression, SyncMode


@dataclass
class SyncConfig:
    """How data-parallel replicas synchronise: every step, or every H steps (DiLoCo; docs/slow_links.md)."""

    mode: SyncMode = SyncMode()
    """'every-step' (gradients averaged each step), 'local:H' (DiLoCo: H inner AdamW steps per replica, then an
    outer Nesterov step on the averaged parameter change) or 'streaming:H' (fragments synced at staggered steps)."""
    outer_lr: float = 0.7
    """Learning rate of the outer Nesterov SGD on the averaged parameter change (DiLoCo: 0.7)."""
    outer_momentum: float = 0.9
    """Nesterov momentum of the outer optimizer (DiLoCo: 0.9); 0 with outer_lr 1 is plain parameter averaging."""
    compression: SyncCompression = SyncCompression.NONE
    """What the outer exchange sends: 'none' (fp32), 'bf16', 'int8' or 'int4' (per-chunk absmax), or 'sign' (1 bit
    and one scale per 256); the lossy ones with error feedback."""
    fragments: int = 4
    """streaming:H: contiguous fragments of the model (by parameter order), synced H / fragments steps apart."""
    overlap: int = 1
    """streaming:H: inner steps a fragment's exchange overlaps before its result is applied (0: at once)."""
    warmup: int = 0
    """First steps whose end averages the replicas' parameters (a dense start, as DiLoCo's pretrained one)."""
