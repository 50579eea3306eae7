"""The model's weights: loading a checkpoint, and updates (a manifest, then a write session)."""
