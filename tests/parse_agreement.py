"""The agreed relation between the loader's and the summary's readings of one file (issue #37).

Both apply their own rule to one parse (lycoris_file.parse_groups): the loader refuses a file at its first damaged
module, naming file and key; the summary reports the module as damaged and goes on. So for any file:

- the summary refuses it only where the loader does, with the same text (the header, keys that collide, a PEFT
  config that cannot be read: what comes before any module is built);
- a file the loader accepts, the summary reads without damage, with the same modules (key, algorithm, rank) and as
  many unused keys;
- a file the loader refuses at a module, the summary reports damaged, that module first, with the same key and
  reason;
- the loader's other refusals are what the summary, by design, states otherwise: NaN/Inf in tensor data, which the
  summary does not read (of the values it reads, alpha is reported as damage with a text of its own), and a file
  with no module at all, which the summary shows as 0 modules.
"""

import re

from lycoris_nodes.lycoris_core.errors import MAX_NAME, clipped
from lycoris_nodes.lycoris_core.keys import ALPHA

VALUES_REFUSED = "values are NaN or Inf; the file is damaged"  # lycoris_file.check_values, before any parse
NO_MODULE_REFUSED = ("no LyCORIS/LoRA module found among ", "the file holds no tensors")
SUMMARY_ALPHA_REASON = "alpha is NaN or Inf"  # summary._alpha_checked
DAMAGE_LINE = re.compile(r"(?P<count>\d+) damaged modules?: the loader refuses this file \((?P<first>.*)\Z", re.DOTALL)
REASON_SHOWN = 300  # the summary clips the first damaged module's reason to this many characters


def damage(summary) -> tuple[int, str] | None:
    """(how many modules the summary reports damaged, the first one as `'key': reason` plus the line's end)."""
    found = [m for m in map(DAMAGE_LINE.match, summary.warnings) if m]
    assert len(found) <= 1, summary.warnings
    return (int(found[0]["count"]), found[0]["first"]) if found else None


def damage_names(first: str, key: str | None, reason: str) -> bool:
    """Whether the summary's first damaged module is this key with this reason (each clipped as the summary shows
    them), the line ending there or going on with the others' count."""
    shown = f"'{clipped(key or '', MAX_NAME)}': {clipped(reason, REASON_SHOWN)}"
    return first.startswith(shown) and re.fullmatch(r"\)|; and \d+ more\)", first[len(shown):]) is not None


def assert_loader_and_summary_agree(loaded, load_error, summary, summary_error) -> None:
    """`loaded`/`load_error`: the loader's LycorisFile or LycorisError; `summary`/`summary_error`: the summary's
    FileSummary or LycorisError, for the same file."""
    if summary_error is not None:
        assert load_error is not None, f"the summary refuses what the loader reads: {summary_error}"
        assert str(summary_error) == str(load_error), (str(summary_error)[:300], str(load_error)[:300])
        return
    damaged = damage(summary)
    if load_error is None:
        assert damaged is None, f"the summary calls damaged a file the loader reads: {damaged}"
        read = [(key, module.label, module.layout.rank) for key, module in loaded.modules.items()]
        assert [(m.key, m.algorithm, m.rank) for m in summary.modules] == read
        assert summary.unused_keys == len(loaded.unused), (summary.unused_keys, loaded.unused[:5])
        return
    reason = load_error.reason
    if reason.endswith(VALUES_REFUSED):
        if damaged is not None and load_error.key.endswith(f".{ALPHA}") and f"'{load_error.key}'" in damaged[1]:
            assert damage_names(damaged[1], load_error.key, SUMMARY_ALPHA_REASON), damaged
        return
    if reason.startswith(NO_MODULE_REFUSED):
        assert summary.module_count == 0 and damaged is None, (summary.module_count, damaged)
        return
    assert damaged is not None, f"the loader refuses a module the summary reads: {str(load_error)[:300]}"
    assert damage_names(damaged[1], load_error.key, reason), (str(load_error)[:300], damaged)
