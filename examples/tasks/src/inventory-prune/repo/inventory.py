"""In-memory stock keeping."""


class Inventory:
    def __init__(self):
        self.stock = {}

    def add(self, sku, quantity):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self.stock[sku] = self.stock.get(sku, 0) + quantity

    def remove(self, sku, quantity):
        available = self.stock.get(sku, 0)
        if quantity > available:
            raise ValueError(f"only {available} of {sku} in stock")
        self.stock[sku] = available - quantity

    def prune(self):
        """Drops the SKUs whose quantity is zero; returns them in insertion order."""
        dropped = []
        for sku, quantity in self.stock.items():
            if quantity == 0:
                del self.stock[sku]
                dropped.append(sku)
        return dropped
