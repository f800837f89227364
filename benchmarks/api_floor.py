"""The floor for `api_load.py`: a minimal FastAPI app on the same database doing the same
primary-key read as `GET /v1/allocations/{id}`, with nothing else (no auth, no admission, no
pagination). Run as its own process, as the API is:

    python benchmarks/api_floor.py DATABASE_URL PORT
"""

from __future__ import annotations

import sys

import uvicorn
from fastapi import FastAPI, HTTPException
from sqlmodel import Session, col, select

from gpucloud.db import get_read_engine
from gpucloud.models.tables import Allocation


def create_app(url: str) -> FastAPI:
    app = FastAPI()
    # The API's reads run on readers' connections (on SQLite: no write lock, beside the one
    # writer); the floor reads the same way.
    engine = get_read_engine(url)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True}

    @app.get("/v1/allocations/{allocation_id}")
    def get_allocation(allocation_id: str) -> dict:
        with Session(engine) as session:
            row = session.exec(select(Allocation).where(col(Allocation.id) == allocation_id)).first()
            if row is None:
                raise HTTPException(404)
            return row.model_dump(mode="json")

    return app


if __name__ == "__main__":
    uvicorn.run(create_app(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
