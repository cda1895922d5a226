"""The Postgres fence (docs/fence.md; the Rust ``idem_client::Fence``): a
key's idempotency row is claimed durably (a short statement of its own,
with a lease) before the handler calls anything outside Postgres, and
completed in the short transaction that writes the business effect, only
while it is still held with the claim's token. The effect and the
authoritative record commit or roll back together whatever Redis forgets,
and no transaction spans a foreign call.

The statements are the Rust crate's, read from spec/fence.json (the Rust
tests assert that file equals its constants) and run as written, with
Postgres' own ``$n`` parameters.

``commit`` sends the completion (asked to fail when the row is not held) and
``COMMIT`` in one round trip, in psycopg's pipeline mode: a completion that
fails aborts the transaction and the server skips the ``COMMIT`` up to the
pipeline's Sync, so nothing commits; the transaction is then rolled back
and the row read outside it. On the partitioned layout a takeover that moved
the row to another partition while the completion waited for the gate fails
it with a serialization failure (40001): the same, unless the row is still
this holder's (then the error). Where pipeline mode is unavailable (a libpq
older than 14) it runs them one after the other (the completion answering
``held``, a ``ROLLBACK`` when it is not).

``commit_effect`` is ``commit`` without a transaction, for an effect that is
one INSERT, UPDATE or DELETE whose values (and so the response) are known
before it runs: spec/fence.json's ``complete_with_effect`` with the effect in
place of its placeholder, one autocommitted statement (one round trip, no
``BEGIN`` or ``COMMIT``) that commits the completion and the effect together
or neither.

``Fence`` works on psycopg connections and ``ConnectionPool``\\s;
``AsyncFence`` is its asyncio twin, the one source: ``Fence`` is generated
from it (``idem._fence_async`` -> ``idem._fence_sync``), what both share is
in ``idem._fence_core``.

Claims answer ``Proceed()``, ``Replay(response)``, ``InFlight(...)`` or
``Mismatch()``; ``complete``/``commit``/``commit_effect`` answer
``Committed()`` or ``Lost(claim)``; ``hold`` answers ``Held()`` or ``Lost(claim)``.
"""

from idem._fence_async import AsyncFence
from idem._fence_core import (
    DEFAULT_LEASE,
    EFFECT_FIRST_PARAM,
    FENCE_RETRY_AFTER_MS,
    MOVED_SQLSTATE,
    NOT_HELD_MESSAGE,
    NOT_HELD_SQLSTATE,
    Claim,
    Committed,
    Held,
    Layout,
    Lost,
    Proceed,
    decide,
    downstream_key_of,
)
from idem._fence_core import (
    _Base as _Base,
)
from idem._fence_core import (
    _effect_statement as _effect_statement,
)
from idem._fence_core import (
    _moved as _moved,
)
from idem._fence_core import (
    _not_held as _not_held,
)
from idem._fence_core import (
    _pipelined as _pipelined,
)
from idem._fence_core import (
    _Report as _Report,
)
from idem._fence_sync import Fence

__all__ = [
    "DEFAULT_LEASE",
    "EFFECT_FIRST_PARAM",
    "FENCE_RETRY_AFTER_MS",
    "MOVED_SQLSTATE",
    "NOT_HELD_MESSAGE",
    "NOT_HELD_SQLSTATE",
    "AsyncFence",
    "Claim",
    "Committed",
    "Fence",
    "Held",
    "Layout",
    "Lost",
    "Proceed",
    "decide",
    "downstream_key_of",
]
