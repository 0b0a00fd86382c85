"""asyncio for Ferry channels: ``await channel.next_event()`` and
``async for event in channel``.

The coroutine waits on the channel's fd with ``loop.add_reader`` (after
``arm``, the channel's own protocol), and takes an event from the channel
only in the step that returns it: there is no await between ``poll`` and
``return``. A wait cancelled at any await (``asyncio.wait_for`` timing out,
``task.cancel()``, on every Python version) has taken nothing, so the
next wait gets the event. No Future ever holds an event.
"""

import asyncio

__all__ = ["next_event", "anext"]


def _wake(waiter):
    if not waiter.done():
        waiter.set_result(None)


async def next_event(channel):
    """The next event of ``channel``, or None once it is closed."""
    loop = asyncio.get_running_loop()
    while True:
        event = channel.poll()
        if event is not None:
            return event
        if channel.closed or channel.state == "closed":
            return None
        if not channel.arm():
            continue
        fd = channel.fileno()
        waiter = loop.create_future()
        loop.add_reader(fd, _wake, waiter)
        try:
            await waiter
        finally:
            loop.remove_reader(fd)


async def anext(channel):
    """``async for``: the next event, StopAsyncIteration once closed."""
    event = await next_event(channel)
    if event is None:
        raise StopAsyncIteration
    return event
