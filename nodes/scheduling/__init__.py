"""Several files at once (stacks) and strengths over the sampling steps (hooks)."""
