"""The router side: a prefix index fed by the event stream.

`PrefixIndex` keeps, per stream `(origin, data_parallel_rank)` and tier,
which block chains are held and answers how long a prefix of a prompt each
stream has cached, per tier and scored by tier weights (`PrefixIndex.match()`).
`vllm_extra_keys()` builds the per-block keys vLLM hashes with.
`kvstream index URL` serves it over HTTP.
"""

from kvstream.index._hashing import BlockHasher
from kvstream.index._keys import vllm_extra_keys
from kvstream.index._prefix import (
    DEFAULT_TIER_WEIGHTS,
    IndexStatistics,
    OriginStatistics,
    PrefixIndex,
    PrefixMatch,
)

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "BlockHasher",
    "IndexStatistics",
    "OriginStatistics",
    "PrefixIndex",
    "PrefixMatch",
    "vllm_extra_keys",
]
