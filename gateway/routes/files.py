"""OpenAI's Files API: upload a batch's input, read a batch's output, list and delete.

Each file belongs to the API key that uploaded it (or to the batch whose key it was): other
keys get 404, as for a file that does not exist. Only `purpose=batch` is taken.
"""

from __future__ import annotations

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from common.errors import InvalidRequest, MicrobatchError, ObjectNotFound
from gateway.auth import owner_of
from gateway.files import FileMeta, file_meta, new_file_id
from gateway.request import authorize, error_response
from gateway.services import Services

ROUTE = "/v1/files"
MAX_LIST = 10_000


def _json(body: dict, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


def caller(request: Request) -> tuple[Services, str]:
    """The services and the owner a call acts for (401, 429 as on every API route)."""
    services: Services = request.app.state.services
    key = authorize(services, request.headers.get("authorization"))
    return services, owner_of(key)


async def owned_file(services: Services, owner: str, file_id: str) -> FileMeta:
    meta = await services.files.meta(file_id)
    if meta is None or meta.owner != owner:
        raise ObjectNotFound(f"no file {file_id!r}", param="file_id")
    return meta


async def create(request: Request) -> Response:
    try:
        services, owner = caller(request)
        async with request.form(max_files=1, max_fields=4) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose != "batch":
                raise InvalidRequest(
                    "purpose must be 'batch': this server stores batch input files",
                    param="purpose",
                )
            if not isinstance(upload, UploadFile):
                raise InvalidRequest("send the file as the multipart field `file`", param="file")
            data = await upload.read()
            filename = upload.filename or "upload.jsonl"
        limit = services.settings.max_file_bytes
        if len(data) > limit:
            raise InvalidRequest(
                f"file of {len(data)} bytes exceeds max_file_bytes ({limit})", param="file"
            )
        if not data:
            raise InvalidRequest("the file is empty", param="file")
        meta = file_meta(new_file_id(), data, filename, "batch", owner)
        await services.files.put(meta, data)
    except MicrobatchError as exc:
        return error_response(exc, None)
    return _json(meta.object())


async def listing(request: Request) -> Response:
    try:
        services, owner = caller(request)
        query = request.query_params
        limit = _int(query.get("limit"), MAX_LIST, MAX_LIST, "limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order must be 'asc' or 'desc'", param="order")
        found = await services.files.list(owner)
        purpose = query.get("purpose")
        found = [m for m in found if purpose is None or m.purpose == purpose]
        if order == "desc":
            found.reverse()
        page, more = after_cursor([m.id for m in found], query.get("after"), limit)
        by_id = {m.id: m for m in found}
        data = [by_id[file_id].object() for file_id in page]
    except MicrobatchError as exc:
        return error_response(exc, None)
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return _json(
        {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}
    )


def _int(raw: str | None, default: int, most: int, name: str) -> int:
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= most:
        raise InvalidRequest(f"{name} must be an integer in 1..{most}", param=name)
    return int(raw)


def after_cursor(ids: list[str], after: str | None, limit: int) -> tuple[list[str], bool]:
    """OpenAI's cursor pagination: the `limit` ids past `after` (from the start without
    one; an unknown cursor is a 400), and whether more follow."""
    start = 0
    if after is not None:
        if after not in ids:
            raise InvalidRequest(f"after: no object {after!r} in this list", param="after")
        start = ids.index(after) + 1
    return ids[start : start + limit], start + limit < len(ids)


async def retrieve(request: Request) -> Response:
    try:
        services, owner = caller(request)
        meta = await owned_file(services, owner, request.path_params["file_id"])
    except MicrobatchError as exc:
        return error_response(exc, None)
    return _json(meta.object())


async def content(request: Request) -> Response:
    try:
        services, owner = caller(request)
        meta = await owned_file(services, owner, request.path_params["file_id"])
        try:
            data = await services.files.content(meta.id)
        except FileNotFoundError:
            raise ObjectNotFound(f"no file {meta.id!r}", param="file_id") from None
    except MicrobatchError as exc:
        return error_response(exc, None)
    return Response(data, media_type="application/jsonl")


async def delete(request: Request) -> Response:
    try:
        services, owner = caller(request)
        meta = await owned_file(services, owner, request.path_params["file_id"])
        await services.files.delete(meta.id)
    except MicrobatchError as exc:
        return error_response(exc, None)
    return _json({"id": meta.id, "object": "file", "deleted": True})


def install(app: FastAPI) -> None:
    app.add_api_route(ROUTE, create, methods=["POST"], summary="Upload a batch input file")
    app.add_api_route(ROUTE, listing, methods=["GET"], summary="List files")
    app.add_api_route(ROUTE + "/{file_id}", retrieve, methods=["GET"], summary="A file")
    app.add_api_route(ROUTE + "/{file_id}", delete, methods=["DELETE"], summary="Delete a file")
    app.add_api_route(
        ROUTE + "/{file_id}/content", content, methods=["GET"], summary="A file's bytes"
    )
