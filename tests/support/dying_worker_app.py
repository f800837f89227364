"""The smallest app uvicorn's workers can serve that asks, as the API's workers do
(`entrypoints.api.create_app_from_env`), to die with the master that started them: the test of
`gpucloud/children.py` with uvicorn's own supervisor, without the API's imports and database."""

from __future__ import annotations

from gpucloud import children


def create_app():  # a bare ASGI callable
    children.die_with_multiprocessing_parent()

    async def app(scope, receive, send) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
        elif scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    return app
