"""Which prompt tokens differ between a donor and a target request.

Both prompts are aligned over their *valid* (non-padding) token ids with a longest-matching-blocks diff. The
result names positions in each padded prompt, so TGAA can bias the target's key positions and the mask builder
can pick the donor's (and the target's) attention-map rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher


@dataclass(frozen=True)
class TokenDiff:
    # positions in the donor's padded prompt that are not matched in the target (replaced or deleted)
    donor_positions: tuple[int, ...]
    # positions in the target's padded prompt that are not matched in the donor (replaced or inserted)
    target_positions: tuple[int, ...]
    # (donor position, target position) of every matched token
    matched: tuple[tuple[int, int], ...]

    @property
    def identical(self) -> bool:
        return not self.donor_positions and not self.target_positions


def diff_tokens(
    donor_ids: Sequence[int],
    donor_valid: Sequence[bool],
    target_ids: Sequence[int],
    target_valid: Sequence[bool],
) -> TokenDiff:
    if len(donor_ids) != len(donor_valid) or len(target_ids) != len(target_valid):
        raise ValueError("token ids and valid flags must have the same length")
    d_pos = [i for i, v in enumerate(donor_valid) if v]
    t_pos = [i for i, v in enumerate(target_valid) if v]
    a = [donor_ids[i] for i in d_pos]
    b = [target_ids[i] for i in t_pos]
    matcher = SequenceMatcher(a=a, b=b, autojunk=False)
    matched: list[tuple[int, int]] = []
    for block in matcher.get_matching_blocks():
        matched.extend((d_pos[block.a + k], t_pos[block.b + k]) for k in range(block.size))
    d_matched = {d for d, _ in matched}
    t_matched = {t for _, t in matched}
    return TokenDiff(
        donor_positions=tuple(p for p in d_pos if p not in d_matched),
        target_positions=tuple(p for p in t_pos if p not in t_matched),
        matched=tuple(matched),
    )
