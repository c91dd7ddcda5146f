"""Agentic RL: tools, tool-calling environments, chat-template token deltas and the
per-trajectory agent loop that drives them on continuously batched engines."""
