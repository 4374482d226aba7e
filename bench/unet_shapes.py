"""Weight shapes of ComfyUI's own SD1.5 and SDXL UNets, read from the model class built on the meta device.

ComfyUI keeps the full configs inside `model_detection`; here the architecture numbers are written out and merged
with the class's own `unet_config`, and the result is checked by running ComfyUI's detection on the built layout,
which must name the same supported model (so a wrong number here fails loudly instead of benchmarking a made-up
model).
"""

import torch

COMMON = {"use_checkpoint": False, "image_size": 32, "in_channels": 4, "out_channels": 4,
          "use_spatial_transformer": True, "legacy": False, "use_temporal_resblock": False}
ARCHITECTURE = {
    "sd15": {"num_res_blocks": [2, 2, 2, 2], "channel_mult": [1, 2, 4, 4],
             "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "transformer_depth_middle": 1,
             "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]},
    "sdxl": {"num_classes": "sequential", "num_res_blocks": [2, 2, 2], "channel_mult": [1, 2, 4],
             "transformer_depth_middle": 10, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10],
             "num_head_channels": 64},
}
SUPPORTED = {"sd15": "SD15", "sdxl": "SDXL"}


def unet_config(name: str) -> dict:
    import comfy.supported_models

    cls = getattr(comfy.supported_models, SUPPORTED[name])
    return {**COMMON, **ARCHITECTURE[name], **cls.unet_config, **getattr(cls, "unet_extra_config", {})}


def unet_weights(name: str) -> dict[str, tuple[int, ...]]:
    """"diffusion_model.X.weight" -> shape for every Linear and Conv weight (ndim >= 2) of the model, in model order."""
    import comfy.model_detection
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    unet = UNetModel(**unet_config(name), device="meta", dtype=torch.float16, operations=comfy.ops.disable_weight_init)
    state = {f"diffusion_model.{k}": v for k, v in unet.state_dict().items()}
    detected = comfy.model_detection.model_config_from_unet_config(
        comfy.model_detection.detect_unet_config(state, "diffusion_model."), state)
    if type(detected).__name__ != SUPPORTED[name]:
        raise RuntimeError(f"the {name} layout built here is detected by ComfyUI as {type(detected).__name__}")
    return {k: tuple(v.shape) for k, v in state.items() if k.endswith(".weight") and v.ndim >= 2}


def lora_prefix(model_key: str) -> str:
    """The kohya/LyCORIS file prefix ComfyUI's model_lora_keys_unet maps to `diffusion_model.X.weight`."""
    return "lora_unet_" + model_key.removeprefix("diffusion_model.").removesuffix(".weight").replace(".", "_")


def key_map(model_keys) -> dict[str, str]:
    return {lora_prefix(k): k for k in model_keys}
