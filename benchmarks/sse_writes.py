"""Server-sent-event writes per second through uvicorn, by HTTP implementation and event loop.

`attn-stack serve` writes one event per token (a multi-step call's tokens in one write), on
the event loop that shares the GIL with the engine thread, so what a write costs there is
time the engine's host work waits for. This times a FastAPI `StreamingResponse` of
``--events`` small events to one client over loopback, for each of uvicorn's HTTP
implementations (h11, pure Python; httptools, C) and event loops (asyncio, uvloop)
installed, and reports writes per second and the process CPU per write (server and
client share the process, and the client's share is small: it reads 64 KiB at a time).
The token's JSON is timed too: pydantic's ``model_dump_json`` of a completion chunk
against the server's per-stream template (``attn_jax.server.app._token_events``).

    python benchmarks/sse_writes.py --out /tmp/sse.json
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import importlib.util
import platform
import socket
import threading
import time
import timeit

from results_io import add_output_args, output_path, write_json


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_all(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.request("GET", "/events")
    response, size = conn.getresponse(), 0
    while chunk := response.read(65536):
        size += len(chunk)
    conn.close()
    return size


def time_writes(http_impl: str, loop: str, events: int) -> dict:
    """One uvicorn server (``http_impl``, ``loop``) streaming ``events`` events, read once to
    warm up and once timed."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/events")
    async def stream():
        async def body():
            for i in range(events):
                yield f'data: {{"i": {i}}}\n\n'

        return StreamingResponse(body(), media_type="text/event-stream")

    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, http=http_impl, loop=loop, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    _read_all(port)
    wall, cpu = time.perf_counter(), time.process_time()
    _read_all(port)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    server.should_exit = True
    thread.join()
    return {"http": http_impl, "loop": loop, "writes_per_s": events / wall, "cpu_us_per_write": 1e6 * cpu / events}


def time_token_json(number: int) -> dict:
    """Microseconds per token event: pydantic's JSON of a chunk against the template."""
    from attn_jax.server.app import _sse, _token_events
    from attn_jax.server.engine_loop import Delta
    from attn_jax.server.protocol import CompletionChoice, CompletionResponse

    def build(text, finish_reason):
        choice = CompletionChoice(text=text, finish_reason=finish_reason)
        return CompletionResponse(
            id="cmpl-0123456789abcdef", created=0, model="SmolLM2-135M-Instruct", choices=[choice]
        )

    event, delta = _token_events(build), Delta(" token", 1)
    return {
        "pydantic_us": 1e6 * timeit.timeit(lambda: _sse(build(delta.text, None)), number=number) / number,
        "template_us": 1e6 * timeit.timeit(lambda: event(delta), number=number) / number,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20000, help="events per timed stream (default: 20000)")
    add_output_args(parser, "sse_writes_cpu.json")
    args = parser.parse_args()
    impls = [h for h in ("h11", "httptools") if importlib.util.find_spec(h)]
    loops = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])
    rows = [time_writes(h, loop, args.events) for h in impls for loop in loops]
    for r in rows:
        rate, cpu = r["writes_per_s"], r["cpu_us_per_write"]
        print(f"{r['http']:>9} + {r['loop']:<7} {rate:>9.0f} writes/s  {cpu:5.1f} us CPU each")
    token = time_token_json(20000)
    print(f"token event JSON: pydantic {token['pydantic_us']:.2f} us, template {token['template_us']:.2f} us")
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
        "events": args.events,
        "writes": rows,
        "token_json": token,
    }
    write_json(output_path(args), result)


if __name__ == "__main__":
    main()
