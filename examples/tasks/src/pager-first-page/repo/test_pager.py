import unittest

from pager import page_count, paginate


class PageCountTest(unittest.TestCase):
    def test_partial_last_page(self):
        self.assertEqual(page_count(25, 10), 3)

    def test_empty_list_has_one_page(self):
        self.assertEqual(page_count(0, 10), 1)

    def test_page_out_of_range(self):
        with self.assertRaises(ValueError):
            paginate([1, 2, 3], 0)
        with self.assertRaises(ValueError):
            paginate([1, 2, 3], 2, per_page=3)


if __name__ == "__main__":
    unittest.main()
