import asyncio
import unittest

from batcher import Batcher


class ListSink:
    def __init__(self):
        self.batches = []

    async def write(self, batch):
        await asyncio.sleep(0)
        self.batches.append(list(batch))


async def feed(items, size, close=True):
    sink = ListSink()
    batcher = Batcher(sink, size=size)
    for item in items:
        await batcher.add(item)
    if close:
        await batcher.close()
    return sink.batches, batcher


class FullBatchesTest(unittest.TestCase):
    def test_batches_of_three(self):
        batches, batcher = asyncio.run(feed(range(1, 8), 3))
        self.assertEqual(batches, [[1, 2, 3], [4, 5, 6], [7]])
        self.assertEqual(batcher.batches_written, 3)

    def test_written_before_close(self):
        batches, batcher = asyncio.run(feed("abcd", 2, close=False))
        self.assertEqual(batches, [["a", "b"], ["c", "d"]])
        self.assertEqual(batcher.pending, [])

    def test_size_one(self):
        batches, _ = asyncio.run(feed([9, 8], 1))
        self.assertEqual(batches, [[9], [8]])
