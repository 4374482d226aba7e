"""What a file did to a model: where each module went (`Target`, `Applied`) and the coverage report a loader logs
and its panel shows (`ApplyReport`), with the sentences made from it (family verdict, nothing fits, rounded merges).
"""

import re
from collections import Counter
from dataclasses import dataclass, field

from ...lycoris_core import LycorisError, LycorisFile, Module, Plan
from ...lycoris_core.families import compact_name, declared_family, family_id, family_ids, infer_family
from .patch_key import Offset, PatchKey

# Prefixes trainers use for text-encoder modules: explains a miss when no CLIP is connected.
TEXT_ENCODER_PREFIXES = ("lora_te", "lora_prior_te", "text_encoder", "text_encoders.", "te_", "te1_", "te2_")
NO_CLIP = "text-encoder module, but no CLIP is connected"
NO_MODEL = "diffusion-model module, but no MODEL is connected"
# What the coverage line says of a miss by connection (a side not connected): harmless, the other side's business.
NOT_CONNECTED = {NO_CLIP: "text-encoder modules with no CLIP connected",
                 NO_MODEL: "diffusion-model modules with no MODEL connected"}
MAX_LISTED = 20
AT_WEIGHT_CAST = "int8 layers ComfyUI runs without their forward"
@dataclass(frozen=True)
class Target:
    side: str  # "model" or "clip"
    patch_key: PatchKey  # add_patches takes its `as_comfy()`
    shape: tuple[int, ...]  # of what it changes (the part, for an offset)

    @property
    def key(self) -> str:
        return self.patch_key.weight

    @property
    def offset(self) -> Offset | None:
        return self.patch_key.offset


@dataclass(frozen=True)
class Applied:
    target: Target
    plan: Plan
    module: Module


@dataclass(frozen=True)
class ByDesign:
    """A module this model lacks by design, not by a broken file: its name matches `name` (searched in the file's
    module name, any trainer's naming: dots or underscores, any prefix; a `block` group fills `{block}` below), and
    the model has `has` (the rest of that block: it is this architecture) but not `lacks` (the layer its variant is
    built without). With `fits`, the module must also fit `has`'s shape (it is `has`'s twin), so a file for another
    width stays a failure. `side`: whose weights decide ("model" or "clip"); a `{root}` the name does not give is
    tried for each of that side's top-level parts (a CLIP's encoders: qwen25_7b, llama, clip_l, ...)."""
    what: str  # the coverage line's words for all such misses
    reason: str  # each module's
    name: str
    has: str
    lacks: str
    fits: bool = True
    side: str = "model"


_WAN_IMAGE = "Wan I2V image attention on a Wan model without it (T2V, Wan 2.2)"
_WAN_IMAGE_REASON = ("Wan 2.1 I2V image cross-attention: this Wan model has the block's text cross-attention but "
                     "none for images (T2V, Wan 2.2), so there is nothing to change")
_LTX_AUDIO = "LTX-2 audio branch on a video-only LTX model"
_LTX_AUDIO_REASON = ("LTX-2 audio-branch module: this LTX model has no audio branch (no audio_adaln_single, so ComfyUI "
                     "runs it as video-only LTX-Video), so there is nothing to change")
_WAN_BLOCK = r"(?:^|[._])blocks[._](?P<block>\d+)[._]"
_WAN = "diffusion_model.blocks.{block}.cross_attn."
_LTX = "diffusion_model.transformer_blocks.{block}."
# Wan: ComfyUI's WanModel builds k_img / v_img / norm_k_img (WanI2VCrossAttention) and img_emb only for model_type
# "i2v", which its detection gives only to a checkpoint with img_emb (Wan 2.1 I2V / FLF); T2V, Wan 2.2's TI2V 5B and
# I2V A14B have none. diffusers names them attn2.add_k_proj / add_v_proj (fused: to_added_kv) / norm_added_k and
# condition_embedder.image_embedder.
# LTX: ComfyUI's detection makes a checkpoint LTX-2 (LTXAV) exactly when it has audio_adaln_single; LTXAV's audio
# modules are audio_* / video_to_audio_attn in the blocks, audio_* / av_ca_* outside (diffusers: av_cross_attn_*).
# lm_head: OneTrainer wraps every Linear of a text encoder it trains (Nerogar/OneTrainer modules/module/LoRAModule.py
# LoRAModuleWrapper.__create_modules, no filter for text encoders), and its causal-LM encoders have one:
# QwenModel.text_encoder (Qwen2_5_VLForConditionalGeneration) and HiDreamModel.text_encoder_4 (LlamaForCausalLM);
# their lora_text_encoders() name it text_encoder[_4].lm_head, lora_te[4]_lm_head, text_encoders.<root>.transformer.
# lm_head. ComfyUI builds a language model's lm_head only when its config asks (comfy/text_encoders/llama.py
# Llama2_: `if config.lm_head`), which Qwen25_7BVLI_Config and Llama2Config do not: the encoder passes on hidden
# states and never computes logits. Its twin for the shape is the input embedding (vocabulary x hidden width).
_LM_HEAD = "language-model head (lm_head) of a text encoder ComfyUI runs without one"
_LM_HEAD_REASON = ("lm_head of the text encoder's language model: ComfyUI's port of this encoder has none (a text "
                   "encoder passes on hidden states; the head that turns them into next-token logits never runs), so "
                   "there is nothing to change")
_LM = "{root}.transformer.model."
BY_DESIGN = (
    ByDesign(_WAN_IMAGE, _WAN_IMAGE_REASON, _WAN_BLOCK + r"(?:cross[._]attn[._]k[._]img|attn2[._]add[._]k[._]proj)$",
             _WAN + "k.weight", _WAN + "k_img.weight"),
    ByDesign(_WAN_IMAGE, _WAN_IMAGE_REASON, _WAN_BLOCK + r"(?:cross[._]attn[._]v[._]img|attn2[._]add[._]v[._]proj)$",
             _WAN + "v.weight", _WAN + "v_img.weight"),
    ByDesign(_WAN_IMAGE, _WAN_IMAGE_REASON,
             _WAN_BLOCK + r"(?:cross[._]attn[._]norm[._]k[._]img|attn2[._]norm[._]added[._]k)$",
             _WAN + "norm_k.weight", _WAN + "norm_k_img.weight"),
    ByDesign(_WAN_IMAGE, _WAN_IMAGE_REASON, _WAN_BLOCK + r"attn2[._]to[._]added[._]kv$",  # diffusers' fused k/v
             _WAN + "k.weight", _WAN + "k_img.weight", fits=False),
    ByDesign(_WAN_IMAGE, _WAN_IMAGE_REASON, r"(?:^|[._])(?:img[._]emb|condition[._]embedder[._]image[._]embedder)[._]",
             "diffusion_model.blocks.0.cross_attn.k.weight", "diffusion_model.blocks.0.cross_attn.k_img.weight",
             fits=False),
    ByDesign(_LTX_AUDIO, _LTX_AUDIO_REASON,
             r"(?:^|[._])transformer[._]blocks[._](?P<block>\d+)[._](?:audio|video[._]to[._]audio)[._]",
             _LTX + "attn1.to_q.weight", "diffusion_model.audio_adaln_single.linear.weight", fits=False),
    ByDesign(_LTX_AUDIO, _LTX_AUDIO_REASON, r"(?:^|[._])(?:audio|av[._]ca|av[._]cross[._]attn)[._]",
             "diffusion_model.adaln_single.linear.weight", "diffusion_model.audio_adaln_single.linear.weight",
             fits=False),
    ByDesign(_LM_HEAD, _LM_HEAD_REASON,
             r"^(?:lora_te\d*_|text_encoder(?:_\d+)?\.|text_encoders\.(?P<root>\w+)\.transformer\.)lm[._]head$",
             _LM + "embed_tokens.weight", _LM + "lm_head.weight", side="clip"),
)


def by_design(module: Module, shapes: dict[str, dict[str, tuple[int, ...]]]) -> ByDesign | None:
    """The rule saying this model lacks `module` by design, or None. `shapes`: each connected side's weights ("model",
    "clip"); the rule's side decides. The first rule whose name matches decides: a block the model does not have is
    not by design."""
    for rule in BY_DESIGN:
        found = re.search(rule.name, module.prefix)
        if found is None:
            continue
        side = shapes.get(rule.side, {})
        return rule if any(_holds(rule, module, side, groups) for groups in _groups(rule, found, side)) else None
    return None


def _groups(rule: ByDesign, found: re.Match, side: dict) -> list[dict[str, str]]:
    """The values for the rule's `{...}`: the name's groups, and each top-level part of the side for a `{root}` the
    name does not give."""
    groups = {key: value for key, value in found.groupdict().items() if value is not None}
    if "{root}" not in rule.has or "root" in groups:
        return [groups]
    return [{**groups, "root": root} for root in dict.fromkeys(key.split(".", 1)[0] for key in side)]


def _holds(rule: ByDesign, module: Module, side: dict, groups: dict[str, str]) -> bool:
    has, lacks = (key.format(**groups) for key in (rule.has, rule.lacks))
    if has not in side or lacks in side:
        return False
    return not rule.fits or _fits(module, side.get(_part(has, module.param)))


def _part(weight_key: str, param: str) -> str:
    return weight_key.removesuffix(".weight") + ".bias" if param == "bias" else weight_key


def _fits(module: Module, shape: tuple[int, ...] | None) -> bool:
    if shape is None:
        return False
    try:
        module.plan_for(shape)
    except LycorisError:
        return False
    return True


def by_count(counter: Counter) -> list[tuple[str, int]]:
    """Most frequent first, ties by name: the same line for the same model whatever order its layers were met in."""
    return sorted(counter.items(), key=lambda item: (-item[1], item[0]))


@dataclass
class ApplyReport:
    file: str
    total: int
    applied: dict[str, str] = field(default_factory=dict)  # module key -> model key
    labels: Counter = field(default_factory=Counter)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (module key, reason): failures
    # (module key, reason): modules this model or connection lacks by design (ByDesign, NOT_CONNECTED), no failure
    harmless: list[tuple[str, str]] = field(default_factory=list)
    harmless_what: Counter = field(default_factory=Counter)  # the line's words for them -> how many
    unused_keys: list[tuple[str, str]] = field(default_factory=list)
    params_total: int = 0
    params_applied: int = 0
    verdict: str = ""  # one sentence when the file does not look made for this model
    bypassed: int = 0  # patches run in the layers' forward instead of merged (apply_mode bypass/auto)
    # ... of which added to the weight when ComfyUI casts it, on int8 layers it multiplies without their forward
    at_weight_cast: int = 0
    bypassed_formats: Counter = field(default_factory=Counter)  # bypassed weights not stored as plain float
    merged_rounded: Counter = field(default_factory=Counter)  # merged weights whose storage re-rounds W+dW
    warnings: list[str] = field(default_factory=list)  # what the loader assumed where the file says nothing
    notes: list[str] = field(default_factory=list)  # what the file holds beside its modules (module configs): no miss
    targets: dict[str, Applied] = field(default_factory=dict, repr=False)

    def line(self) -> str:
        algos = ", ".join(f"{label} {n}" for label, n in self.labels.most_common())
        share = f", {100 * self.params_applied / self.params_total:.0f}% of parameters" if self.params_total else ""
        bypass = f", {self.bypassed} in bypass" if self.bypassed else ""
        if self.at_weight_cast:
            bypass += f", {self.at_weight_cast} of them added at the weight cast ({AT_WEIGHT_CAST})"
        if self.bypassed_formats:
            bypass += "; " + ", ".join(f"{fmt}: {n} bypassed" for fmt, n in by_count(self.bypassed_formats))
        return (f"{self.file}: {len(self.applied)}/{self.total} modules applied"
                + (f" ({algos}{share}{bypass})" if algos else "") + self.harmless_phrase()
                + (f". {self.verdict}" if self.verdict else ""))

    def harmless_phrase(self) -> str:
        """The misses by design in one phrase: `, 8 not in this model (harmless: <what>)`, or nothing."""
        if not self.harmless:
            return ""
        return (f", {len(self.harmless)} not in this model (harmless: "
                + "; ".join(what for what, _n in by_count(self.harmless_what)) + ")")

    def details(self) -> str:
        rows = [f"  {key}: {reason}" for key, reason in self.problems + self.unused_keys]
        more = f"\n  … and {len(rows) - MAX_LISTED} more" if len(rows) > MAX_LISTED else ""
        return "\n".join(rows[:MAX_LISTED]) + more

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line(), "applied": len(self.applied), "total": self.total,
                "algorithms": dict(self.labels.most_common()), "params_applied": self.params_applied,
                "params_total": self.params_total, "verdict": self.verdict, "bypassed": self.bypassed,
                "at_weight_cast": self.at_weight_cast, "bypassed_formats": dict(by_count(self.bypassed_formats)),
                "warnings": list(self.warnings), "notes": list(self.notes),
                "problems": [list(p) for p in self.problems], "unused_keys": [list(u) for u in self.unused_keys],
                "harmless": [list(h) for h in self.harmless], "harmless_what": dict(by_count(self.harmless_what))}


def family_verdict(lfile: LycorisFile, report: ApplyReport, model_family: str | None) -> str:
    """One sentence when the file does not fit and looks made for another model family than this model's.

    Harmless misses (a side not connected, a module this model lacks by design) are not misfits, and a file of this
    model's own family gets no verdict whatever else went wrong (its problems are listed one by one instead).
    """
    if len(report.problems) < len(report.applied):
        return ""
    declared = declared_family(lfile.metadata)
    inferred = infer_family({m.prefix: m.layout.flat_in for m in lfile.modules.values()})
    file_ids = family_ids(declared) | family_ids(inferred)  # a shared text encoder's: each family's
    model_id = family_id(model_family) or (compact_name(model_family) if model_family else None)
    if model_id is not None and any(model_id.startswith(file_id) for file_id in file_ids):  # Kandinsky5Image
        return ""
    if not file_ids and report.applied:
        return ""  # nothing says it is for another model: the problems list speaks for itself
    made_for = " / ".join(dict.fromkeys(x for x in (declared, inferred) if x)) or "another model"
    return f"This file looks made for {made_for}, not for this {model_family or 'model'}."


def model_family(model) -> str | None:
    config = getattr(model.model, "model_config", None) if model is not None else None
    return type(config).__name__ if config is not None else None


def nothing_applied_error(report: ApplyReport) -> LycorisError:
    """Nothing applied is an error even when every miss is harmless: the file does nothing here."""
    missed = report.problems + report.harmless
    reasons = Counter(reason.split(";")[0] for _, reason in missed).most_common(1)
    examples = ", ".join(key for key, _ in missed[:3])
    return LycorisError(
        f"none of its {report.total} modules fit this model. {report.verdict or ''} "
        f"Most common reason: {reasons[0][0] if reasons else 'none'}. Examples: {examples}", file=report.file)


def rounded_merge_warning(merged_rounded: Counter, apply_mode: str) -> str:
    formats = ", ".join(f"{fmt} {n}" for fmt, n in by_count(merged_rounded))
    hint = "; apply_mode auto keeps it exact (the change runs in those layers' forward)" if apply_mode == "merge" else ""
    return (f"{sum(merged_rounded.values())} patches were merged into quantized weights ({formats}): the merge "
            f"re-rounds W+dW to the stored format, so part of the change is lost{hint}")
