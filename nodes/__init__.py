"""ComfyUI glue: adapters, key mapping and reports, nodes. Imports ComfyUI; the maths lives in lycoris_core."""
