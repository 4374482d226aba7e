"""LyCORIS Info: what a file is, and what it does to a model."""
