import unittest

from intervals import free_slots, merge, total_busy


class ContainedIntervalTest(unittest.TestCase):
    def test_contained(self):
        self.assertEqual(merge([[9, 17], [10, 11]]), [[9, 17]])

    def test_chain_with_contained(self):
        self.assertEqual(merge([[1, 10], [2, 3], [4, 12], [15, 16]]), [[1, 12], [15, 16]])

    def test_free_slots(self):
        self.assertEqual(free_slots([[9, 17], [10, 11]], 8, 18), [[8, 9], [17, 18]])

    def test_total_busy(self):
        self.assertEqual(total_busy([[0, 60], [15, 30], [90, 120]]), 90)
