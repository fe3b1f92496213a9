"""A tiny order book for a shop's checkout."""


def new_order(customer, items=[]):
    """A new open order for `customer`, starting with a copy of `items` (a list of SKUs)."""
    return {"customer": customer, "items": items, "status": "open"}


def add_item(order, sku, quantity=1):
    """Adds `quantity` units of `sku` to an open order and returns the order."""
    if order["status"] != "open":
        raise ValueError("the order is closed")
    for _ in range(quantity):
        order["items"].append(sku)
    return order


def close(order):
    order["status"] = "closed"
    return order


def summary(order):
    """'<customer>: <n> item(s)'."""
    n = len(order["items"])
    return f"{order['customer']}: {n} item{'' if n == 1 else 's'}"
