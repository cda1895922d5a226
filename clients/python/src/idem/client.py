"""``IdemClient``: the IDEM.* commands over a redis-py ``Redis`` client (its
asyncio twin is ``idem.asyncio.IdemClient``). The code is in
``idem._client_sync``, generated from ``idem._client_async``."""

from idem._client_sync import IdemClient

__all__ = ["IdemClient"]
