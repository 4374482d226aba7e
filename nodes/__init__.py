"""The ComfyUI side of the pack. Node classes by family on top, the glue below them, lycoris_core at the bottom:

    loading/      LyCORIS Loader (+ Model Only), Rows and Wan 2.2 Experts, Block Weights, block-weight presets
    inspection/   LyCORIS Info, Block Info
    scheduling/   LyCORIS Stack, Apply Stack, Hook, Fade
    tools/        Save, Resize, Extract, Convert, and their command line
    glue/         what binds lycoris_core to ComfyUI: node inputs, file cache, key maps, applying and coverage,
                  the weight adapter, bypass, weights as patched, GGUF, the panel's payload, routes, exact everywhere

Imports only go down (tests/test_packaging.py checks it): a family imports the glue and lycoris_core, never another
family; the glue imports no family.
"""
