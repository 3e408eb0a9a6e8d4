"""The enclave's test application: ``/hello`` answers, ``/call`` calls the peer through the
enclave's own outbound mesh listener (so one request proves both directions of the bridges)."""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--outbound", type=int, required=True)
    args = p.parse_args()

    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hello from the enclave")

    async def call(_: web.Request) -> web.Response:
        url = f"http://127.0.0.1:{args.outbound}/from-enclave"
        async with aiohttp.ClientSession() as s, s.get(url) as resp:
            body = (await resp.text()).strip()
            return web.Response(text=f"enclave called peer: {resp.status} {body}")

    app = web.Application()
    app.router.add_get("/hello", hello)
    app.router.add_get("/call", call)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
