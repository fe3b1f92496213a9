import unittest

from inventory import Inventory


class InventoryTest(unittest.TestCase):
    def test_add_remove(self):
        inv = Inventory()
        inv.add("bolt", 5)
        inv.remove("bolt", 2)
        self.assertEqual(inv.stock, {"bolt": 3})

    def test_prune_nothing_sold_out(self):
        inv = Inventory()
        inv.add("nut", 1)
        self.assertEqual(inv.prune(), [])


if __name__ == "__main__":
    unittest.main()
