"""Bypass is never silently skipped (issue #35): a bypassed layer ComfyUI computes without calling its forward gets
its change at the weight cast, and a layer whose forward another pack replaced after ours stops the run.

The fused path is ComfyUI 0.38.0's (Comfy-Org/ComfyUI, comfy/ops.py, function `linear_input_act(linear, x,
input_act, ...)`), emulated on 0.33 / 0.3.75 by a test double (`fused_feed_forward`). Read there: for a weight that
is not a QuantizedTensor, outside training, when `_fp16_linear_wanted(x)` (torch's `allow_fp16_accumulation` on, i.e.
`--fast fp16_accumulation`; activations fp16 on CUDA) it does
`weight, bias, offload_stream = cast_bias_weight(linear, x, offloadable=True)`, returns
`quant_ops.ck.fp16_linear(act(x), weight, bias, ...)` and `uncast_bias_weight(...)`s: the layer's forward never runs,
its weight goes through the cast, which runs its `weight_function`s. Callers as in 0.33 (comfy/ldm/wan/model.py
feed-forward `self[2]`, comfy/ldm/lightricks/model.py `self.net[2]`, comfy/ldm/minimax/model.py `fc2`,
comfy/text_encoders/llama.py `down_proj`). The search tool stores Comfy-Org/ComfyUI's comfy/ops.py only at 5522e4f
(0.33's INT8-only version); the 0.38 branch above was read in a third-party verbatim copy of ComfyUI b2e31e89's
`linear_input_act` / `_fp16_linear_wanted`. The double does the same, on the CPU with F.linear for fp16_linear, on the
SD1.5 FeedForward's output Linear (`ff.net.2`). 0.33 has such a layer itself: comfy/ldm/minimax/audio_vae.py's `qkv`.

Truth: the same file merged (ComfyUI's weight patching, checked against the formulas and lycoris-lora elsewhere),
sampled through the same double (a merge is in the weight, so the double cannot lose it); tolerance as
test_bypass_nodes (RTOL 1e-5 of the sample's norm; each file changes it by > 1e-2).
"""

import logging

import comfy.model_management
import comfy.ops
import pytest
import test_bypass_nodes
import test_nodes
import torch
from comfy.ldm.modules import attention
from comfy.patcher_extension import PatcherInjection
from lycoris_nodes.lycoris_core import LycorisError
from test_bypass_nodes import MID_FF, UKEYS, assert_matches, loader, lokr_dora, no_panel_measurement  # noqa: F401
from test_nodes import TO_Q, listed_loras, lora, write

sd15 = test_nodes.sd15  # fixtures
conds, fp8_models = test_bypass_nodes.conds, test_bypass_nodes.fp8_models

WHY = "computed them without the layer's forward (fused path)"
STEPS = 2  # the log line is per run, not per step
FILES = ("lora", "lokr_dora", "fp8", "to_q")


def fused_feed_forward(self, x):
    """The test double of 0.38's `linear_input_act` fp16 path (module docstring) on FeedForward's last Linear."""
    h = self.net[1](self.net[0](x))
    layer = self.net[2]
    weight, bias, offload_stream = comfy.ops.cast_bias_weight(layer, h, offloadable=True)
    try:
        return torch.nn.functional.linear(h, weight, bias)
    finally:
        comfy.ops.uncast_bias_weight(layer, weight, bias, offload_stream)


@pytest.fixture(scope="module")
def fused():
    mp = pytest.MonkeyPatch()
    mp.setattr(attention.FeedForward, "forward", fused_feed_forward)
    yield
    mp.undo()


def sample(model, conds):
    return test_bypass_nodes.sample(model, conds, steps=STEPS)


def files(msd) -> dict[str, dict[str, torch.Tensor]]:
    """LoRA, and LoKr with DoRA (reads W), on the middle block's ff.net.2 (fused) and attn1.to_q (its forward); for
    the fp8 model the LoKr+DoRA file with a bias change on ff.net.2 (an fp8 bias: bypassed in auto too); a LoRA on
    attn1.to_q alone (changing the sample by > 1e-2 itself) for the replaced forward."""
    lokr = {**lokr_dora(MID_FF, msd[UKEYS[MID_FF]], (4, 8), (80, 160), seed=39, rank=8),
            **lokr_dora(TO_Q, msd[UKEYS[TO_Q]], (8, 8), (40, 40), seed=31, rank=4)}
    return {"lora": {**lora(MID_FF, 320, 1280, seed=51, alpha=4.0), **lora(TO_Q, 320, 320, seed=53)},
            "lokr_dora": lokr,
            "fp8": {**lokr, f"{MID_FF}.diff_b": torch.randn(320, generator=torch.Generator().manual_seed(61)) * 0.05},
            "to_q": lora(TO_Q, 320, 320, seed=53, alpha=16.0)}


@pytest.fixture(scope="module")
def names(sd15, tmp_path_factory):
    """The files, in a loras folder ComfyUI lists."""
    folder = tmp_path_factory.mktemp("loras")
    with listed_loras(folder):
        yield {kind: write(folder, f"{kind}.safetensors", sd) for kind, sd in files(sd15[0].model.state_dict()).items()}


@pytest.fixture(scope="module")
def truths(sd15, conds, names, fused):
    """The unpatched sample and each file's merged one, through the fused double."""
    model = sd15[0]
    return {"base": sample(model, conds),
            **{kind: sample(loader(model, None, names[kind], 0.8, mode="merge")[0], conds)
               for kind in ("lora", "lokr_dora", "to_q")}}


def cast_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if WHY in r.getMessage()]


@pytest.mark.parametrize("kind", FILES[:2])
def test_a_layer_computed_without_its_forward_gets_its_change_at_the_cast(kind, sd15, names, truths, conds, caplog):
    bypassed = loader(sd15[0], None, names[kind], 0.8, mode="bypass")[0]
    with caplog.at_level(logging.INFO, logger="lycoris_nodes"):
        got = sample(bypassed, conds)
    assert_matches(got, truths[kind], truths["base"], f"{kind} bypassed, ff.net.2 computed without its forward")
    lines = cast_lines(caplog)
    assert len(lines) == 1 and "1 layer(s)" in lines[0] and "middle_block.1.transformer_blocks.0.ff.net.2" in lines[0]


def test_auto_on_fp8_weights_and_bias_gets_the_change_at_the_cast(fp8_models, names, conds, fused, caplog):
    fp8, f32 = fp8_models
    base = sample(fp8, conds)
    truth = sample(loader(f32, None, names["fp8"], 1.25, mode="merge")[0], conds)  # into a float copy of the fp8 values
    auto = loader(fp8, None, names["fp8"], 1.25, mode="auto")[0]
    assert not auto.patches  # every change bypassed
    with caplog.at_level(logging.INFO, logger="lycoris_nodes"):
        got = sample(auto, conds)
    assert_matches(got, truth, base, "auto on fp8, ff.net.2 computed without its forward")
    assert len(cast_lines(caplog)) == 1


def replacing(layer_key: str, forward_of):
    """Another pack's injection, set after ours: it replaces the layer's forward with `forward_of(layer, previous)`."""
    def inject(patcher):
        layer = patcher.model.get_submodule(layer_key)
        layer.forward = forward_of(layer, layer.__dict__.get("forward"))
        layer.__dict__["_other_pack"] = layer.forward

    def eject(patcher):
        layer = patcher.model.get_submodule(layer_key)
        if layer.__dict__.pop("_other_pack", None) is layer.__dict__.get("forward"):
            del layer.forward

    return PatcherInjection(inject, eject)


def plain_linear(layer, previous):
    return lambda x: torch.nn.functional.linear(x, layer.weight, layer.bias)  # neither ours nor a cast


def chained(layer, previous):
    return lambda x: previous(x)  # calls the forward it found: ours


def casting(layer, previous):
    def forward(x):
        weight, bias = comfy.ops.cast_bias_weight(layer, x)
        return torch.nn.functional.linear(x, weight, bias)
    return forward


TO_Q_LAYER = UKEYS[TO_Q].removesuffix(".weight")


@pytest.mark.parametrize("other", [plain_linear, chained, casting])
def test_a_forward_replaced_after_ours_is_applied_or_stops_the_run(other, sd15, names, truths, conds):
    bypassed = loader(sd15[0], None, names["to_q"], 0.8, mode="bypass")[0]
    bypassed.set_injections("other pack", [replacing(TO_Q_LAYER, other)])
    if other is plain_linear:
        with pytest.raises(LycorisError, match="replaced their forward") as error:
            sample(bypassed, conds)
        assert TO_Q_LAYER in str(error.value) and names["to_q"] in str(error.value)
    else:
        got = sample(bypassed, conds)
        assert_matches(got, truths["to_q"], truths["base"], f"a forward replaced after ours: {other.__name__}")
    comfy.model_management.unload_all_models()
