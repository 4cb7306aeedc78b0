"""A request's deltas as the streams take them: everything that arrived together in one batch
(one write of one event per token), in order, ending at the finishing delta."""

from __future__ import annotations

import asyncio

from attn_jax.server.engine_loop import Delta, RequestHandle


class _Owner:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_deltas_that_arrived_together_come_as_one_batch_up_to_the_finish():
    async def scenario():
        owner = _Owner()
        handle = RequestHandle("r", owner)
        for text in ("a", "b", "c"):  # one multi-step call's three tokens
            handle._queue.put_nowait(Delta(text, 1))
        batches = []
        stream = handle.delta_batches()
        batches.append([d.text for d in await anext(stream)])
        handle._queue.put_nowait(Delta("d", 1))
        handle._queue.put_nowait(Delta("e", 1, finish_reason="length"))
        handle._queue.put_nowait(Delta("late", 1))  # nothing is read past the finish
        batches.append([d.text for d in await anext(stream)])
        assert [b async for b in stream] == []
        handle.close()  # finished: no abort
        return batches, handle.finished, owner.aborted

    batches, finished, aborted = asyncio.run(scenario())
    assert batches == [["a", "b", "c"], ["d", "e"]]
    assert finished and aborted == []


def test_deltas_flattens_the_batches_and_close_aborts_an_unfinished_request():
    async def scenario():
        owner = _Owner()
        handle = RequestHandle("r", owner)
        handle._queue.put_nowait(Delta("x", 1))
        handle._queue.put_nowait(Delta("y", 1, finish_reason="stop"))
        texts = [d.text async for d in handle.deltas()]
        other = RequestHandle("s", owner)
        other.close()
        return texts, owner.aborted

    assert asyncio.run(scenario()) == (["x", "y"], ["s"])


def test_token_events_from_the_template_are_the_bytes_pydantic_writes():
    from attn_jax.server.app import _sse, _token_events
    from attn_jax.server.protocol import ChatChunkChoice, ChatCompletionChunk, ChatLogprobs, DeltaMessage

    def build(text, finish_reason, scores):
        logprobs = None if scores is None else ChatLogprobs.of([scores])
        choice = ChatChunkChoice(
            delta=DeltaMessage(content=text or None), logprobs=logprobs, finish_reason=finish_reason
        )
        return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[choice])

    event = _token_events(build)
    for text in (" hi", 'a"b\\c\n\t', "é中🙂", "\x01\x1f\x7f\u2028", "\ufffd", "@attn-stack-text@"):
        assert event(Delta(text, 1)) == _sse(build(text, None, None))
    assert event(Delta("end", 1, finish_reason="stop")) == _sse(build("end", "stop", None))
    scores = (" hi", -0.5, ((" hi", -0.5), (" ho", -1.25)))  # a token with log-probabilities: built in full
    assert event(Delta(" hi", 1, scores=scores)) == _sse(build(" hi", None, scores))
