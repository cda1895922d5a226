"""Read-through from the Postgres mirror (spec/read_through.json): when Redis
answers ``new`` for a key the mirror still holds as completed, Redis lost
it; Redis is refilled from the mirror (``IDEM.COMPLETE ... MIRRORED``) and
the stored response answered, so a request never runs twice because Redis
lost data. ``ReadThrough`` (sync, over a ``psycopg_pool.ConnectionPool``)
and ``AsyncReadThrough`` (over an ``AsyncConnectionPool``); the sync one is
generated from the asyncio one (``idem._read_through_async``)."""

from idem._read_through_async import AsyncReadThrough
from idem._read_through_core import (
    _BACKGROUND as _BACKGROUND,
)
from idem._read_through_core import (
    DEFAULT_TIMEOUT,
    LOOKUP_SQL,
    MirroredRecord,
    decode_row,
    in_background,
    settled_within,
)
from idem._read_through_sync import ReadThrough

__all__ = [
    "DEFAULT_TIMEOUT",
    "LOOKUP_SQL",
    "AsyncReadThrough",
    "MirroredRecord",
    "ReadThrough",
    "decode_row",
    "in_background",
    "settled_within",
]
