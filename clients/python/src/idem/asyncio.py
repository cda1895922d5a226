"""The asyncio client, ``idem.asyncio.IdemClient``, over ``redis.asyncio.Redis``:
the same calls and answers as the sync ``idem.IdemClient``."""

from idem._client_async import IdemClient

__all__ = ["IdemClient"]
