import unittest

from ringqueue import RingQueue


class WrapAroundTest(unittest.TestCase):
    def test_push_after_pop(self):
        q = RingQueue(3)
        for item in "abc":
            q.push(item)
        self.assertEqual(q.pop(), "a")
        q.push("d")
        self.assertEqual(list(q), ["b", "c", "d"])
        self.assertEqual(q.peek(), "b")

    def test_long_run(self):
        q = RingQueue(4)
        out = []
        for i in range(20):
            q.push(i)
            if len(q) == 3:
                out.append(q.pop())
        out.extend(q.pop() for _ in range(len(q)))
        self.assertEqual(out, list(range(20)))

    def test_full_after_wrap(self):
        q = RingQueue(2)
        q.push(1)
        q.pop()
        q.push(2)
        q.push(3)
        self.assertTrue(q.is_full())
        with self.assertRaises(OverflowError):
            q.push(4)
        self.assertEqual(list(q), [2, 3])
