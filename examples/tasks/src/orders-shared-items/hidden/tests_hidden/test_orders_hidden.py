import unittest

from orders import add_item, new_order, summary


class IndependentOrdersTest(unittest.TestCase):
    def test_new_orders_start_empty(self):
        first = new_order("ann")
        add_item(first, "apple", 2)
        second = new_order("bob")
        self.assertEqual(second["items"], [])
        self.assertEqual(summary(first), "ann: 2 items")

    def test_orders_do_not_share_items(self):
        a, b = new_order("a"), new_order("b")
        add_item(a, "x")
        add_item(b, "y")
        self.assertEqual(a["items"], ["x"])
        self.assertEqual(b["items"], ["y"])

    def test_initial_items_are_copied(self):
        initial = ["pear"]
        order = add_item(new_order("cy", initial), "plum")
        self.assertEqual(initial, ["pear"])
        self.assertEqual(order["items"], ["pear", "plum"])
