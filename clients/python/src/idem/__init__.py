"""Python client for the idem Redis module.

- ``idem.IdemClient`` (sync) and ``idem.asyncio.IdemClient``: ``begin``,
  ``complete``, ``abort``, ``touch``, ``get`` over redis-py, on the module
  or, where Redis is managed, the Functions library (``idem.Backend``);
- typed outcomes ``New``, ``InFlight``, ``Replay``, ``Mismatch`` and one
  exception class per module error code (``idem.errors``);
- ``Fingerprinter``: request fingerprints identical to the Rust client's;
- ``ReadThrough`` / ``AsyncReadThrough``: Postgres read-through;
- ``Fence`` / ``AsyncFence``: the Postgres fence (``idem.fence``);
- ``idem.middleware.IdempotencyMiddleware``: the ASGI middleware.
"""

from idem.backend import Backend
from idem.canonical_json import canonicalize
from idem.client import IdemClient
from idem.errors import (
    BackendMissingError,
    BadArgError,
    CompletedError,
    CorruptError,
    IdemError,
    InternalError,
    ModuleError,
    NoPermError,
    NotFoundError,
    OomError,
    OtherRedisError,
    PostgresError,
    StaleError,
    TooLargeError,
    UnavailableError,
    UnexpectedReplyError,
    WritesRefusedError,
    WrongTypeError,
)
from idem.fence import AsyncFence, Fence
from idem.fingerprint import Fingerprint, Fingerprinter, downstream_key, stored_hex
from idem.keys import (
    InvalidKeyError,
    InvalidTenantError,
    check_tenant,
    parse_key,
    parse_value,
    redis_key,
    tenant_of_lines,
)
from idem.read_through import AsyncReadThrough, MirroredRecord, ReadThrough
from idem.types import (
    BeginOptions,
    InFlight,
    Mismatch,
    New,
    Origin,
    Outcome,
    PulledRecord,
    Record,
    Replay,
    StoredResponse,
)

__all__ = [
    "AsyncFence",
    "AsyncReadThrough",
    "Backend",
    "BackendMissingError",
    "BadArgError",
    "BeginOptions",
    "CompletedError",
    "CorruptError",
    "Fence",
    "Fingerprint",
    "Fingerprinter",
    "IdemClient",
    "IdemError",
    "InFlight",
    "InternalError",
    "InvalidKeyError",
    "InvalidTenantError",
    "MirroredRecord",
    "Mismatch",
    "ModuleError",
    "New",
    "NoPermError",
    "NotFoundError",
    "OomError",
    "Origin",
    "OtherRedisError",
    "Outcome",
    "PostgresError",
    "PulledRecord",
    "ReadThrough",
    "Record",
    "Replay",
    "StaleError",
    "StoredResponse",
    "TooLargeError",
    "UnavailableError",
    "UnexpectedReplyError",
    "WritesRefusedError",
    "WrongTypeError",
    "canonicalize",
    "check_tenant",
    "downstream_key",
    "parse_key",
    "parse_value",
    "redis_key",
    "stored_hex",
    "tenant_of_lines",
]

__version__ = "0.1.0"
