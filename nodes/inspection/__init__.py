"""What a file is, and what it does to a model: LyCORIS Info and LyCORIS Block Info."""
