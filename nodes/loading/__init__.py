"""Loader nodes, block weights and their presets."""
