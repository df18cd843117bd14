"""Optimizers aware of flexshard placements: :class:`Muon` (distributed, with AdamW)."""

from flexshard.optim.muon import Muon, adjust_lr, zeropower_via_newtonschulz

__all__ = ["Muon", "adjust_lr", "zeropower_via_newtonschulz"]
