"""Wan 2.2 A14B's two experts: which file of a HIGH/LOW pair is which, and where its sibling is (issue #36).

Wan 2.2 A14B samples with a high-noise and a low-noise model, and nearly every LoRA for it ships as two files, one
per expert, whose names differ only in the expert's word. The spellings, from the files people share:

    high_noise / low_noise      Comfy-Org's repackaged files (wan2.2_i2v_lightx2v_4steps_lora_v1_high_noise),
                                also high-noise, HighNoise, and the folders high_noise_model/ and low_noise_model/
    HIGH / LOW                  lightx2v's (..._HIGH_fp16 / ..._LOW_fp16), Kijai's (-HIGH- / -LOW-), as a word
                                between separators (_ - . space /), in any case
    HN / LN                     as a word between separators, in any case

A name matches the first rule it holds; its sibling is the same name with the other expert's word in the same case
style. When no file has exactly that name, a file in the same folder whose name differs from it only in its numbers
counts (pairs whose file names carry each expert's own strength or step count), if there is exactly one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

HIGH, LOW = "high", "low"
_EDGE_BEFORE = r"(?:^|(?<=[_\-. /\\]))"
_EDGE_AFTER = r"(?=$|[_\-. /\\])"


@dataclass(frozen=True)
class PairRule:
    """One spelling: the expert's word (group `word`) inside a pattern that holds it."""

    name: str
    high: re.Pattern
    low: re.Pattern


def _rule(name: str, high: str, low: str, template: str) -> PairRule:
    return PairRule(name, *(re.compile(template.format(word=f"(?P<word>{w})"), re.IGNORECASE) for w in (high, low)))


# In order: the first rule a name holds decides (a name with high_noise in it is not read by the HIGH word rule).
RULES: tuple[PairRule, ...] = (
    _rule("high_noise / low_noise", "high", "low", _EDGE_BEFORE + r"{word}[_\- ]?noise"),
    _rule("HIGH / LOW", "high", "low", _EDGE_BEFORE + "{word}" + _EDGE_AFTER),
    _rule("HN / LN", "hn", "ln", _EDGE_BEFORE + "{word}" + _EDGE_AFTER),
)
_OTHER_WORD = {"high": "low", "low": "high", "hn": "ln", "ln": "hn"}


@dataclass(frozen=True)
class ExpertPair:
    """A file of a pair, the expert its name says, and both halves as listed (None: not in the loras folders)."""

    picked: str
    expert: str  # HIGH or LOW: what the picked file's name says
    rule: str
    high: str | None
    low: str | None
    sibling_name: str  # the name the sibling would have

    @property
    def sibling(self) -> str | None:
        return self.low if self.expert == HIGH else self.high


def _same_case(word: str, like: str) -> str:
    if like.isupper():
        return word.upper()
    if like[:1].isupper():
        return word.capitalize()
    return word


def expert_word(name: str) -> tuple[PairRule, str, re.Match] | None:
    """The rule a name holds, the expert it names and where: the first rule with exactly one match decides."""
    for rule in RULES:
        found = [(HIGH, m) for m in rule.high.finditer(name)] + [(LOW, m) for m in rule.low.finditer(name)]
        if len(found) == 1:
            return rule, found[0][0], found[0][1]
        if found:
            return None  # both words, or one twice: no pair can be read from this name
    return None


def _expert_of(name: str) -> str | None:
    held = expert_word(name)
    return None if held is None else held[1]


def _numbers_out(name: str) -> str:
    return re.sub(r"\d+(?:\.\d+)?", "#", name.lower())


def _folder(name: str) -> str:
    return name.replace("\\", "/").rpartition("/")[0]


def find_pair(name: str, listed: list[str]) -> ExpertPair | None:
    """The pair `name` is half of, with its sibling found in `listed` (the loras folders' names); None when the name
    names no expert."""
    held = expert_word(name)
    if held is None:
        return None
    rule, expert, match = held
    word = match.group("word")
    start, end = match.span("word")
    sibling_name = name[:start] + _same_case(_OTHER_WORD[word.lower()], word) + name[end:]
    sibling = sibling_name if sibling_name in listed else None
    if sibling is None:
        by_lower = [n for n in listed if n.lower() == sibling_name.lower()]
        sibling = by_lower[0] if len(by_lower) == 1 else None
    if sibling is None:
        other = LOW if expert == HIGH else HIGH
        loose = [n for n in listed if n != name and _folder(n) == _folder(name)
                 and _numbers_out(n) == _numbers_out(sibling_name) and _expert_of(n) == other]
        sibling = loose[0] if len(loose) == 1 else None
    high, low = (name, sibling) if expert == HIGH else (sibling, name)
    return ExpertPair(name, expert, rule.name, high, low, sibling_name)


# Where a file's metadata says which expert it was trained on. musubi-tuner (kohya-ss/musubi-tuner,
# src/musubi_tuner/hv_train_network.py, NetworkTrainer.train: `ss_sd_model_name` is the --dit file's base name;
# sai_model_spec.build_metadata writes `modelspec.timestep_range` from --min_timestep/--max_timestep) and kohya-style
# trainers keep the base model's file name, which for Wan 2.2 A14B holds the expert's word
# (wan2.2_t2v_high_noise_14B_fp16.safetensors); its output name usually does too. Only the high_noise/low_noise
# spelling is read there.
NAME_KEYS = ("ss_sd_model_name", "ss_output_name", "modelspec.title")
# Wan 2.2 A14B hands over from the high-noise to the low-noise expert at timestep 875 (t2v) or 900 (i2v), of 1000:
# a range wholly above the earlier one is high-noise training, one wholly below the later one low-noise.
HIGH_FROM, LOW_UNTIL = 875, 900


def _timestep_expert(text: str) -> str | None:
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        return None
    if low >= HIGH_FROM:
        return HIGH
    if high <= LOW_UNTIL:
        return LOW
    return None


@dataclass(frozen=True)
class MetadataExpert:
    expert: str
    evidence: str  # "<key> = <value>"


def metadata_expert(metadata: dict[str, str]) -> MetadataExpert | None:
    """The expert a file's metadata names (the timestep range first: it is what the training did), or None."""
    timesteps = metadata.get("modelspec.timestep_range", "")
    if (expert := _timestep_expert(timesteps)) is not None:
        return MetadataExpert(expert, f"modelspec.timestep_range = {timesteps}")
    noise_words = RULES[0]  # only the explicit spelling: a title's "Low" or "HN" may mean anything
    for key in NAME_KEYS:
        value = metadata.get(key, "")
        found = {HIGH: noise_words.high.search(value), LOW: noise_words.low.search(value)}
        if bool(found[HIGH]) != bool(found[LOW]):
            return MetadataExpert(HIGH if found[HIGH] else LOW, f"{key} = {value}")
    return None
