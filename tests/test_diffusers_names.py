"""diffusers' names for the DiTs ComfyUI has no converter for, as diffusers' own single-file converters give them.

nodes/glue/diffusers_names.json is written by scripts/derive_diffusers_names.py, which runs
`diffusers.loaders.single_file_utils.convert_*_to_diffusers` on ComfyUI's model of each architecture. Here:
- the table is what the installed diffusers' converters give (so a diffusers or ComfyUI change that moves a name
  shows up as a failing test, not as a silently wrong table);
- its rules hold beyond the models they were traced on: for a model of another depth (and width, where the
  converter has no width of its own), our key map gives exactly the weight and rows the converter puts under each
  diffusers name, and nothing it does not.
"""

import pytest
from derive_names import derive
from lycoris_nodes.nodes.glue import keymap
from lycoris_nodes.nodes.glue.patch_key import PatchKey

ARCHS = {arch.name: arch for arch in derive.ARCHS}
WEIGHT = ".weight"

# Other depths and widths than the traced ones. HunyuanVideo keeps 3072: diffusers' converter splits single blocks'
# linear1 at a hard-coded hidden size of 3072, so no other width is a HunyuanVideo it converts; Mochi's converter
# knows only the released model (48 blocks at 3072), so it is checked as traced.
OTHER_SHAPES = {
    "wan": {"num_layers": 5, "dim": 96, "ffn_dim": 160, "num_heads": 6},
    "wan-i2v": {"num_layers": 4, "dim": 96, "ffn_dim": 160, "num_heads": 6},
    "wan-vace": {"num_layers": 6, "vace_layers": 3},
    "hunyuan-video": {"depth": 4, "depth_single_blocks": 5},
    "ltxv": {"num_layers": 5, "attention_head_dim": 12},
    "ltx2": {"num_layers": 4, "attention_head_dim": 12},
    "mochi": {},
    "diffsynth-flux": {"depth": 4, "depth_single_blocks": 2, "hidden_size": 96, "num_heads": 6},
    "flux2": {"depth": 2, "depth_single_blocks": 4, "hidden_size": 3072, "num_heads": 24, "context_in_dim": 7680,
              "guidance_embed": False},  # Klein 4B widths
    "chroma": {"depth": 4, "depth_single_blocks": 2},
    "cosmos-predict2": {"num_blocks": 5},
    "ideogram4": {"num_layers": 2},  # ComfyUI's Ideogram4 fixes the widths (its unet_extra_config)
    "anima": {"num_blocks": 5},
    # MiniMax H3 narrower than released (16 heads of 128), 5 blocks, 2 refiner blocks
    "minimax-h3": {"num_layers": 5, "token_refiner_num_layers": 2, "hidden_size": 2048, "num_attention_heads": 16,
                   "ffn_hidden_size": 4096, "time_embed_hidden_size": 2048},
    "acestep15": {"num_dit_layers": 5},  # built on the CPU (see derive's Arch.device): deeper, not wider
}


# diffusers' model as deep as the one above (for the last check)
OTHER_DIFFUSERS_DEPTH = {
    "wan": {"num_layers": 5, "num_attention_heads": 6, "attention_head_dim": 16, "ffn_dim": 160},
    "wan-i2v": {"num_layers": 4, "num_attention_heads": 6, "attention_head_dim": 16, "ffn_dim": 160},
    "wan-vace": {"num_layers": 3, "vace_layers": [0, 1, 2]},
    "hunyuan-video": {"num_layers": 4, "num_single_layers": 5},
    "ltxv": {"num_layers": 5},
    "ltx2": {"num_layers": 4, "attention_head_dim": 12, "num_attention_heads": 4},
    "mochi": {},
    "diffsynth-flux": None,  # DiffSynth's converter is a rename of every name it knows: nothing to check against
    "flux2": {"num_layers": 2, "num_single_layers": 4, "num_attention_heads": 24, "joint_attention_dim": 7680,
              "guidance_embeds": False},
    "chroma": {"num_layers": 4, "num_single_layers": 2},
    "cosmos-predict2": {"num_layers": 5},
    "ideogram4": {"num_layers": 2},
    "anima": {"num_layers": 5},
    "minimax-h3": {"num_layers": 5, "num_refiner_layers": 2, "hidden_size": 2048, "num_attention_heads": 16,
                   "ffn_dim": 4096, "time_embed_hidden_dim": 2048},
    "acestep15": {"num_hidden_layers": 5},
}


def test_every_traced_architecture_is_checked_at_another_shape():
    assert set(OTHER_SHAPES) == set(ARCHS) == set(OTHER_DIFFUSERS_DEPTH)


def test_the_table_is_what_diffusers_converters_give():
    """On the newest ComfyUI the whole table; on an older one, the rules for the weights its models have (0.3.75
    has no LTX-2, and keeps Flux's norms as `.scale`, which no rule names)."""
    import diffusers

    table = derive.json.loads(derive.TABLE.read_text(encoding="utf-8"))
    if table["diffusers"] != diffusers.__version__:
        pytest.skip(f"the table was traced with diffusers {table['diffusers']}, {diffusers.__version__} is installed")
    for arch in ARCHS.values():
        if not derive.available(arch):
            continue
        model = derive.meta_model(arch)
        stacks = derive.block_stacks(model)
        paths = {path[: -len(WEIGHT)] for path in derive.comfy_params(model) if path.endswith(WEIGHT)}
        here = paths | {derive._indexed(path, stacks)[0] for path in paths}
        expected = dict(table["architectures"][arch.name])
        expected["rules"] = [rule for rule in expected["rules"] if rule["comfy"] in here]
        assert derive.derive([arch])[arch.name] == expected, arch.name


@pytest.mark.parametrize("name", sorted(OTHER_SHAPES))
def test_rules_give_the_converters_weights_at_another_depth_and_width(name):
    arch = ARCHS[name]
    if not derive.available(arch):
        pytest.skip(f"this ComfyUI has no {arch.supported}")
    config = {**arch.config, **OTHER_SHAPES[name]}
    model = derive.meta_model(arch, config)
    traced = {}
    for diffusers_name, value in derive.trace(arch, config).items():
        if value == "converted":
            continue
        key, runs = "diffusion_model." + value.path, value.runs
        if len(runs) > 1:  # all of the weight's rows, in the converter's order
            traced[diffusers_name[: -len(WEIGHT)]] = (key, None, keymap.RowPieces(runs))
        else:
            whole = runs[0] == (0, value.total)
            traced[diffusers_name[: -len(WEIGHT)]] = key if whole else (key, (0, *runs[0]))
    mapped = dict(keymap.converted_module_paths(model, names=arch.names))
    assert mapped, "no rule applied to this model"
    wrong = {name: (target, traced.get(name)) for name, target in mapped.items() if traced.get(name) != target}
    assert wrong == {}
    # Every name the converter gives is mapped, except those that are no module of diffusers' own model (ComfyUI
    # keeps no original name for a few HunyuanVideo embedders and norms, which the converter then passes through).
    depth = OTHER_DIFFUSERS_DEPTH[name]
    known = set(traced) if depth is None else {n[: -len(WEIGHT)] for n in derive.diffusers_weights(arch, depth)}
    assert {n for n in traced if n not in mapped and n in known} == set()


def test_row_pieces_put_a_change_in_comfyui_order():
    """A RowPieces entry, called as ComfyUI calls a key map's converter function on a change in the file's order,
    gives ComfyUI's order: for swapped halves, what ComfyUI's own swap_scale_shift gives; for three runs, each run's
    rows back where they came from."""
    import comfy.utils
    import torch

    change = torch.arange(12.0).reshape(6, 2)
    halves = keymap.RowPieces(((3, 3), (0, 3)))
    assert torch.equal(halves(change), comfy.utils.swap_scale_shift(change))
    assert keymap.row_runs(PatchKey.from_comfy(("w", None, comfy.utils.swap_scale_shift)), 6) == halves.runs
    comfy_rows = torch.arange(6.0)
    file_rows = torch.cat([comfy_rows[4:6], comfy_rows[0:1], comfy_rows[1:4]])
    assert torch.equal(keymap.RowPieces(((4, 2), (0, 1), (1, 3)))(file_rows), comfy_rows)
