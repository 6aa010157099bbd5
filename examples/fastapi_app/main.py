"""A FastAPI application that enqueues in the same transaction as its SQLAlchemy writes.

    DATABASE_URL=postgresql://localhost/shop uvicorn main:api   # the API
    DATABASE_URL=postgresql://localhost/shop fastjobs run jobs  # the worker

POST /orders writes an order and enqueues the job that prices it in one
transaction: if the request fails after the enqueue, neither exists. GET
/jobs/{id} returns the job's result, waiting for it up to `wait` seconds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import fastjobs
from jobs import DATABASE_URL, app, price_order

# The same database through SQLAlchemy, on psycopg 3: the driver fastjobs joins transactions on.
engine = create_async_engine(DATABASE_URL.replace("postgresql://", "postgresql+psycopg://", 1))
Session = async_sessionmaker(engine, expire_on_commit=False)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str]
    total: Mapped[int | None]


class OrderIn(BaseModel):
    email: str
    amounts: list[int]
    fail_after_enqueue: bool = False  # to show the rollback taking the job with it


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    yield
    await app.aclose()
    await engine.dispose()


api = FastAPI(lifespan=lifespan)


@api.post("/orders")
async def create_order(order: OrderIn) -> dict[str, int]:
    async with Session() as session, session.begin():
        row = Order(email=order.email)
        session.add(row)
        await session.flush()  # the order's id, in the transaction
        job_id = await price_order.using(session).enqueue_async(row.id, order.amounts)
        if order.fail_after_enqueue:
            raise HTTPException(500, "failed after the enqueue: the order and its job are rolled back")
    return {"order": row.id, "job": job_id}


@api.get("/jobs/{job_id}")
async def job_result(job_id: int, wait: float = 0.0) -> dict[str, Any]:
    try:
        value = await app.result_async(job_id, timeout=wait)
    except TimeoutError:
        status = await app.status_async(job_id)
        return {"job": job_id, "state": status.state}
    except fastjobs.JobFailed as exc:
        return {"job": job_id, "state": "discarded", "errors": [e.get("error") for e in exc.errors]}
    except fastjobs.JobNotFound as exc:
        raise HTTPException(404, str(exc)) from None
    return {"job": job_id, "state": "completed", "value": value}
