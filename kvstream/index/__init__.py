"""The router side: a prefix index fed by the event stream.

:class:`PrefixIndex` keeps, per origin and tier, which block chains are held
and answers how long a prefix of a prompt each origin has cached
(:meth:`PrefixIndex.match`). ``kvstream index URL`` serves it over HTTP.
"""

from kvstream.index.hashing import BlockHasher
from kvstream.index.prefix import IndexStatistics, OriginStatistics, PrefixIndex, PrefixMatch

__all__ = [
    "BlockHasher",
    "IndexStatistics",
    "OriginStatistics",
    "PrefixIndex",
    "PrefixMatch",
]
