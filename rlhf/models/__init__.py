"""Model builders and the packed forward pass."""
