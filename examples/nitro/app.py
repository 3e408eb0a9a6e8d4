"""The example application: runs inside the enclave, behind the enclave's Envoy."""

from aiohttp import web


async def hello(_: web.Request) -> web.Response:
    return web.Response(text="hello from inside a Nitro Enclave\n")


app = web.Application()
app.router.add_get("/{tail:.*}", hello)

if __name__ == "__main__":
    web.run_app(app, host="127.0.0.1", port=8080, access_log=None)
