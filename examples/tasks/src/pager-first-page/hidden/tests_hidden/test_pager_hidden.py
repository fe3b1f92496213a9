import unittest

from pager import paginate


class PaginateTest(unittest.TestCase):
    def test_first_page(self):
        self.assertEqual(paginate(list(range(25)), 1), list(range(10)))

    def test_last_partial_page(self):
        self.assertEqual(paginate(list(range(25)), 3), [20, 21, 22, 23, 24])

    def test_every_item_on_exactly_one_page(self):
        items = list("abcdefg")
        pages = [paginate(items, p, per_page=3) for p in (1, 2, 3)]
        self.assertEqual(sum(pages, []), items)

    def test_single_page(self):
        self.assertEqual(paginate(["x", "y"], 1), ["x", "y"])
