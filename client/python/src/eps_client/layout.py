"""The shapes every part of epsd agrees on (core/layout.h, docs/summaries.md).

A summary record is the EPS summary of the keys of one group for one
(layer, KV head): a run of float32 words, padded to a multiple of 4. The pool is
``[slots, layers, kv_heads, record_words]`` float32, row-major.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eps_client import _values
from eps_client.proto import page_selector_pb2 as pb

# The record layout revision this client writes (core/layout.h kSummaryLayoutRevision): 3,
# the quest part on a 16-byte boundary and the quest8 part last. Sent in Attach, so that an
# epsd that reads another layout refuses the session instead of reading the records at the
# wrong offsets.
SUMMARY_LAYOUT = 3

# K/V element types epsd accepts (docs/api.md, ModelLayout.kv_dtype): only the byte
# statistics read it, so an int8 (or fp8, declared int8) cache is counted at a byte a value.
_KV_DTYPES = {"float16": pb.DTYPE_FLOAT16, "bfloat16": pb.DTYPE_BFLOAT16,
              "float32": pb.DTYPE_FLOAT32, "int8": pb.DTYPE_INT8}


@dataclass(frozen=True)
class SummaryFeatures:
    """Optional parts of a record, with core/'s defaults: key_sum and quest on (epsd's default
    method, questclt, reads quest, as quest does; without a quest part the policy is refused),
    principal and quest8 off. With quest8 on, questclt reads that part instead (half the bytes;
    docs/summaries.md)."""

    key_sum: bool = True
    principal: bool = False
    quest: bool = True
    quest8: bool = False  # 8-bit min/max codes and a power-of-two scale: what questclt reads

    def __post_init__(self) -> None:
        for name in ("key_sum", "principal", "quest", "quest8"):
            object.__setattr__(self, name, _values.boolean(f"SummaryFeatures.{name}",
                                                           getattr(self, name)))


@dataclass(frozen=True)
class ModelLayout:
    """The model and paging shape a session attaches with (core::ModelLayout)."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    group_blocks: int = 2
    sketch_dim: int = 8
    phi_seed: int = 0
    kv_dtype: str | int = "float16"  # "float16", "bfloat16", "float32", "int8" (or an eps.v1 DType)
    features: SummaryFeatures = field(default_factory=SummaryFeatures)
    # The coarse level (docs/api.md): 0 for none, else blocks per coarse group, a multiple
    # of group_blocks above it, at most 4096. Its records (the same layout) go to the
    # coarse pool, and the session then needs the coarse buffers (BufferShape.coarse_slots).
    coarse_blocks: int = 0

    def __post_init__(self) -> None:
        """Integers through operator.index (numpy's welcome, floats and bools refused: TypeError
        naming the field), then their ranges (ValueError)."""
        if isinstance(self.kv_dtype, str):
            if self.kv_dtype not in _KV_DTYPES:
                raise ValueError(f"kv_dtype={self.kv_dtype!r} is not one of {sorted(_KV_DTYPES)}")
            object.__setattr__(self, "kv_dtype", _KV_DTYPES[self.kv_dtype])
        else:
            dtype = _values.integer("kv_dtype", self.kv_dtype)
            if dtype not in _KV_DTYPES.values():
                raise ValueError(f"kv_dtype={dtype} is not one of {sorted(_KV_DTYPES)} or their "
                                 f"eps.v1 DType values {sorted(_KV_DTYPES.values())}")
            object.__setattr__(self, "kv_dtype", dtype)
        if not isinstance(self.features, SummaryFeatures):
            raise TypeError(f"features={self.features!r} is not a SummaryFeatures")
        for name, lo, hi in (
            ("num_layers", 1, 4096),
            ("num_q_heads", 1, 4096),
            ("num_kv_heads", 1, 4096),
            ("head_dim", 4, 1024),
            ("block_size", 1, 4096),
            ("group_blocks", 1, 1024),
            ("sketch_dim", 1, 64),
        ):
            value = _values.integer(name, getattr(self, name))
            if not lo <= value <= hi:
                raise ValueError(f"{name}={value} not in [{lo}, {hi}]")
            object.__setattr__(self, name, value)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 4:
            raise ValueError(f"head_dim={self.head_dim} is not a multiple of 4")
        cb = _values.integer("coarse_blocks", self.coarse_blocks)
        object.__setattr__(self, "coarse_blocks", cb)
        if cb != 0 and (cb <= self.group_blocks or cb > 4096 or cb % self.group_blocks):
            raise ValueError(f"coarse_blocks={cb} must be 0 (no coarse level) or a multiple of "
                             f"group_blocks={self.group_blocks} above it, at most 4096")
        object.__setattr__(self, "phi_seed", _values.integer("phi_seed", self.phi_seed))
        if not 0 <= self.phi_seed < 1 << 64:
            raise ValueError(f"phi_seed={self.phi_seed} is not a 64-bit unsigned integer")

    @property
    def group_tokens(self) -> int:
        return self.block_size * self.group_blocks

    @property
    def has_coarse_level(self) -> bool:
        return self.coarse_blocks > 0

    @property
    def gqa_ratio(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def to_proto(self) -> pb.ModelLayout:
        return pb.ModelLayout(
            num_layers=self.num_layers,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            group_blocks=self.group_blocks,
            sketch_dim=self.sketch_dim,
            phi_seed=self.phi_seed,
            kv_dtype=self.kv_dtype,  # type: ignore[arg-type]
            query_dtype=pb.DTYPE_FLOAT32,
            features=pb.SummaryFeatures(
                key_sum=self.features.key_sum,
                principal=self.features.principal,
                quest=self.features.quest,
                quest8=self.features.quest8,
            ),
            summary_layout=SUMMARY_LAYOUT,
            coarse_blocks=self.coarse_blocks,
        )


@dataclass(frozen=True)
class SummaryLayout:
    """Word offsets inside one record; -1 marks an absent part (core::SummaryLayout)."""

    sketch_dim: int
    head_dim: int
    gram_words: int
    fro2: int
    max_norm: int
    count: int
    key_sum: int
    quest_min: int
    quest_max: int
    principal: int
    record_words: int
    quest8: int = -1  # min codes from +0, max codes from +d/4 words, the scale at +d/2

    @staticmethod
    def for_model(model: ModelLayout) -> SummaryLayout:
        m, d = model.sketch_dim, model.head_dim
        gram = packed_size(m)
        nxt = gram + 3
        key_sum = quest_min = quest_max = principal = -1
        if model.features.key_sum:
            key_sum, nxt = nxt, nxt + d
        if model.features.quest:
            # binary16 min then max, two per word: d words in all, from a multiple of 4
            # words (docs/summaries.md)
            nxt = (nxt + 3) // 4 * 4
            quest_min, quest_max, nxt = nxt, nxt + d // 2, nxt + d
        if model.features.principal:
            principal, nxt = nxt, nxt + 3 + (d + 3) // 4
        quest8 = -1
        if model.features.quest8:  # last, from a multiple of 4 words: d int8 min, d max, scale
            nxt = (nxt + 3) // 4 * 4
            quest8, nxt = nxt, nxt + d // 2 + 1
        return SummaryLayout(
            sketch_dim=m,
            head_dim=d,
            gram_words=gram,
            fro2=gram,
            max_norm=gram + 1,
            count=gram + 2,
            key_sum=key_sum,
            quest_min=quest_min,
            quest_max=quest_max,
            principal=principal,
            record_words=(nxt + 3) // 4 * 4,
            quest8=quest8,
        )

    @property
    def record_bytes(self) -> int:
        return self.record_words * 4


def packed_size(m: int) -> int:
    """Words of the packed upper triangle of a symmetric m×m matrix."""
    return m * (m + 1) // 2


def packed_index(m: int, i: int, j: int) -> int:
    """Index of (i, j), i ≤ j, in the packed upper triangle, row-major."""
    return i * m - i * (i - 1) // 2 + (j - i)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of a context of ``tokens`` tokens; 0 for none (core/layout.h BlocksFor: a
    negative count is no blocks, not -1)."""
    return 0 if tokens <= 0 else (tokens - 1) // block_size + 1


def coarse_groups_for(tokens: int, model: ModelLayout) -> int:
    """Coarse groups of a context of ``tokens`` tokens; 0 without a coarse level."""
    if tokens <= 0 or model.coarse_blocks <= 0:
        return 0
    return (blocks_for(tokens, model.block_size) - 1) // model.coarse_blocks + 1


def coarse_group_of(positions: Any, model: ModelLayout) -> Any:
    """The coarse group of token positions (int or array): their block // coarse_blocks."""
    if model.coarse_blocks <= 0:
        raise ValueError("the layout has no coarse level (coarse_blocks=0)")
    return positions // model.block_size // model.coarse_blocks


def groups_for(tokens: int, model: ModelLayout) -> int:
    return (blocks_for(tokens, model.block_size) + model.group_blocks - 1) // model.group_blocks


def visited_tokens(visit_count: int, context_tokens: int, block_size: int) -> int:
    """seqused_k of a visit list whose last block is the sequence's last block."""
    if visit_count <= 0:
        return 0
    # core/visit_list.h VisitedTokens, whose division truncates toward zero: a context of
    # 0 tokens has an empty last block.
    before = context_tokens - 1
    full = before // block_size if before >= 0 else -((-before) // block_size)
    return (visit_count - 1) * block_size + context_tokens - full * block_size
