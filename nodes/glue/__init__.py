"""What binds lycoris_core to ComfyUI, shared by every node family (see nodes/__init__.py)."""
