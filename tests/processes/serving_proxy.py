"""The round-robin proxy of bench/serving.py between a client and two stub backends, checked;
run as a process by tests/engines/test_serving_bench.py (under whichever venv has aiohttp):

    python -m tests.processes.serving_proxy      # prints "proxy ok", or fails an assert

Backend A and B answer /v1/completions with a body streamed in three writes that names them
and echoes the prompt's first characters, and /v1/models with their name."""
import asyncio
import json
import threading

from aiohttp import ClientSession, web

from bench.serving import Proxy


def _backend_app(name: str) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for part in (f"data: {name}:", body["prompt"][:3], "\n\n"):
            await resp.write(part.encode())
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"from": name})
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return app


def main() -> None:
    loop = asyncio.new_event_loop()
    started = threading.Event()
    ports: list = []
    runners: list = []

    def serve() -> None:
        asyncio.set_event_loop(loop)

        async def start() -> None:
            for name in ("A", "B"):
                r = web.AppRunner(_backend_app(name))
                await r.setup()
                site = web.TCPSite(r, "127.0.0.1", 0)
                await site.start()
                ports.append(site._server.sockets[0].getsockname()[1])
                runners.append(r)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert started.wait(30), "stub backends did not start in 30 s"
    proxy = Proxy([f"http://127.0.0.1:{p}" for p in ports], key_chars=4)

    async def client() -> list:
        async with ClientSession() as s:
            got = []
            for prompt in ("xyz-1", "xyz-2", "uvw-3"):
                async with s.post(proxy.url + "/v1/completions", json={"prompt": prompt}) as r:
                    got.append(await r.text())
            async with s.get(proxy.url + "/v1/models") as r:
                got.append(json.loads(await r.text())["from"])
            return got
    try:
        got = asyncio.run(client())
        assert got == ["data: A:xyz\n\n", "data: B:xyz\n\n", "data: A:uvw\n\n", "A"], got
        arrivals = proxy.arrivals()
        assert [(a.backend, a.key) for a in arrivals] == [(0, "xyz-"), (1, "xyz-"), (0, "uvw-")]
        assert all(a.first_byte is not None and a.first_byte >= a.t for a in arrivals)
        assert proxy.arrivals() == [], "arrivals are handed over once"
        proxy.route([f"http://127.0.0.1:{ports[1]}"])      # a configuration of one server
        got = asyncio.run(client())
        assert got == ["data: B:xyz\n\n"] * 2 + ["data: B:uvw\n\n", "B"], got
    finally:
        proxy.close()

        async def stop() -> None:
            for r in runners:
                await r.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
    print("proxy ok")


if __name__ == "__main__":
    main()
