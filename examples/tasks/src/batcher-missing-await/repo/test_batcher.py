import asyncio
import unittest

from batcher import Batcher


class ListSink:
    def __init__(self):
        self.batches = []

    async def write(self, batch):
        await asyncio.sleep(0)
        self.batches.append(list(batch))


class BatcherTest(unittest.TestCase):
    def test_close_writes_remainder(self):
        async def main():
            sink = ListSink()
            batcher = Batcher(sink, size=5)
            for item in "ab":
                await batcher.add(item)
            await batcher.close()
            return sink.batches

        self.assertEqual(asyncio.run(main()), [["a", "b"]])


if __name__ == "__main__":
    unittest.main()
