"""The tools beyond loading (issue #14): save a weighted stack as one file, resize, extract, convert. Plain torch +
safetensors like the rest of lycoris_core; the nodes and the command line (nodes/tools/*.py, lycoris_tools.py) feed
them ComfyUI's models and folders."""
