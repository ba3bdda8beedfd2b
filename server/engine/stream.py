"""One request's output stream: an async iterator fed thread-safely from the engine thread."""

from __future__ import annotations

import asyncio

from sloserve.engine.outputs import RequestOutput


class RequestStream:
    """Yields RequestOutput until one has finished=True; an exception put in the stream is raised."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from any thread (directly, without waking the loop, from the loop's own thread)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._queue.put_nowait(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def take_ready(self) -> list[RequestOutput]:
        """Outputs already queued behind the one just read, up to a finished one or an exception
        (so a consumer that fell behind can merge them into one message); never waits."""
        ready: list[RequestOutput] = []
        while not self.finished and not self._queue.empty():
            item = self._queue._queue[0]  # NOTE: peek; an exception stays for __anext__ to raise
            if isinstance(item, BaseException):
                break
            ready.append(self._queue.get_nowait())
            if item.finished:
                self.finished = True
        return ready

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item
