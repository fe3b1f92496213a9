import unittest

from inventory import Inventory


def stocked(**quantities):
    inv = Inventory()
    for sku, quantity in quantities.items():
        inv.add(sku, quantity)
    return inv


class PruneTest(unittest.TestCase):
    def test_prune_sold_out(self):
        inv = stocked(a=1, b=2, c=3)
        inv.remove("a", 1)
        inv.remove("c", 3)
        self.assertEqual(inv.prune(), ["a", "c"])
        self.assertEqual(inv.stock, {"b": 2})

    def test_prune_last(self):
        inv = stocked(x=1, y=1)
        inv.remove("y", 1)
        self.assertEqual(inv.prune(), ["y"])
        self.assertEqual(inv.stock, {"x": 1})

    def test_prune_everything(self):
        inv = stocked(p=1, q=1)
        inv.remove("p", 1)
        inv.remove("q", 1)
        self.assertEqual(inv.prune(), ["p", "q"])
        self.assertEqual(inv.stock, {})
