"""The metadata our tools write: modelspec (SAI model spec 1.0) and kohya's `ss_*` fields, which other tools and
our own summary read, plus what the tool did (`lycoris_nodes.*`): its sources and, per module, the rank chosen and the
relative error of the change it reproduces."""

import datetime
from collections.abc import Mapping
from dataclasses import dataclass

from ..families import family_id

# family_id -> (modelspec.architecture stem, ss_base_model_version)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "sd1": ("stable-diffusion-v1", "sd_v1"),
    "sd2": ("stable-diffusion-v2-768-v", "sd_v2"),
    "sdxl": ("stable-diffusion-xl-v1-base", "sdxl_base_v1-0"),
    "sd3": ("stable-diffusion-3-medium", "sd3"),
    "flux": ("flux-1-dev", "flux1"),
}
PACK = "lycoris_nodes"


@dataclass(frozen=True)
class ModuleRecord:
    """What one written module holds: its form ("lora", "locon-tucker", "full", "kept", ...), rank (None for a full
    diff) and the relative Frobenius error of the change it reproduces (0.0 when exact)."""

    form: str
    rank: int | None
    error: float

    def to_json(self) -> dict:
        return {"form": self.form, "rank": self.rank, "error": float(f"{self.error:.3g}")}


def tool_metadata(tool: str, title: str, family: str | None, modules: Mapping[str, ModuleRecord],
                  sources: list[dict], network_module: str, algo: str, settings: Mapping[str, object] | None = None,
                  ) -> dict[str, object]:
    """Metadata for one written file. `family`: the base model's family as ComfyUI or a file names it (e.g. "SD15",
    "sdxl_base_v1-0"), `network_module`: "networks.lora" for plain LoRA/LoCon files, else "lycoris.kohya"."""
    ranks = [r.rank for r in modules.values() if r.rank is not None]
    stem, base_version = ARCHITECTURES.get(family_id(family) or "", (None, None))
    metadata: dict[str, object] = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.title": title,
        "modelspec.date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"),
        "modelspec.description": f"written by LyCORIS Nodes' {tool}",
        "ss_output_name": title,
        "ss_network_module": network_module,
        "ss_network_dim": str(max(ranks)) if ranks else "full",
        "ss_network_alpha": str(max(ranks)) if ranks else "1.0",
        "ss_network_args": {"algo": algo},
        f"{PACK}.tool": tool,
        f"{PACK}.sources": sources,
        f"{PACK}.modules": {key: record.to_json() for key, record in modules.items()},
        f"{PACK}.max_error": max((r.error for r in modules.values()), default=0.0),
    }
    if stem is not None:
        kind = "lora" if network_module == "networks.lora" else "lycoris"
        metadata["modelspec.architecture"] = f"{stem}/{kind}"
        metadata["ss_base_model_version"] = base_version
    elif family:
        metadata["ss_base_model_version"] = family
    if settings:
        metadata[f"{PACK}.settings"] = dict(settings)
    return metadata
