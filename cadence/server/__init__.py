"""OpenAI-compatible HTTP server: FastAPI front end, engine core in its own process.

    cadence serve [--model PATH] [--host 127.0.0.1] [--port 8000] [engine options]

``api`` holds the routes, ``serving`` the two generation endpoints,
``protocol`` the request bodies, ``formatting`` the response bodies,
``errors`` the error mapping, ``metrics`` /metrics, ``middleware`` the
API key, body-size limit and drain gate, ``bench`` the load benchmark
(``cadence bench serve``). The engine client (``AsyncLLM``) and the
engine-core process it starts live in ``cadence.engine``.
"""
