"""OpenAI-compatible HTTP server: FastAPI front end, engine core in its own process.

    cadence serve [--model PATH] [--host 127.0.0.1] [--port 8000] [engine options]

``api`` holds the routes, ``serving`` the two generation endpoints,
``protocol`` the request bodies, ``formatting`` the response bodies,
``errors`` the error mapping, ``metrics`` /metrics, ``engine_process`` the
engine-core loop, ``bench`` the load benchmark (``cadence bench serve``).
"""
