"""Keeping a job honest at scale: heartbeats and stall verdicts, the straggler report, the loss-spike guard."""
