import unittest

from orders import add_item, close, new_order, summary


class OrdersTest(unittest.TestCase):
    def test_summary(self):
        order = new_order("dana", ["pear", "fig"])
        self.assertEqual(summary(order), "dana: 2 items")

    def test_closed_order_rejects_items(self):
        order = close(new_order("eve", ["kiwi"]))
        with self.assertRaises(ValueError):
            add_item(order, "lime")


if __name__ == "__main__":
    unittest.main()
