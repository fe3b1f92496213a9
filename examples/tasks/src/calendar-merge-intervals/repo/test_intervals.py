import unittest

from intervals import free_slots, merge


class IntervalsTest(unittest.TestCase):
    def test_overlap(self):
        self.assertEqual(merge([[3, 5], [1, 4]]), [[1, 5]])

    def test_touching(self):
        self.assertEqual(merge([[1, 2], [2, 3]]), [[1, 3]])

    def test_free(self):
        self.assertEqual(free_slots([[10, 11], [13, 14]], 9, 17), [[9, 10], [11, 13], [14, 17]])


if __name__ == "__main__":
    unittest.main()
