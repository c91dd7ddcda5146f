"""Schemas of the SFT, DPO and reward-model entry points (filled in by those trainers)."""
