"""ai-toolkit's own adapter layouts: its DoRA magnitude and its alpha-less PEFT-format LoRAs.

ai-toolkit is not on the package registry; what it writes is read from its source (ostris/ai-toolkit at 27a03a9):
- toolkit/lora_special.py L423-433: Flux, SD3, Lumina2 and other transformers are saved in "peft format", and there
  `self.alpha = self.lora_dim`: the scale is 1 by definition, and network_mixins.py get_state_dict (L607-622) drops
  the alpha keys and renames lora_down/lora_up to lora_A/lora_B.
- toolkit/models/DoRA.py DoRAModule: the magnitude is a parameter `magnitude` of shape (out,), the row norms of
  W + ΔW (`_get_weight_norm`: torch.linalg.norm(W + s·ΔW, dim=1)); the forward adds
  (magnitude / ‖W + s·ΔW‖ − 1) · (W + s·ΔW) x to W x + s·ΔW x, i.e. the layer becomes (m / ‖W + s·ΔW‖_row) · (W + s·ΔW).
- toolkit/metadata.py get_meta_for_safetensors: metadata `software` = {"name": "ai-toolkit", …}.
Truth below is that forward, transcribed in float64.
"""

import json

import torch
from lycoris_nodes.lycoris_core import apply, parse_state_dict

NAME = "transformer.transformer_blocks.0.attn.to_q"
AI_TOOLKIT_METADATA = {"software": json.dumps({"name": "ai-toolkit", "repo": "https://github.com/ostris/ai-toolkit",
                                               "version": "0.1.0"}), "format": "pt"}
OUT, IN, RANK = 12, 10, 3


def _dora_file(seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)
    weight = torch.randn(OUT, IN)
    down, up = torch.randn(RANK, IN) * 0.3, torch.randn(OUT, RANK) * 0.3
    magnitude = torch.linalg.norm(weight + up @ down, dim=1) * (1 + 0.5 * torch.rand(OUT))  # trained away from init
    return {f"{NAME}.lora_A.weight": down, f"{NAME}.lora_B.weight": up, f"{NAME}.magnitude": magnitude}, weight


def _ai_toolkit_layer(sd: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """DoRAModule's layer at multiplier 1, scale 1 (peft format), in float64."""
    w = weight.double()
    adapted = w + sd[f"{NAME}.lora_B.weight"].double() @ sd[f"{NAME}.lora_A.weight"].double()
    return (sd[f"{NAME}.magnitude"].double() / torch.linalg.norm(adapted, dim=1)).unsqueeze(1) * adapted


def test_ai_toolkit_dora_magnitude_is_read_per_output_row():
    sd, weight = _dora_file()
    lfile = parse_state_dict(sd, "dora.safetensors", AI_TOOLKIT_METADATA)
    assert lfile.unused == [] and list(lfile.modules) == [f"{NAME}.weight"]
    module = lfile.modules[f"{NAME}.weight"]
    patched = weight.clone()
    apply(module.plan_for(tuple(weight.shape)), module.tensors, patched, 1.0)
    truth = _ai_toolkit_layer(sd, weight)
    error = float((patched.double() - truth).abs().max() / (truth - weight.double()).abs().max())
    assert error <= 1e-5, error


def test_ai_toolkit_peft_format_scale_is_defined_not_assumed():
    """No alpha in an ai-toolkit PEFT-format file is its definition (alpha = rank), not missing information: no
    warning. The same tensors without ai-toolkit's metadata keep the warning."""
    sd, _weight = _dora_file()
    lora = {k: v for k, v in sd.items() if not k.endswith("magnitude")}
    own = parse_state_dict(lora, "ai_toolkit.safetensors", AI_TOOLKIT_METADATA)
    assert own.warnings == []
    assert own.modules[f"{NAME}.weight"].layout.scale == 1.0
    other = parse_state_dict(lora, "unknown.safetensors", {})
    assert len(other.warnings) == 1 and "assumed alpha = rank" in other.warnings[0]


def test_the_inspector_says_ai_toolkit_defines_the_scale(tmp_path):
    from lycoris_nodes.lycoris_core.summary import summarize
    from safetensors.torch import save_file

    sd, _weight = _dora_file()
    save_file(sd, str(tmp_path / "a.safetensors"), AI_TOOLKIT_METADATA)
    summary = summarize(tmp_path / "a.safetensors")
    assert summary.warnings == [] and summary.dora_axis == "out"
    assert [(m.rank, m.scale) for m in summary.modules] == [(RANK, 1.0)]
    assert summary.alpha_from["source"] == "ai-toolkit" and summary.alpha_from["line"] in summary.text()
