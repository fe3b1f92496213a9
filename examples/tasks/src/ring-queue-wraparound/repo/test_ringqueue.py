import unittest

from ringqueue import RingQueue


class RingQueueTest(unittest.TestCase):
    def test_fifo(self):
        q = RingQueue(3)
        for item in "abc":
            q.push(item)
        self.assertTrue(q.is_full())
        self.assertEqual([q.pop(), q.pop(), q.pop()], ["a", "b", "c"])

    def test_overflow(self):
        q = RingQueue(1)
        q.push(1)
        with self.assertRaises(OverflowError):
            q.push(2)


if __name__ == "__main__":
    unittest.main()
