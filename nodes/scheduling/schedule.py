"""Strength schedules through ComfyUI's hooks: a HOOKS output that core nodes (SetClipHooks, SetModelHooksOnCond,
conditioning combine, the keyframe nodes) accept, carrying our adapters and block weights.

The patches are built when ComfyUI registers the hook on a model (only then is the model known), with the same key
mapping, checks and adapters as the loaders; ComfyUI then scales them by the keyframe strength at each step.
"""

import comfy.hooks
from comfy_api.latest import io

from ...lycoris_core import LycorisError, LycorisFile
from ...lycoris_core.block_weights import BlockWeights, parse
from ..glue.apply import by_block_weight, log, patcher_patches
from ..glue.cache import load_cached
from ..glue.inputs import (
    BLOCK_WEIGHTS_TOOLTIP,
    CATEGORY,
    fingerprint_by_file,
    lycoris_input,
    lycoris_path,
    strength_input,
)
from ..glue.lora_files import validate_name

Hooks = io.Custom("HOOKS")
HookKeyframes = io.Custom("HOOK_KEYFRAMES")


class LycorisWeightHook(comfy.hooks.WeightHook):
    """A WeightHook whose patches are our adapters, built for whichever model it is registered on. It holds the file
    as checked when the hook node ran (its private snapshot), not a path: what registers at sampling is what was
    checked, even if the file on disk changed since (the node runs again on the next queue when it does)."""

    def __init__(self, strength_model=1.0, strength_clip=1.0, file: LycorisFile | None = None,
                 block_weights: BlockWeights = None):
        super().__init__(strength_model=strength_model, strength_clip=strength_clip)
        self.file = file
        self.block_weights = block_weights or BlockWeights()
        self.need_weight_init = False

    def clone(self):
        c = super().clone()
        c.file, c.block_weights = self.file, self.block_weights
        return c

    def add_hook_patches(self, model, model_options, target_dict, registered):
        if not self.should_register(model, model_options, target_dict, registered):
            return False
        is_clip = target_dict.get("target") == comfy.hooks.EnumWeightTarget.Clip
        patches, report = patcher_patches(self.file, model, is_clip, reference=False)
        if not report.applied and not is_clip:
            raise LycorisError("none of its modules fit this model", file=report.file)
        if report.problems:
            log.info("LyCORIS hook %s (%s): %d modules do not fit here", report.line(),
                     "clip" if is_clip else "model", len(report.problems))
        strength = self._strength_clip if is_clip else self._strength_model
        for weight, group in by_block_weight(patches, self.block_weights).items():
            model.add_hook_patches(hook=self, patches=group, strength_patch=strength * weight)
        registered.add(self)
        return True


class LycorisHook(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisHook",
            display_name="LyCORIS Hook",
            category=CATEGORY,
            description="A LyCORIS/LoRA file as HOOKS: attach it to conditioning (Set CLIP Hooks, Cond Set Props) "
                        "to schedule its strength over the sampling steps with keyframes, or to apply it only to "
                        "some prompts. Combines with block weights and with other hooks.",
            inputs=[
                lycoris_input(),
                strength_input("strength_model", "diffusion model"),
                strength_input("strength_clip", "text encoder"),
                io.String.Input("block_weights", multiline=True, default="default=1", optional=True,
                                tooltip=BLOCK_WEIGHTS_TOOLTIP),
                Hooks.Input("prev_hooks", optional=True, tooltip="Hooks to combine with this one."),
            ],
            outputs=[Hooks.Output(display_name="HOOKS", tooltip="The hook group, with this file added.")],
        )

    fingerprint_inputs = classmethod(fingerprint_by_file)
    validate_inputs = classmethod(validate_name)

    @classmethod
    def execute(cls, lycoris_name, strength_model, strength_clip, block_weights="default=1", prev_hooks=None):
        file = load_cached(lycoris_path(lycoris_name))  # a damaged file is refused now, not in the middle of sampling
        group = prev_hooks.clone() if prev_hooks is not None else comfy.hooks.HookGroup()
        group.add(LycorisWeightHook(strength_model, strength_clip, file, parse(block_weights)))
        return io.NodeOutput(group)


class LycorisFade(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LycorisFade",
            display_name="LyCORIS Fade (Hook Keyframes)",
            category=CATEGORY,
            description="The common schedule in one node: the hooks' strength goes from strength_start to "
                        "strength_end between start_percent and end_percent of the sampling, in `keyframes` steps, "
                        "and stays at the end value after.",
            inputs=[
                Hooks.Input("hooks", tooltip="The hooks to schedule (e.g. from LyCORIS Hook)."),
                io.Float.Input("strength_start", default=0.0, min=-100.0, max=100.0, step=0.01,
                               tooltip="The multiplier at start_percent."),
                io.Float.Input("strength_end", default=1.0, min=-100.0, max=100.0, step=0.01,
                               tooltip="The multiplier from end_percent on."),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Where the fade starts, as a fraction of the sampling."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Where the fade reaches strength_end."),
                io.Int.Input("keyframes", default=5, min=2, max=100,
                             tooltip="How many strength steps the fade is made of."),
            ],
            outputs=[Hooks.Output(display_name="HOOKS", tooltip="The same hooks with the fade as their keyframes.")],
        )

    @classmethod
    def execute(cls, hooks, strength_start, strength_end, start_percent, end_percent, keyframes):
        if end_percent < start_percent:
            raise LycorisError(f"end_percent {end_percent} is before start_percent {start_percent}")
        group = comfy.hooks.HookKeyframeGroup()
        if start_percent > 0:  # without a keyframe at 0 the hooks would run at full strength until the fade starts
            group.add(comfy.hooks.HookKeyframe(strength_start, 0.0))
        for i in range(keyframes):
            t = i / (keyframes - 1)
            percent = start_percent + t * (end_percent - start_percent)
            group.add(comfy.hooks.HookKeyframe(strength_start + t * (strength_end - strength_start), percent))
        hooks = hooks.clone()
        hooks.set_keyframes_on_hooks(group)
        return io.NodeOutput(hooks)


NODES: list[type[io.ComfyNode]] = [LycorisHook, LycorisFade]
