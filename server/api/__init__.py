"""The HTTP surface: the routes, the hot routes served as plain ASGI, request schemas, SSE, and
connection bounds."""
