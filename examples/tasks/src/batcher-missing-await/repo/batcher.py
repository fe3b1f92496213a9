"""Groups items into fixed-size batches for an async sink."""


class Batcher:
    """Collects items and writes them to `sink` (anything with `async def write(batch)`) in
    batches of `size`, as soon as a batch is full. `close()` writes whatever is left."""

    def __init__(self, sink, size=3):
        if size < 1:
            raise ValueError("size must be at least 1")
        self.sink = sink
        self.size = size
        self.pending = []
        self.batches_written = 0

    async def add(self, item):
        self.pending.append(item)
        if len(self.pending) >= self.size:
            self.flush()

    async def flush(self):
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        await self.sink.write(batch)
        self.batches_written += 1

    async def close(self):
        await self.flush()
