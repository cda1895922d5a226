"""The example payments API in Python (FastAPI): the HTTP API, tables,
processor simulation and environment variables of ``examples/payments-api``,
behind the ``idem`` package's ASGI middleware and Postgres fence."""
